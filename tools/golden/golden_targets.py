# SPDX-License-Identifier: Apache-2.0
"""make_golden.py: the target fixtures (make_target, make_target_bf16) and their expectations.
"""

import os

import torch

from golden_configs import (E2B_BRIEF_LAYER_TYPES, FULL, MAX_NEW, MAX_SEED_ATTEMPTS, MIN_DISTINCT, MIN_MARGIN, S,
                            SEED, SLIDING, S_B, TARGETS, VOCAB, e2b_like_kwargs)
from golden_util import (build_model, config_form, disable_eos, ensure_tied, f32, fixture_meta, get_shared_kv,
                         greedy_margin, i32, load_model, log, logits_margin, randomise, save_and_reload,
                         save_expected, write_meta)


# ----------------------------------------------------------------------------- target


def probe_brief_e2b_config(device):
    """Tries the brief's literal e2b_like layer types; returns what happened."""
    from transformers import Gemma4ForCausalLM, Gemma4TextConfig

    try:
        cfg = Gemma4TextConfig(**e2b_like_kwargs(E2B_BRIEF_LAYER_TYPES))
        m = build_model(Gemma4ForCausalLM, cfg, torch.float32).to(device).eval()
        with torch.no_grad():
            ids = torch.arange(3, 9, device=device)[None]
            out = m(input_ids=ids, use_cache=False, return_shared_kv_states=True)
        keys = sorted(getattr(out, "shared_kv_states", None) or {})
        return f"ran without error (shared_kv_states keys {keys}); fixture still uses [S,S,F,S,F]"
    except Exception as e:  # noqa: BLE001 - we record any failure
        return f"failed: {type(e).__name__}: {str(e)[:300]}"


def make_target(name, out_root, device, meta_common):
    from transformers import Gemma4ForCausalLM, Gemma4TextConfig

    idx = list(TARGETS).index(name)
    # Seeds are tried in order until greedy decoding is informative (varied tokens, clear
    # argmax margins); the choice is deterministic and recorded in meta.json.
    attempts = []
    for attempt in range(MAX_SEED_ATTEMPTS):
        seed = SEED + 100 * idx + attempt
        gen = torch.Generator().manual_seed(seed)
        torch.manual_seed(seed)
        cfg = Gemma4TextConfig(**TARGETS[name]())
        model = build_model(Gemma4ForCausalLM, cfg, torch.float32).eval()
        rep = randomise(model, gen)
        ensure_tied(model, name)
        input_ids = torch.randint(3, VOCAB, (S,), generator=gen)
        input_ids_b = torch.randint(3, VOCAB, (S_B,), generator=gen)
        quality = generation_quality(model.to(device), input_ids, device)
        attempts.append(dict(seed=seed, **quality))
        log(f"[{name}] seed {seed}: {quality}")
        if quality["ok"]:
            break
    model = model.cpu()
    out_dir = os.path.join(out_root, name)
    model, cfg_json, names = save_and_reload(model, Gemma4ForCausalLM, out_dir, torch.float32)
    model = model.to(device)
    disable_eos(model)
    exp, info = target_expectations(model, input_ids, input_ids_b, device, name)
    save_expected(out_dir, exp)
    meta = fixture_meta(meta_common, name, "target", seed, model, cfg_json, names, rep, exp,
                        seed_attempts=attempts, **info)
    if not attempts[-1]["ok"]:
        meta["caveats"] = ["no seed met the generation-quality bar; the last one was kept"]
    if name == "e2b_like":
        meta["brief_layer_types_probe"] = probe_brief_e2b_config(device)
        meta["caveats"] = meta.get("caveats", []) + [
            "layer_types are [S,S,F,S,F], not the brief's [S,S,S,S,F]: with num_kv_shared_layers=2 "
            "the brief's pattern leaves the shared full layer without a full-attention donor."
        ]
    write_meta(out_dir, meta)
    log(f"[{name}] ok: logits std(pre-cap) {info['logits_precap_std']:.3f}, "
        f"gen margin {info['generate_min_margin']:.4f}, teacher-forced match {info['teacher_forced_match']}")
    return model, input_ids


def generation_quality(model, input_ids, device):
    """Is greedy decoding from input_ids informative? (distinct tokens, margins, logit scale)."""
    disable_eos(model)
    ids = input_ids[None].to(device)
    with torch.no_grad():
        g = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=MAX_NEW,
                           do_sample=False, eos_token_id=None, pad_token_id=0, output_scores=True,
                           return_dict_in_generate=True)
        base = model.model(input_ids=ids, use_cache=False)
        emb = model.get_input_embeddings().weight
        precap_std = float((base.last_hidden_state[0] @ emb.T).std())
    new = g.sequences[0, S:]
    distinct = int(torch.unique(new).numel())
    margin = greedy_margin(g.scores)
    ok = distinct >= MIN_DISTINCT and margin >= MIN_MARGIN and precap_std >= 0.5
    return dict(distinct_generated=distinct, generate_min_margin=margin, logits_precap_std=precap_std, ok=ok)


def target_expectations(model, input_ids, input_ids_b, device, name):
    ids = input_ids[None].to(device)
    with torch.no_grad():
        out, shared, via, base = get_shared_kv(model, ids, device)
        hs = out.hidden_states
        L = model.config.num_hidden_layers
        if len(hs) != L + 1:
            raise RuntimeError(f"{name}: {len(hs)} hidden states, expected {L + 1}")
        if base is None:
            base = model.model(input_ids=ids, attention_mask=torch.ones_like(ids), use_cache=False)
        last_is_post_norm = bool(torch.equal(hs[-1], base.last_hidden_state))
        emb = model.get_input_embeddings().weight
        precap = base.last_hidden_state[0].float() @ emb.float().T
        precap_std = float(precap.std())
        out_b = model(input_ids=input_ids_b[None].to(device), use_cache=False)
        exp = {"input_ids": i32(input_ids)}
        for i, h in enumerate(hs):
            exp[f"hidden_states.{i}"] = f32(h[0])
        exp["logits"] = f32(out.logits[0])
        for t in (SLIDING, FULL):
            k, v = shared[t]
            exp[f"shared_kv.{t}.k"] = f32(k[0])
            exp[f"shared_kv.{t}.v"] = f32(v[0])
        gen_out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=MAX_NEW,
                                 do_sample=False, eos_token_id=None, pad_token_id=0, output_scores=True,
                                 return_dict_in_generate=True)
        seq = gen_out.sequences[0]
        if seq.numel() != S + MAX_NEW:
            raise RuntimeError(f"{name}: generate returned {seq.numel()} tokens, expected {S + MAX_NEW}")
        if not torch.equal(seq[:S].cpu(), input_ids):
            raise RuntimeError(f"{name}: generate did not keep the prompt")
        exp["generate_ids"] = i32(seq)
        # Teacher-forced consistency: a no-cache forward over the generated sequence must
        # predict the same greedy tokens (guards against cache artefacts).
        tf = model(input_ids=seq[None, :-1], use_cache=False).logits[0]
        tf_pred = tf[S - 1:].argmax(-1)
        tf_match = bool(torch.equal(tf_pred.cpu(), seq[S:].cpu()))
        exp["input_ids_b"] = i32(input_ids_b)
        exp["logits_b"] = f32(out_b.logits[0])
    info = dict(
        shared_kv_source=via,
        hidden_states_last_is_post_norm=last_is_post_norm,
        logits_precap_std=precap_std,
        logits_min_top2_margin=logits_margin(out.logits[0]),
        logits_b_min_top2_margin=logits_margin(out_b.logits[0]),
        generate_min_margin=greedy_margin(gen_out.scores),
        teacher_forced_match=tf_match,
        generated_contains_eos_id_1=bool((seq[S:] == 1).any()),
        shared_kv_shapes={t: [list(shared[t][0].shape), list(shared[t][1].shape)] for t in (SLIDING, FULL)},
        generate_kwargs=dict(max_new_tokens=MAX_NEW, do_sample=False, eos_token_id=None, pad_token_id=0),
    )
    return exp, info


def make_target_bf16(out_root, device, meta_common):
    """e2b_like rounded to bf16, saved as a bf16 checkpoint, expectations computed in bf16."""
    from transformers import Gemma4ForCausalLM

    src = os.path.join(out_root, "e2b_like")
    name = "e2b_like_bf16"
    out_dir = os.path.join(out_root, name)
    m = load_model(Gemma4ForCausalLM, src, torch.bfloat16).eval()
    model, cfg_json, names = save_and_reload(m, Gemma4ForCausalLM, out_dir, torch.bfloat16)
    not_bf16 = [n for n, p in model.state_dict().items() if p.is_floating_point() and p.dtype != torch.bfloat16]
    model = model.to(device)
    disable_eos(model)
    from safetensors.torch import load_file

    src_exp = load_file(os.path.join(src, "expected.safetensors"))
    input_ids = src_exp["input_ids"].long()
    input_ids_b = src_exp["input_ids_b"].long()
    exp, info = target_expectations(model, input_ids, input_ids_b, device, name)
    save_expected(out_dir, exp)
    diff = float((exp["logits"] - src_exp["logits"]).abs().max())
    meta = dict(meta_common)
    meta.update(
        fixture=name,
        kind="target",
        seed=None,
        source_fixture="e2b_like",
        dtype="bfloat16",
        model_class=type(model).__name__,
        config=cfg_json,
        config_form=config_form(cfg_json),
        checkpoint_tensors=names,
        expected_tensors={k: [str(v.dtype).replace("torch.", ""), list(v.shape)] for k, v in exp.items()},
        max_abs_logits_diff_vs_fp32=diff,
        tensors_not_bf16_after_load=not_bf16,
        generate_ids_equal_fp32=bool(torch.equal(exp["generate_ids"], src_exp["generate_ids"])),
        caveats=["Weights are the e2b_like fp32 weights rounded to bf16 (round-to-nearest-even) by "
                 "from_pretrained(dtype=bfloat16). Expected tensors were computed by transformers in "
                 "bfloat16 on CPU and are stored as f32 (exact bf16 values). Compare with a loose tolerance; "
                 "bf16 greedy tokens may legitimately diverge once margins are small."],
        **info,
    )
    write_meta(out_dir, meta)
    log(f"[{name}] ok: max |logits - fp32| {diff:.4f}")
