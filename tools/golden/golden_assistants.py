# SPDX-License-Identifier: Apache-2.0
"""make_golden.py: the assistant drafter fixtures (make_assistant): distillation against the
target, the recorded drafter trace and assisted generation.
"""

import os
import traceback

import torch

from golden_configs import (ASSISTANTS, FULL, K_DRAFT, MAX_NEW, S, SEED, SLIDING, TRAIN_BATCH, TRAIN_LR, TRAIN_NEW,
                            TRAIN_SEQS, TRAIN_STEPS, TRAIN_UNROLL, VOCAB)
from golden_util import (build_model, ensure_tied, f32, fixture_meta, get_shared_kv, i32, log, logits_margin,
                         randomise, save_and_reload, save_expected, write_meta)


# ----------------------------------------------------------------------------- assistant


class DraftRecorder:
    """Captures every drafter forward and every candidate-generator round during generate."""

    def __init__(self, drafter):
        self.calls = []
        self.rounds = []
        self.matches = []
        self.handle = drafter.register_forward_hook(self._hook, with_kwargs=True)
        self.patched = []
        from transformers.generation import candidate_generator as cg

        cls = getattr(cg, "SinglePositionMultiTokenCandidateGenerator", None)
        self.cls = cls
        if cls is not None:
            orig_get = cls.get_candidates
            orig_upd = cls.update_candidate_strategy
            rec = self

            def get_candidates(gen_self, *a, **k):
                input_ids = a[0] if a else k["input_ids"]
                r = {"n_cur": int(input_ids.shape[1]), "call_start": len(rec.calls),
                     "num_assistant_tokens": getattr(gen_self, "num_assistant_tokens", None),
                     "schedule": getattr(getattr(gen_self, "assistant_generation_config", None) or
                                         getattr(gen_self, "generation_config", None),
                                         "num_assistant_tokens_schedule", None)}
                res = orig_get(gen_self, *a, **k)
                cand = res[0] if isinstance(res, tuple) else res
                r["drafted"] = int(cand.shape[1] - input_ids.shape[1])
                r["calls"] = len(rec.calls) - r["call_start"]
                rec.rounds.append(r)
                return res

            def update_candidate_strategy(gen_self, *a, **k):
                nm = k.get("num_matches", a[2] if len(a) > 2 else None)
                rec.matches.append(int(nm) if nm is not None else None)
                return orig_upd(gen_self, *a, **k)

            cls.get_candidates = get_candidates
            cls.update_candidate_strategy = update_candidate_strategy
            self.patched = [("get_candidates", orig_get), ("update_candidate_strategy", orig_upd)]

    def _hook(self, module, args, kwargs, output):
        def arg(name, pos):
            if name in kwargs:
                return kwargs[name]
            return args[pos] if len(args) > pos else None

        shared = arg("shared_kv_states", 4)
        am = arg("attention_mask", 3)
        self.calls.append(dict(
            inputs_embeds=arg("inputs_embeds", 1).detach().clone(),
            position_ids=None if arg("position_ids", 2) is None else arg("position_ids", 2).detach().clone(),
            attention_mask=am.detach().clone() if torch.is_tensor(am) else am,
            shared={t: (kv[0].detach().clone(), kv[1].detach().clone()) for t, kv in shared.items()},
            logits=output.logits.detach().clone(),
            hidden=output.last_hidden_state.detach().clone(),
        ))

    def close(self):
        self.handle.remove()
        for n, f in self.patched:
            setattr(self.cls, n, f)


def manual_draft_trace(target, drafter, input_ids, device, hidden_index):
    """Drafter steps after prefill, following SinglePositionMultiTokenCandidateGenerator.get_candidates
    of transformers 5.17: token = the target's first greedy token, position = n_cur - 1 (constant),
    donor K/V of the prefill cropped to n_cur, hidden = the target's post-norm hidden state at
    `hidden_index` (5.17 passes n_last_matches = 0 after prefill, i.e. index 0 = the FIRST prompt
    position; the spec's fixed behaviour, HF PR #48704, uses the last prompt position S - 1)."""
    ids = input_ids[None].to(device)
    out, shared, _, _ = get_shared_kv(target, ids, device)
    first_tok = out.logits[0, -1].argmax()
    n_cur = ids.shape[1] + 1
    hid = out.hidden_states[-1][:, hidden_index:hidden_index + 1]
    shared_c = {t: (k[:, :, :n_cur], v[:, :, :n_cur]) for t, (k, v) in shared.items()}
    pos = torch.tensor([[n_cur - 1]], device=device)
    mask = torch.ones(1, n_cur, dtype=torch.long, device=device)
    emb = target.get_input_embeddings()
    tok = first_tok.view(1, 1)
    steps = []
    for _ in range(K_DRAFT):
        inp = torch.cat([emb(tok), hid], dim=-1)
        o = drafter(inputs_embeds=inp, position_ids=pos, attention_mask=mask, shared_kv_states=shared_c)
        logits = o.logits[0, -1]
        nt = logits.argmax()
        steps.append(dict(inputs_embeds=inp[0], logits=logits, hidden=o.last_hidden_state[0, -1], token=nt))
        tok = nt.view(1, 1)
        hid = o.last_hidden_state
    return dict(first_token=first_tok, shared=shared_c, steps=steps, position=n_cur - 1, n_cur=n_cur,
                all_hidden=out.hidden_states[-1][0])


def train_drafter(drafter, target, gen, device):
    """Briefly distils the target's greedy next-token choice into the drafter, so assisted
    generation accepts some drafts (a random drafter never matches, leaving the accept path of
    the loop untested). Deterministic (seeded, CPU). Data: greedy continuations of random
    prompts; a query at position p+1 sees the target donor K/V of positions <= p (sliding: the
    last W+1 of them), the target's post-norm hidden at p and its own previous post_projection
    output for later steps, and is trained (teacher forcing, TRAIN_UNROLL steps) to predict the
    next greedy tokens. Returns statistics for meta.json."""
    tc = drafter.config.get_text_config()
    w = tc.sliding_window
    prompt = 4
    with torch.no_grad():
        ids = torch.randint(3, VOCAB, (TRAIN_SEQS, prompt), generator=gen).to(device)
        seq = target.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=TRAIN_NEW,
                              do_sample=False, eos_token_id=None, pad_token_id=0)
        out, shared, _, _ = get_shared_kv(target, seq, device)
        hid = out.hidden_states[-1]  # post-norm [N, T, Hb]
        emb = target.get_input_embeddings()(seq)  # scaled target embeddings [N, T, Hb]
    n, t = seq.shape
    # queries: p = prompt-1 .. t-2-TRAIN_UNROLL (inputs at p+1, labels up to p+1+TRAIN_UNROLL)
    ps = torch.arange(prompt - 1, t - 1 - TRAIN_UNROLL)
    q = ps.numel()
    ki = torch.arange(t)[None, :]
    full_ok = ki <= ps[:, None]
    slide_ok = full_ok & (ki >= ps[:, None] - w)
    neg = torch.finfo(torch.float32).min

    def additive(ok):
        return torch.where(ok, 0.0, neg)[None, None].to(device)

    masks = {FULL: additive(full_ok), SLIDING: additive(slide_ok)}
    pos = (ps + 1)[None].to(device)
    ordered = drafter.masked_embedding is not None
    if ordered:
        me = drafter.masked_embedding
        cluster_of = torch.empty(VOCAB, dtype=torch.long, device=device)
        cluster_of[me.token_ordering.long()] = torch.arange(VOCAB, device=device) // me.vocab_size_per_centroid
    opt = torch.optim.Adam(drafter.parameters(), lr=TRAIN_LR)
    drafter.train()
    stats = []
    for step in range(TRAIN_STEPS):
        b = torch.randint(0, n, (TRAIN_BATCH,), generator=gen).to(device)
        kv = {k: (v[0][b], v[1][b]) for k, v in shared.items()}
        h_in = hid[b][:, ps]
        loss = 0.0
        correct = []
        for j in range(TRAIN_UNROLL):
            x = torch.cat([emb[b][:, ps + 1 + j], h_in], dim=-1)
            o = drafter.model(inputs_embeds=drafter.pre_projection(x), attention_mask=masks,
                              position_ids=pos.expand(TRAIN_BATCH, -1), shared_kv_states=kv, use_cache=False)
            ha = o.last_hidden_state
            labels = seq[b][:, ps + 2 + j]
            logits = ha @ drafter.lm_head.weight.T
            loss = loss + torch.nn.functional.cross_entropy(logits.reshape(-1, VOCAB), labels.reshape(-1))
            if ordered:
                cl = me.centroids(ha)
                loss = loss + torch.nn.functional.cross_entropy(cl.reshape(-1, cl.shape[-1]),
                                                                cluster_of[labels].reshape(-1))
            correct.append(float((logits.argmax(-1) == labels).float().mean()))
            h_in = drafter.post_projection(ha)
        opt.zero_grad()
        loss.backward()
        opt.step()
        if step % 50 == 0 or step == TRAIN_STEPS - 1:
            stats.append(dict(step=step, loss=float(loss), top1_per_unroll_step=correct))
    drafter.eval()
    log("  drafter training:", stats[-1])
    return dict(steps=TRAIN_STEPS, lr=TRAIN_LR, batch=TRAIN_BATCH, sequences=TRAIN_SEQS,
                prompt_len=prompt, new_tokens=TRAIN_NEW, unroll=TRAIN_UNROLL, log=stats)


def make_assistant(name, out_root, device, meta_common, targets):
    from transformers import Gemma4AssistantConfig, Gemma4AssistantForCausalLM

    target_name, text_kwargs_fn, ordered = ASSISTANTS[name]
    target, input_ids = targets[target_name]
    idx = list(ASSISTANTS).index(name)
    seed = SEED + 1000 + 100 * idx
    gen = torch.Generator().manual_seed(seed)
    torch.manual_seed(seed)
    acfg_kwargs = dict(text_config=text_kwargs_fn(), backbone_hidden_size=target.config.hidden_size,
                       use_ordered_embeddings=ordered)
    if ordered:
        acfg_kwargs.update(num_centroids=8, centroid_intermediate_top_k=2)
    acfg = Gemma4AssistantConfig(**acfg_kwargs)
    drafter = build_model(Gemma4AssistantForCausalLM, acfg, torch.float32)
    rep = randomise(drafter, gen)
    ensure_tied(drafter, name)
    try:
        training = train_drafter(drafter.to(device), target, gen, device)
    except Exception as e:  # noqa: BLE001 - fall back to the random drafter
        traceback.print_exc()
        training = f"failed ({type(e).__name__}: {e}); the drafter keeps its random weights"
    drafter = drafter.cpu()
    ensure_tied(drafter, name)
    out_dir = os.path.join(out_root, name)
    drafter, cfg_json, names = save_and_reload(drafter, Gemma4AssistantForCausalLM, out_dir, torch.float32)
    drafter = drafter.to(device)
    dg = drafter.generation_config
    dg.eos_token_id = None
    dg.pad_token_id = 0
    dg.num_assistant_tokens = K_DRAFT
    dg.num_assistant_tokens_schedule = "constant"
    if hasattr(dg, "assistant_confidence_threshold"):
        dg.assistant_confidence_threshold = 0.0

    with torch.no_grad():
        manual = manual_draft_trace(target, drafter, input_ids, device, hidden_index=0)
        fixed = manual_draft_trace(target, drafter, input_ids, device, hidden_index=S - 1)
        greedy = target.generate(input_ids=input_ids[None].to(device),
                                 attention_mask=torch.ones(1, S, dtype=torch.long, device=device),
                                 max_new_tokens=MAX_NEW, do_sample=False, eos_token_id=None, pad_token_id=0)[0]
        rec = DraftRecorder(drafter)
        try:
            assisted = target.generate(input_ids=input_ids[None].to(device),
                                       attention_mask=torch.ones(1, S, dtype=torch.long, device=device),
                                       assistant_model=drafter, max_new_tokens=MAX_NEW, do_sample=False,
                                       eos_token_id=None, pad_token_id=0, num_assistant_tokens=K_DRAFT,
                                       num_assistant_tokens_schedule="constant")[0]
        finally:
            rec.close()

    exp = {"input_ids": i32(input_ids)}
    caveats = []
    # The drafter trace: the first drafting round of generate (captured by the hook). The
    # manual reproduction must agree with it.
    first_round = next((r for r in rec.rounds if r["drafted"] > 0), None)
    if first_round is not None:
        c0 = first_round["call_start"]
        calls = rec.calls[c0:c0 + first_round["calls"]]
    else:
        calls = rec.calls[:K_DRAFT]
        caveats.append("candidate-generator rounds were not captured; the trace is the first drafter calls")
    if len(calls) < K_DRAFT:
        raise RuntimeError(f"{name}: first drafting round has {len(calls)} drafter calls, expected {K_DRAFT}")
    calls = calls[:K_DRAFT]
    c = calls[0]
    trace_diff = 0.0
    trace_tokens_equal = True
    for i, (call, st) in enumerate(zip(calls, manual["steps"])):
        trace_diff = max(trace_diff, float((call["inputs_embeds"][0] - st["inputs_embeds"]).abs().max()),
                         float((call["logits"][0, -1] - st["logits"]).abs().max()),
                         float((call["hidden"][0, -1] - st["hidden"]).abs().max()))
        trace_tokens_equal &= int(call["logits"][0, -1].argmax()) == int(st["token"])
    if trace_diff > 1e-5 or not trace_tokens_equal:
        caveats.append(f"manual drafter trace differs from generate's (max abs diff {trace_diff}, tokens equal "
                       f"{trace_tokens_equal}); the stored trace is generate's (hook-captured)")
    for t in (SLIDING, FULL):
        exp[f"draft.shared_kv.{t}.k"] = f32(c["shared"][t][0][0])
        exp[f"draft.shared_kv.{t}.v"] = f32(c["shared"][t][1][0])
    backbone = target.config.hidden_size
    hidden_in = c["inputs_embeds"][0, 0, backbone:]
    exp["draft.hidden_in"] = f32(hidden_in)
    # Which target position's post-norm hidden state was used for the first draft.
    dists = (manual["all_hidden"] - hidden_in[None].to(manual["all_hidden"].device)).abs().amax(-1)
    hidden_index = int(dists.argmin())
    exp["draft.token_in"] = i32(torch.tensor([int(rec_first_token(c, target, manual))]))
    pos = c["position_ids"]
    exp["draft.position"] = i32(pos.reshape(-1)[:1]) if pos is not None else i32(torch.tensor([manual["position"]]))
    if torch.is_tensor(c["attention_mask"]):
        exp["draft.attention_mask"] = i32(c["attention_mask"].reshape(-1))
    for i, call in enumerate(calls):
        exp[f"draft.inputs_embeds.{i}"] = f32(call["inputs_embeds"][0])
        exp[f"draft.logits.{i}"] = f32(call["logits"][0, -1])
        exp[f"draft.next_hidden.{i}"] = f32(call["hidden"][0, -1])
        exp[f"draft.token.{i}"] = i32(call["logits"][0, -1].argmax().view(1))
        if call["position_ids"] is not None and not torch.equal(call["position_ids"], c["position_ids"]):
            caveats.append(f"draft position changes across steps (step {i}: {call['position_ids'].tolist()})")

    # The same round with the last prompt position's hidden state (spec §11 / HF PR #48704).
    for i, st in enumerate(fixed["steps"]):
        exp[f"draft_fixed.inputs_embeds.{i}"] = f32(st["inputs_embeds"])
        exp[f"draft_fixed.logits.{i}"] = f32(st["logits"])
        exp[f"draft_fixed.next_hidden.{i}"] = f32(st["hidden"])
        exp[f"draft_fixed.token.{i}"] = i32(st["token"].view(1))
    exp["generate_ids"] = i32(greedy)
    exp["assisted_ids"] = i32(assisted)
    equal = bool(torch.equal(greedy.cpu(), assisted.cpu()))
    # Whole assisted loop: per round and per drafter call.
    rounds = rec.rounds
    n_curs = [r["n_cur"] for r in rounds] + [int(assisted.numel())]
    accepted = []
    for j, r in enumerate(rounds):
        committed = n_curs[j + 1] - r["n_cur"]
        accepted.append(committed - 1 if r["drafted"] > 0 else 0)
    if rounds:
        exp["assisted.round_n_cur"] = i32(torch.tensor([r["n_cur"] for r in rounds]))
        exp["assisted.drafted_per_round"] = i32(torch.tensor([r["drafted"] for r in rounds]))
        exp["assisted_accepted_per_round"] = i32(torch.tensor(accepted))
    if rec.calls:
        exp["assisted.draft_logits"] = f32(torch.stack([cl["logits"][0, -1] for cl in rec.calls]))
        exp["assisted.draft_inputs_embeds"] = f32(torch.stack([cl["inputs_embeds"][0, -1] for cl in rec.calls]))
        exp["assisted.draft_tokens"] = i32(torch.stack([cl["logits"][0, -1].argmax() for cl in rec.calls]))
        if all(cl["position_ids"] is not None for cl in rec.calls):
            exp["assisted.draft_positions"] = i32(torch.stack([cl["position_ids"].reshape(-1)[0] for cl in rec.calls]))
        exp["assisted.draft_kv_len"] = i32(torch.tensor([[cl["shared"][SLIDING][0].shape[2], cl["shared"][FULL][0].shape[2]]
                                                          for cl in rec.calls]))
    save_expected(out_dir, exp)

    meta = fixture_meta(
        meta_common, name, "assistant", seed, drafter, cfg_json, names, rep, exp,
        target_fixture=target_name,
        drafter_training=training,
        assisted_equals_greedy=equal,
        greedy_generate_ids=greedy.tolist(),
        assisted_ids=assisted.tolist(),
        generate_kwargs=dict(max_new_tokens=MAX_NEW, do_sample=False, eos_token_id=None, pad_token_id=0,
                             num_assistant_tokens=K_DRAFT, num_assistant_tokens_schedule="constant"),
        drafter_generation_config={k: getattr(dg, k, None) for k in
                                   ("num_assistant_tokens", "num_assistant_tokens_schedule",
                                    "assistant_confidence_threshold", "eos_token_id")},
        rounds=rounds,
        num_matches_from_update_candidate_strategy=rec.matches,
        accepted_per_round=accepted,
        drafter_calls=len(rec.calls),
        first_draft_hidden_index=hidden_index,
        first_draft_hidden_max_abs_diff=float(dists.min()),
        first_draft_kv_len={t: int(c["shared"][t][0].shape[2]) for t in (SLIDING, FULL)},
        first_draft_attention_mask=(c["attention_mask"].tolist() if torch.is_tensor(c["attention_mask"])
                                    else repr(c["attention_mask"])),
        manual_trace_max_abs_diff=trace_diff,
        manual_trace_tokens_equal=trace_tokens_equal,
        draft_logits_min_top2_margin=min(logits_margin(cl["logits"][0, -1]) for cl in rec.calls) if rec.calls else None,
        caveats=caveats,
    )
    write_meta(out_dir, meta)
    log(f"[{name}] ok: assisted==greedy {equal}, rounds {len(rounds)}, calls {len(rec.calls)}, "
        f"accepted {accepted}, hidden index {hidden_index}, manual diff {trace_diff:.2e}")
    if not equal:
        raise RuntimeError(f"{name}: assisted generation {assisted.tolist()} != greedy {greedy.tolist()}")


def rec_first_token(call, target, manual):
    """The token whose (target) embedding forms the first half of the first drafter input."""
    backbone = target.config.hidden_size
    e = call["inputs_embeds"][0, 0, :backbone]
    table = target.get_input_embeddings()
    all_ids = torch.arange(VOCAB, device=e.device)
    rows = table(all_ids[None])[0]
    return int((rows - e[None]).abs().amax(-1).argmin())
