# SPDX-License-Identifier: Apache-2.0
"""`train_family.py --drafter-only`: retrains the assistant drafter against the COMMITTED target.

Loads models/gemma4-tiny-py (target + tokenizer; its files are only read, and their sha256s are
checked against tests/golden/embedded/meta.json before and after), regenerates a larger and more
varied pool of the target's greedy continuations (prompts cut at random offsets of the training
and validation splits, never the held-out split; one prompt length per generate batch), adds
teacher-forced windows of raw training/validation text, trains a FRESH drafter with the same
config, initialisation, loss and engine draft-step semantics as the full run (the functions of
train_family.py, passed in as `tf`), reusing the committed checkpoint's balanced token_ordering,
and evaluates it exactly as the full run does (same 64 held-out prompts, K = 4, centroid and
dense heads).

Rewrites only: models/gemma4-tiny-py-assistant/{model.safetensors, config.json} (its
generation_config.json and tokenizer files keep their bytes), the spec_accepted.<i> /
spec_drafted.<i> tensors of tests/golden/embedded/expected.safetensors (every other tensor is
verified bit-identical after the rewrite), the drafter / speculative / phases / golden-prompt
parts of meta.json, and models/README.md (regenerated with the new drafter numbers).
"""

import json
import os
import re
import tarfile
import time
import traceback

import torch

# The full run's command line, used for the model card when the old card cannot be parsed.
FAMILY_ARGS_FALLBACK = {"target_minutes": 4.5, "drafter_minutes": 3.0, "seed": 1234, "deadline_seconds": 464}


def source_of(i, valid_fraction):
    """Split for batch i: 'valid' on a regular pattern that gives the requested share."""
    return "valid" if int((i + 1) * valid_fraction) > int(i * valid_fraction) else "train"


def cut_prompts(stream, n, length, bos, gen, device):
    """n rows of [bos] + `length` - 1 consecutive stream tokens at random offsets ([n, length])."""
    starts = torch.randint(0, stream.numel() - length, (n,), device=device, generator=gen)
    body = stream[starts[:, None] + torch.arange(length - 1, device=device)]
    return torch.cat([torch.full((n, 1), bos, dtype=torch.long, device=device), body], 1)


@torch.no_grad()
def generate_mixed_pool(tf, target, streams, budget, args, device):
    """Greedy continuations (args.gen_new tokens) by the target of args.gen_batch prompts per
    batch; batch i takes its prompts from the split source_of(i) and its prompt length from
    args.prompt_lens (cycled). Stops before a batch would overrun `budget` seconds. Returns
    [(L0, [gen_batch, L0 + gen_new] long)] and info."""
    gc = target.generation_config
    gc.eos_token_id = None
    gc.pad_token_id = tf.PAD
    gc.do_sample = False
    g = torch.Generator(device=device).manual_seed(args.seed + 7)
    pool, batches = [], []
    t_start = time.time()
    per_call = 0.0
    i = 0
    while i < args.pool_max_batches:
        el = time.time() - t_start
        if pool and el + 1.1 * per_call > budget:
            break
        src = source_of(i, args.pool_valid_fraction)
        L0 = args.prompt_lens[i % len(args.prompt_lens)]
        prompts = cut_prompts(streams[src], args.gen_batch, L0, tf.BOS, g, device)
        t1 = time.time()
        with torch.autocast(device.type, dtype=torch.bfloat16):
            out = target.generate(input_ids=prompts, attention_mask=torch.ones_like(prompts),
                                  max_new_tokens=args.gen_new, do_sample=False, eos_token_id=None,
                                  pad_token_id=tf.PAD)
        if tuple(out.shape) != (args.gen_batch, L0 + args.gen_new):
            raise RuntimeError(f"generate returned {tuple(out.shape)}, expected {(args.gen_batch, L0 + args.gen_new)}")
        if not torch.equal(out[:, :L0], prompts):
            raise RuntimeError("generate changed the prompt tokens")
        per_call = time.time() - t1
        pool.append((L0, out))
        batches.append(dict(source=src, prompt_tokens=L0, sequences=args.gen_batch, seconds=round(per_call, 2)))
        i += 1
        tf.log(f"pool: batch {i} ({src}, L0 {L0}) in {per_call:.1f}s")
    info = dict(batches=len(pool), sequences=sum(p[1].shape[0] for p in pool), new_tokens_per_sequence=args.gen_new,
                prompt_lens=args.prompt_lens, seconds=round(time.time() - t_start, 1), batch_list=batches,
                sources={s: sum(b["sequences"] for b in batches if b["source"] == s) for s in ("train", "valid")})
    return pool, info


def raw_entries(tf, streams, n_entries, args, device):
    """Teacher-forced windows of raw text ([bos] + L0 + gen_new - 1 stream tokens): anchors
    L0 .. end see the raw tokens as pending / step inputs and learn the target's distribution
    there. Same row count and shapes as the generated batches."""
    g = torch.Generator(device=device).manual_seed(args.seed + 13)
    out, info = [], []
    for i in range(n_entries):
        src = source_of(i, args.pool_valid_fraction)
        L0 = args.prompt_lens[(i + 3) % len(args.prompt_lens)]
        seqs = cut_prompts(streams[src], args.gen_batch, L0 + args.gen_new, tf.BOS, g, device)
        out.append((L0, seqs))
        info.append(dict(source=src, prompt_tokens=L0, sequences=args.gen_batch))
    return out, info


def check_target_files(tf, root, meta, when):
    """The target's files must be byte-identical to the ones the goldens were made from."""
    for rel, sha in meta["model_files_sha256"].items():
        if not rel.startswith(tf.TARGET_DIR + "/"):
            continue
        got = tf.sha256_file(os.path.join(root, rel))
        if got != sha:
            raise RuntimeError(f"{when}: target file {rel} sha256 {got} != meta.json {sha}")


def family_args_from_card(path):
    """The full run's --target-minutes/--drafter-minutes/--seed/--deadline-seconds as the
    current model card's Reproduce section states them."""
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
        m = re.search(r"--target-minutes ([\d.]+) --drafter-minutes ([\d.]+) --seed (\d+) --deadline-seconds (\d+)",
                      text)
        if m:
            return {"target_minutes": float(m.group(1)), "drafter_minutes": float(m.group(2)),
                    "seed": int(m.group(3)), "deadline_seconds": float(m.group(4))}
    except OSError:
        pass
    return dict(FAMILY_ARGS_FALLBACK)


def pack_drafter(args, root, tf):
    """drafter.tgz (assistant folder, goldens, model card) in --pack-dir; small (~5 MB)."""
    if not args.pack_dir:
        return
    os.makedirs(args.pack_dir, exist_ok=True)
    dst = os.path.join(args.pack_dir, "drafter.tgz")
    with tarfile.open(dst + ".tmp", "w:gz") as tar:
        for rel in (tf.DRAFTER_DIR, tf.GOLDEN_DIR, "models/README.md"):
            if os.path.exists(os.path.join(root, rel)):
                tar.add(os.path.join(root, rel), arcname=rel)
    os.replace(dst + ".tmp", dst)
    tf.log(f"packed {os.path.getsize(dst) / 1e6:.1f} MB into {dst}")


def run(tf, args):
    log = tf.log
    run_ = tf.Run(args)
    res = run_.results
    res["args"] = vars(args)
    res["mode"] = "drafter-only"
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise RuntimeError("train_family --drafter-only: needs a CUDA device (or --device cpu)")
    torch.manual_seed(args.seed)
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    torch.set_float32_matmul_precision("highest")
    import transformers
    from safetensors.torch import load_file, save_file
    from tokenizers import Tokenizer
    from transformers import Gemma4AssistantConfig, Gemma4AssistantForCausalLM, Gemma4ForCausalLM

    transformers.logging.set_verbosity_error()
    res["versions"] = tf.versions()
    log("versions:", res["versions"], "drafter-only")
    root = os.path.abspath(args.out)
    tdir, ddir, gdir = (os.path.join(root, d) for d in (tf.TARGET_DIR, tf.DRAFTER_DIR, tf.GOLDEN_DIR))
    meta_path, exp_path = os.path.join(gdir, "meta.json"), os.path.join(gdir, "expected.safetensors")
    card_path = os.path.join(root, "models", "README.md")
    with open(meta_path, encoding="utf-8") as f:
        meta = json.load(f)
    check_target_files(tf, root, meta, "before")
    family_args = family_args_from_card(card_path)
    previous = dict(tau=meta["speculative"]["centroid"]["tau"],
                    acceptance_at=meta["speculative"]["centroid"]["acceptance_at"],
                    acceptance_rate=meta["speculative"]["centroid"]["acceptance_rate"],
                    dense_tau=meta["speculative"].get("dense", {}).get("tau"),
                    pool=meta["drafter"]["pool"], iterations=meta["drafter"]["training"]["iterations"],
                    training_seconds=meta["drafter"]["training"]["seconds"],
                    model_sha256=meta["model_files_sha256"].get(tf.DRAFTER_DIR + "/model.safetensors"))

    # ---- corpus, tokenizer (the committed one), target
    t = time.time()
    manifest, docs = tf.load_corpus(args.corpus)
    tok = Tokenizer.from_file(os.path.join(tdir, "tokenizer.json"))
    ids = {s: tf.encode_docs(tok, docs[s]) for s in ("train", "valid", "heldout")}
    n_tok = {s: sum(len(d) for d in v) for s, v in ids.items()}
    same_tokens = n_tok == meta["tokenizer"]["tokens"]
    if not same_tokens:
        log(f"WARNING token counts {n_tok} != meta.json {meta['tokenizer']['tokens']}")
    streams = {s: torch.tensor([x for d in ids[s] for x in d], dtype=torch.long, device=device)
               for s in ("train", "valid", "heldout")}
    target = tf.load_model(Gemma4ForCausalLM, tdir, torch.float32, device)
    tf.ensure_tied(target, "target")
    run_.phase("load", time.time() - t, tokens=n_tok, tokens_match_meta=same_tokens)

    # ---- drafter: fresh, same config/initialisation, token_ordering of the committed checkpoint
    t = time.time()
    old = load_file(os.path.join(ddir, "model.safetensors"))
    order = old["masked_embedding.token_ordering"].long().cpu()
    del old
    G = tf.DRAFTER_KWARGS["num_centroids"]
    if not torch.equal(torch.sort(order).values, torch.arange(tf.VOCAB)):
        raise RuntimeError("committed masked_embedding.token_ordering is not a permutation of the vocabulary")
    assign = torch.empty(tf.VOCAB, dtype=torch.long)
    assign[order] = torch.arange(G).repeat_interleave(tf.VOCAB // G)
    cluster_of = assign.to(device)
    acfg = Gemma4AssistantConfig(text_config=tf.drafter_text_kwargs(), **tf.DRAFTER_KWARGS)
    torch.manual_seed(args.seed + 1)
    drafter = tf.build_model(Gemma4AssistantForCausalLM, acfg, torch.float32).to(device)
    tf.ensure_tied(drafter, "drafter")
    tf.init_drafter(drafter, target, order, assign)
    if not torch.equal(drafter.masked_embedding.token_ordering.long().cpu(), order):
        raise RuntimeError("token_ordering did not take")
    n_params_d = sum(p.numel() for p in drafter.parameters())
    parity_seq = streams["heldout"][:400]  # inputs of the parity check only, never trained on
    parity_anchors = [1, 5, 127, 128, 129, 130, 257, 390]
    pre_parity = tf.check_drafter_parity(target, tf.randomised_copy(drafter, args.seed), parity_seq, parity_anchors,
                                         3, device)
    log("pre-training parity (randomised norms):", pre_parity)
    if max(pre_parity["max_rel_diff_logits"], pre_parity["max_rel_diff_next_hidden"]) > 1e-3:
        raise RuntimeError(f"draft_forward disagrees with transformers: {pre_parity}")

    # ---- pool: generated continuations + raw-text windows (training and validation splits only)
    pool_budget = max(5.0, min(args.pool_seconds, run_.left() - args.post_drafter_seconds - 60))
    gen_streams = {"train": streams["train"], "valid": streams["valid"]}
    pool, pool_info = generate_mixed_pool(tf, target, gen_streams, pool_budget, args, device)
    n_raw = int(round(len(pool) * args.raw_fraction / max(1e-9, 1 - args.raw_fraction)))
    raw, raw_info = raw_entries(tf, gen_streams, n_raw, args, device)
    pool_info.update(mode="drafter_only", raw_entries=raw_info, raw_sequences=sum(r["sequences"] for r in raw_info),
                     raw_fraction=args.raw_fraction, valid_fraction=args.pool_valid_fraction,
                     sampling="each iteration picks one pool entry (generated batch or raw window set) uniformly, "
                              "then drafter_batch random rows of it")
    pool = pool + raw
    log(f"pool: {pool_info['sequences']} generated + {pool_info['raw_sequences']} raw sequences in {len(pool)} entries")
    train_budget = max(10.0, min(args.drafter_minutes * 60, run_.left() - args.post_drafter_seconds))
    log(f"drafter training budget {train_budget:.0f}s")
    dtraining = tf.train_drafter(drafter, target, pool, cluster_of, train_budget, args, device)
    dtraining["teacher_forcing"] = ("token inputs = the pool sequences: the target's greedy continuation for "
                                    "generated entries, the raw text for raw-window entries")
    del pool, raw
    gen_cfg_path = os.path.join(ddir, "generation_config.json")
    with open(gen_cfg_path, "rb") as f:
        gen_cfg_bytes = f.read()
    drafter16, files_d = tf.save_model(drafter, ddir, "drafter")
    with open(gen_cfg_path, "wb") as f:  # keep the committed one (num_assistant_tokens etc.)
        f.write(gen_cfg_bytes)
    files_d["generation_config.json"] = len(gen_cfg_bytes)
    del drafter
    drafter = tf.load_model(Gemma4AssistantForCausalLM, ddir, torch.float32, device)
    tf.check_reload(drafter16, drafter, "drafter")
    del drafter16
    parity = tf.check_drafter_parity(target, drafter, parity_seq, parity_anchors, 3, device)
    log("parity (trained, reloaded):", parity)
    if max(parity["max_rel_diff_logits"], parity["max_rel_diff_next_hidden"]) > 1e-3:
        raise RuntimeError(f"draft_forward disagrees with transformers: {parity}")
    with open(os.path.join(ddir, "config.json")) as fcfg:
        dcfg_json = json.load(fcfg)
    res["drafter"] = dict(params=n_params_d, pool=pool_info, training=dtraining, parity=parity,
                          parity_pretraining=pre_parity,
                          clusters=dict(meta["drafter"].get("clusters", {}),
                                        reused="token_ordering copied from the previous checkpoint (same target)"),
                          files=sorted(os.listdir(ddir)), file_bytes=files_d, retrained_with="--drafter-only")
    run_.phase("drafter", time.time() - t, iterations=dtraining["iterations"], parity=parity["within_1e5"])
    pack_drafter(args, root, tf)

    # ---- speculative decoding evaluation, exactly as the full run
    t = time.time()
    prompts, sources = tf.eval_prompts(ids["heldout"], args.eval_prompts, args.eval_prompt_tokens)
    prompt_sources = [[docs["heldout_paths"][fi], off] for fi, off in sources]
    same_prompts = prompt_sources == meta["speculative"].get("prompt_sources")
    if not same_prompts:
        log("WARNING evaluation prompts differ from meta.json's")
    greedy = tf.greedy_decode(target, prompts, args.eval_new, device)
    spec = {}
    for head in ("centroid", "dense"):
        if head == "dense" and run_.left() < 20:
            break
        gen, rounds = tf.spec_decode(target, drafter, prompts, args.eval_new, tf.K_DRAFT, device, head=head)
        st = tf.spec_stats(rounds, tf.K_DRAFT)
        st.update(prompts=len(prompts), prompt_tokens=args.eval_prompt_tokens, max_new=args.eval_new, head=head,
                  rows_equal_greedy=sum(int(g_ == r) for g_, r in zip(gen, greedy)))
        spec[head] = st
        log(f"speculative ({head} head): tau {st['tau']:.3f} acceptance {st['acceptance_rate']:.3f} "
            f"per position {[round(x, 3) for x in st['acceptance_at']]} equal-greedy {st['rows_equal_greedy']}"
            f"/{len(prompts)} (previous tau {previous['tau']:.3f})")
    spec["prompt_sources"] = prompt_sources
    res["speculative"] = spec
    run_.phase("speculative_eval", time.time() - t, tau=round(spec["centroid"]["tau"], 3),
               prompts_match_meta=same_prompts)

    # ---- goldens: only the drafter-dependent tensors change
    t = time.time()
    exp = load_file(exp_path)
    orig = {k: v.clone() for k, v in exp.items()}
    held = ids["heldout"]
    used = set()
    prompts_match = True
    gold_prompts = meta["golden"]["prompts"]
    for i, L in enumerate(tf.GOLDEN_PROMPT_LENS):
        fi = next(f for f, d in enumerate(held) if f not in used and len(d) >= L + 1)
        used.add(fi)
        prompt = exp[f"input_ids.{i}"].tolist()
        prompts_match &= prompt == held[fi][:L]
        ref = exp[f"generate_ids.{i}"].tolist()[len(prompt):]
        gen, rounds = tf.spec_decode(target, drafter, [prompt], tf.GOLDEN_NEW, tf.K_DRAFT, device)
        exp[f"spec_accepted.{i}"] = torch.tensor([n for _, n in rounds[0]], dtype=torch.int32)
        exp[f"spec_drafted.{i}"] = torch.tensor([k for k, _ in rounds[0]], dtype=torch.int32)
        entry = next(p for p in gold_prompts if p["index"] == i)
        entry.update(rounds=len(rounds[0]), accepted=sum(n for _, n in rounds[0]), spec_equals_greedy=gen[0] == ref)
        if gen[0] != ref:
            diff = next((j for j, (a, b) in enumerate(zip(gen[0], ref)) if a != b), min(len(gen[0]), len(ref)))
            entry["spec_first_difference"] = dict(new_token_index=diff, spec=gen[0][diff:diff + 1], golden=ref[diff:diff + 1])
            log(f"WARNING golden prompt {i}: speculative tokens differ from generate_ids at new token {diff}")
        log(f"golden {i}: accepted {exp[f'spec_accepted.{i}'].tolist()}")
    if not prompts_match:
        log("WARNING golden prompts re-derived from heldout.txt differ from input_ids.<i>")
    save_file({k: v.contiguous() for k, v in exp.items()}, exp_path,
              metadata={"format": "pt", "producer": "tools/train/train_family.py"})
    back = load_file(exp_path)
    if set(back) != set(orig):
        raise RuntimeError(f"expected.safetensors keys changed: {sorted(set(back) ^ set(orig))}")
    for k, v in orig.items():
        if not k.startswith("spec_") and not (back[k].dtype == v.dtype and torch.equal(back[k], v)):
            raise RuntimeError(f"expected.safetensors: target-only tensor {k} changed")
    meta["golden"]["tensors"] = {k: [str(v.dtype).replace("torch.", ""), list(v.shape)] for k, v in back.items()}
    run_.phase("goldens", time.time() - t, prompts_match=prompts_match,
               spec_equals_greedy=[p["spec_equals_greedy"] for p in gold_prompts])

    # ---- meta.json + model card
    check_target_files(tf, root, meta, "after")
    tdirs = (tdir, ddir)
    meta["drafter"] = {k: v for k, v in res["drafter"].items()}
    meta["configs"]["drafter"] = dcfg_json
    meta["speculative"] = spec
    meta["phases"]["drafter"] = dict(res["phases"]["drafter"], mode="drafter-only retrain")
    meta["phases"]["speculative_eval"] = res["phases"]["speculative_eval"]
    meta["phases"]["drafter_only_run"] = res["phases"]
    meta["drafter_retrain"] = dict(date_utc=res["started_utc"], versions=res["versions"], args=res["args"],
                                   previous_drafter=previous,
                                   note="target, tokenizer and every target-only golden tensor unchanged")
    meta["model_files_sha256"] = {os.path.relpath(os.path.join(dp, fn), root): tf.sha256_file(os.path.join(dp, fn))
                                  for d in tdirs for dp, _, fns in os.walk(d) for fn in sorted(fns)}
    with open(meta_path, "w", encoding="utf-8") as fo:
        json.dump(meta, fo, indent=1, default=str, ensure_ascii=False)
    try:
        card = dict(target=meta["target"], drafter=meta["drafter"], tokenizer=meta["tokenizer"], corpus=meta["corpus"],
                    versions=meta["versions"], budgets=meta["budgets"], speculative=spec, args=family_args,
                    drafter_only_args=res["args"], drafter_previous=previous,
                    family_bytes=sum(os.path.getsize(os.path.join(dp, fn)) for d in tdirs
                                     for dp, _, fns in os.walk(d) for fn in fns))
        text = tf.model_card(card)
        with open(card_path, "w", encoding="utf-8") as fo:
            fo.write(text)
    except Exception:  # noqa: BLE001 - the card can be regenerated from meta.json afterwards
        traceback.print_exc()
        log("WARNING model card not written")
    res["total_seconds"] = round(time.time() - tf.T0, 1)
    run_.save_status()
    pack_drafter(args, root, tf)
    log(f"done in {res['total_seconds']}s: tau {spec['centroid']['tau']:.3f} (previous {previous['tau']:.3f}), "
        f"max GPU memory {torch.cuda.max_memory_allocated() / 2**30 if device.type == 'cuda' else 0:.1f} GiB")
