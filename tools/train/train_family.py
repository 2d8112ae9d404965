#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
"""Trains specula's embedded default Gemma 4 family on the GPU machine, in one command.

Produces, under --out (the repository root):
  models/gemma4-tiny-py/            Gemma4ForCausalLM (gemma4_text), ~10.7M params, bf16, sharded
  models/gemma4-tiny-py-assistant/  Gemma4AssistantForCausalLM (gemma4_assistant), centroid head
  models/README.md                  model card (numbers filled in by this run)
  tests/golden/embedded/            expected.safetensors + meta.json (C++ parity fixtures)
and, under --pack-dir ($OUT), log-friendly status.json and family.tgz.partNN (<= 15 MB each;
`cat family.tgz.part* | tar xzf -` in the repository root restores the files above).

Phases: (a) Gemma-style BPE tokenizer (vocab 8192, byte fallback) trained on train.txt;
(b) target LM, bf16 autocast + fused AdamW, cosine LR by wall time, dropout through forward
hooks (training only), early stopping on valid.txt; (c) assistant drafter distilled from the
frozen target on the target's own greedy continuations with the ENGINE's draft-step semantics
(see draft_forward), KL + centroid loss, token_ordering from a balanced k-means of the target's
embeddings; the vectorised forward is asserted equal to transformers' drafter forward;
(d) greedy speculative decoding simulation (K=4, centroid head) on held-out prompts;
(e) golden tensors in fp32 from the saved bf16 weights; (f) model card.

Engine draft-step contract (specula C++ engine, spec/decoder.cpp + draft/assistant): at anchor
p (pending token x_p, not yet in the target cache) the drafter sees the target's donor K/V of
positions [0, p) (full donor: all; sliding donor: the newest sliding_window + 1), query
position p for every step of the round; step 0 input [E_target(x_p) * sqrt(H_t) ; h_{p-1}]
(h = target post-final-norm hidden), step j >= 1 input [E_target(d_j) ; post_projection(h_a)].

    python3 tools/train/train_family.py --corpus .carry/corpus --out . --pack-dir $OUT
    python3 tools/train/train_family.py --smoke ...   # tiny quick run of every code path

Needs torch (2.11 used), transformers 5.17 (gemma4, gemma4_assistant), tokenizers, safetensors.
"""

# The phases live in the family_*.py modules next to this script (common, data, models,
# drafter, decode, outputs); this file holds the command line and the run (main).

import argparse
import json
import os
import shutil
import sys
import time
import traceback

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # the modules next to this script

# family_common first: it starts the run's clock (T0) before torch loads.
from family_common import (CTX, DRAFTER_DIR, DRAFTER_KWARGS, DSPARK_DIR, GOLDEN_DIR, GOLDEN_NEW,  # noqa: E402
                           K_DRAFT, T0, TARGET_DIR, VOCAB, Run, drafter_text_kwargs, log, pack,
                           sha256_file, target_text_kwargs, versions)

import torch  # noqa: E402

from family_data import (encode_docs, load_corpus, train_tokenizer, windows_of,  # noqa: E402
                         write_tokenizer_files)
from family_models import (build_model, check_reload, ensure_tied, eval_ce, load_model,  # noqa: E402
                           save_model, train_target)
from family_drafter import (balanced_kmeans, check_drafter_parity, generate_pool,  # noqa: E402
                            init_drafter, randomised_copy, train_drafter)
from family_decode import eval_prompts, greedy_decode, loop_check, spec_decode, spec_stats  # noqa: E402
from family_unlikelihood import train_unlikelihood  # noqa: E402
from family_outputs import (hf_tokenizer_check, model_card, tokenizer_round_trips,  # noqa: E402
                            write_goldens)
# Also reached by drafter_only.py through this module (tf.<name>).
from family_common import BOS, EOS, GOLDEN_PROMPT_LENS, PAD  # noqa: E402,F401


# ----------------------------------------------------------------------------- main


def parse_args():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--corpus", default=".carry/corpus")
    ap.add_argument("--out", default=".", help="repository root to write models/ and tests/golden/embedded/ into")
    ap.add_argument("--pack-dir", default=os.environ.get("OUT"), help="where status.json and the tar parts go")
    ap.add_argument("--target-minutes", type=float, default=4.5)
    ap.add_argument("--drafter-minutes", type=float, default=3.0)
    ap.add_argument("--seed", type=int, default=1234)
    ap.add_argument("--smoke", action="store_true", help="tiny quick run of every code path")
    ap.add_argument("--deadline-seconds", type=float, default=570, help="whole-run budget from script start")
    ap.add_argument("--post-target-seconds", type=float, default=20, help="reserved for save/eval after the target")
    ap.add_argument("--post-drafter-seconds", type=float, default=45, help="reserved for everything after training")
    ap.add_argument("--tokenizer-max-chars", type=float, default=3e6)
    ap.add_argument("--lr", type=float, default=2e-3)
    ap.add_argument("--warmup", type=int, default=100)
    ap.add_argument("--weight-decay", type=float, default=0.1)
    ap.add_argument("--dropout", type=float, default=0.1)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--val-every", type=float, default=15.0)
    ap.add_argument("--drafter-lr", type=float, default=3e-3)
    ap.add_argument("--drafter-warmup", type=int, default=50)
    ap.add_argument("--drafter-batch", type=int, default=32)
    ap.add_argument("--drafter-log-every", type=float, default=15.0)
    ap.add_argument("--step-decay", type=float, default=0.8)
    ap.add_argument("--centroid-weight", type=float, default=0.5)
    ap.add_argument("--pool-fraction", type=float, default=0.3, help="share of the drafter time spent generating")
    ap.add_argument("--pool-max-batches", type=int, default=64)
    ap.add_argument("--gen-batch", type=int, default=512)
    ap.add_argument("--gen-new", type=int, default=160)
    ap.add_argument("--prompt-lens", type=str, default="32,64,128,256")
    ap.add_argument("--eval-prompts", type=int, default=64)
    ap.add_argument("--eval-prompt-tokens", type=int, default=64)
    ap.add_argument("--eval-new", type=int, default=64)
    ap.add_argument("--loop-prompts", type=int, default=64, help="held-out prompts of the loop check")
    ap.add_argument("--loop-new", type=int, default=96, help="greedy tokens per prompt of the loop check")
    ap.add_argument("--unlikelihood-minutes", type=float, default=0.0,
                    help="after the target's MLE training, fine-tune it this long against its own greedy loops "
                         "(sequence-level unlikelihood on repeated lines: tools/train/family_unlikelihood.py)")
    ap.add_argument("--ul-lr", type=float, default=3e-4, help="unlikelihood fine-tune: constant LR (20-step warmup)")
    ap.add_argument("--ul-weight", type=float, default=1.0, help="unlikelihood fine-tune: weight of the UL term")
    ap.add_argument("--ul-batch", type=int, default=64, help="unlikelihood fine-tune: continuations per step")
    ap.add_argument("--init-target", default="",
                    help="continue training this target folder (its weights and its tokenizer.json; the "
                         "tokenizer is not retrained) instead of starting from random weights")
    ap.add_argument("--baseline", default="",
                    help="a previous target folder (with its tokenizer.json) to evaluate on the same held-out "
                         "text first, before models/ is overwritten (e.g. models/gemma4-tiny-py)")
    ap.add_argument("--drafter-only", action="store_true",
                    help="retrain only the drafter against the committed target (tools/train/drafter_only.py)")
    ap.add_argument("--pool-seconds", type=float, default=40.0, help="--drafter-only: generation budget")
    ap.add_argument("--pool-valid-fraction", type=float, default=0.5,
                    help="--drafter-only: share of pool batches prompted from valid.txt (the rest: train.txt)")
    ap.add_argument("--raw-fraction", type=float, default=0.2,
                    help="--drafter-only: share of pool entries that are raw-text windows (teacher-forced)")
    ap.add_argument("--device", default="cuda", help="--drafter-only: torch device")
    a = ap.parse_args()
    if a.smoke:
        a.target_minutes = min(a.target_minutes, 10 / 60)
        a.unlikelihood_minutes = min(a.unlikelihood_minutes, 8 / 60)
        a.ul_batch = min(a.ul_batch, 8)
        a.drafter_minutes = min(a.drafter_minutes, 16 / 60)
        a.tokenizer_max_chars = min(a.tokenizer_max_chars, 1e6)
        a.val_every = 4.0
        a.warmup = 10
        a.drafter_warmup = 5
        a.drafter_log_every = 5.0
        a.gen_batch = 128
        a.gen_new = 64
        a.eval_prompts = 8
    a.prompt_lens = [int(x) for x in a.prompt_lens.split(",")]
    return a


def reuse_tokenizer(path):
    """--init-target: the folder's tokenizer (ids must not move under trained weights) and the
    statistics its run recorded (tests/golden/embedded/meta.json when it is there)."""
    from tokenizers import Tokenizer

    with open(os.path.join(path, "tokenizer.json"), encoding="utf-8") as f:
        tok_obj = json.load(f)
    tok = Tokenizer.from_str(json.dumps(tok_obj, ensure_ascii=False))
    info = {}
    meta = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", GOLDEN_DIR, "meta.json")
    if os.path.exists(meta):
        with open(meta, encoding="utf-8") as f:
            info = dict(json.load(f).get("tokenizer", {}))
    info.update(merges=len(tok_obj["model"]["merges"]), reused_from=path)
    info.setdefault("unused_padding", sum(1 for t in tok_obj["model"]["vocab"] if t.startswith("<unused")))
    info.setdefault("training_chars", 0)
    return tok, tok_obj, info


def evaluate_baseline(path, held_docs, held_chars, loop_prompts, tok, args, device, model_cls):
    """The previous target (its own tokenizer) on the same held-out text: cross-entropy per token and
    per character, and the loop check on the same prompt texts (re-encoded with its tokenizer)."""
    from tokenizers import Tokenizer

    old_tok = Tokenizer.from_file(os.path.join(path, "tokenizer.json"))
    ids = encode_docs(old_tok, held_docs)
    stream = torch.tensor([x for d in ids for x in d], dtype=torch.long, device=device)
    model = load_model(model_cls, path, torch.float32, device)
    ce = eval_ce(model, windows_of(stream, CTX), 32, False)
    texts = [tok.decode(p[1:], skip_special_tokens=False) for p in loop_prompts]
    old_prompts = [[BOS] + e.ids for e in old_tok.encode_batch(texts, add_special_tokens=False)]
    loops = loop_check(model, old_tok, old_prompts, args.loop_new, device, EOS)
    del model
    out = dict(path=path, heldout_ce=ce, heldout_ce_per_char=ce * stream.numel() / held_chars,
               heldout_tokens=int(stream.numel()), without_triple_line=loops["without_triple_line"],
               loops=loops)
    log(f"baseline {path}: held-out CE {ce:.4f} nats/token, {out['heldout_ce_per_char']:.4f} nats/char; "
        f"loops {loops['without_triple_line']}/{loops['prompts']} clean")
    return out


def main():
    args = parse_args()
    if args.drafter_only:
        import drafter_only  # tools/train/drafter_only.py, next to this script

        return drafter_only.run(sys.modules[__name__], args)
    run = Run(args)
    res = run.results
    res["args"] = vars(args)
    if not torch.cuda.is_available():
        sys.exit("train_family: needs a CUDA device")
    device = torch.device("cuda")
    torch.manual_seed(args.seed)
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    torch.set_float32_matmul_precision("highest")
    import transformers
    from transformers import (Gemma4AssistantConfig, Gemma4AssistantForCausalLM, Gemma4ForCausalLM,
                              Gemma4TextConfig)

    transformers.logging.set_verbosity_error()
    res["versions"] = versions()
    log("versions:", res["versions"], "smoke" if args.smoke else "full")
    root = os.path.abspath(args.out)
    tdir, ddir = os.path.join(root, TARGET_DIR), os.path.join(root, DRAFTER_DIR)

    # ---- corpus + tokenizer
    t = time.time()
    manifest, docs = load_corpus(args.corpus)
    res["corpus"] = dict(packages=manifest["packages"], counts=manifest["counts"], chars=manifest["chars"],
                         split_rule=manifest["split_rule"], selection=manifest["selection"])
    if args.init_target:
        tok, tok_obj, tok_info = reuse_tokenizer(args.init_target)
    else:
        tok, tok_obj, tok_info = train_tokenizer(docs["train"], args.tokenizer_max_chars)
    ids = {s: encode_docs(tok, docs[s]) for s in ("train", "valid", "heldout")}
    n_tok = {s: sum(len(d) for d in v) for s, v in ids.items()}
    tok_info["chars_per_token"] = sum(len(d) for d in docs["heldout"]) / max(1, n_tok["heldout"] - 2 * len(ids["heldout"]))
    tok_info["tokens"] = n_tok
    tok_info["round_trips"] = tokenizer_round_trips(tok)
    res["tokenizer"] = tok_info
    run.phase("tokenizer", time.time() - t, tokens=n_tok, chars_per_token=round(tok_info["chars_per_token"], 3),
              merges=tok_info["merges"], unused=tok_info["unused_padding"])
    streams = {s: torch.tensor([x for d in v for x in d], dtype=torch.long, device=device) for s, v in ids.items()}
    val_windows = windows_of(streams["valid"], CTX)[:64]
    held_windows = windows_of(streams["heldout"], CTX)
    held_chars = sum(len(d) for d in docs["heldout"])
    loop_prompts, _ = eval_prompts(ids["heldout"], args.loop_prompts, args.eval_prompt_tokens)
    if args.baseline:
        t = time.time()
        res["baseline"] = evaluate_baseline(args.baseline, docs["heldout"], held_chars, loop_prompts, tok, args,
                                            device, Gemma4ForCausalLM)
        run.phase("baseline", time.time() - t, **{k: v for k, v in res["baseline"].items() if k != "loops"})

    # ---- budgets: shrink both trainings proportionally if the deadline cannot hold them
    want_t, want_u, want_d = args.target_minutes * 60, args.unlikelihood_minutes * 60, args.drafter_minutes * 60
    avail = run.left() - args.post_target_seconds - args.post_drafter_seconds
    if want_t + want_u + want_d > avail:
        scale = max(avail, 30) / (want_t + want_u + want_d)
        want_t, want_u, want_d = want_t * scale, want_u * scale, want_d * scale
        log(f"budget: scaled trainings by {scale:.2f} to fit the deadline")
    res["budgets"] = dict(target_seconds=round(want_t, 1), unlikelihood_seconds=round(want_u, 1),
                          drafter_seconds_planned=round(want_d, 1))

    # ---- target
    t = time.time()
    torch.manual_seed(args.seed)
    tcfg = Gemma4TextConfig(**target_text_kwargs())
    if args.init_target:  # continued training: the saved bf16 weights, widened to f32
        target = load_model(Gemma4ForCausalLM, args.init_target, torch.float32, device).requires_grad_(True)
        if target.config.to_dict().get("hidden_size") != tcfg.hidden_size:
            raise RuntimeError(f"--init-target {args.init_target}: not this script's target shape")
    else:
        target = build_model(Gemma4ForCausalLM, tcfg, torch.float32).to(device)
    ensure_tied(target, "target")
    n_params_t = sum(p.numel() for p in target.parameters())
    log(f"target params {n_params_t:,}")
    training = train_target(target, streams["train"], val_windows, want_t, args, device)
    if want_u > 0:
        training["mle_valid_ce"] = eval_ce(target, val_windows, 32, True)
        try:
            training["unlikelihood"] = train_unlikelihood(target, streams["train"], tok, want_u, args, device, EOS)
        except Exception:  # keep the MLE target (and the run's other outputs) rather than lose the call
            training["unlikelihood_error"] = traceback.format_exc()
            log("unlikelihood fine-tune FAILED, continuing with the MLE target:\n" + training["unlikelihood_error"])
            target.eval().requires_grad_(True)
    target16, files_t = save_model(target, tdir, "target")
    write_tokenizer_files(tdir, tok_obj)
    del target
    target = load_model(Gemma4ForCausalLM, tdir, torch.float32, device)
    check_reload(target16, target, "target")
    del target16
    held_ce = eval_ce(target, held_windows, 32, False)
    valid_ce = eval_ce(target, windows_of(streams["valid"], CTX), 32, False)
    # nats per character: comparable across tokenizers (the baseline has its own).
    held_ce_per_char = held_ce * streams["heldout"].numel() / held_chars
    loops = loop_check(target, tok, loop_prompts, args.loop_new, device, EOS)
    log(f"loop check: {loops['without_triple_line']}/{loops['prompts']} continuations without a line repeated "
        f"three times in a row; {loops['without_token_loop']} without a token-level loop; "
        f"{loops['without_either']} without either")
    with open(os.path.join(tdir, "config.json")) as fcfg:
        tcfg_json = json.load(fcfg)
    res["target"] = dict(params=n_params_t, training=training, heldout_ce=held_ce, valid_ce=valid_ce,
                         heldout_ce_per_char=held_ce_per_char, loops=loops,
                         heldout_tokens=int(held_windows[:, 1:].numel()), files=sorted(os.listdir(tdir)),
                         file_bytes=files_t, config=tcfg_json, hf_tokenizer=hf_tokenizer_check(tdir, tok))
    run.phase("target", time.time() - t, heldout_ce=round(held_ce, 4), valid_ce=round(valid_ce, 4),
              steps=training["steps"])
    pack(run, root)

    # ---- clustering + drafter
    t = time.time()
    assign, cohesion = balanced_kmeans(target.model.embed_tokens.weight, DRAFTER_KWARGS["num_centroids"], 30,
                                       args.seed)
    order = torch.cat([torch.nonzero(assign == g).squeeze(1) for g in range(DRAFTER_KWARGS["num_centroids"])])
    assert torch.equal(torch.sort(order).values, torch.arange(VOCAB)), "token_ordering is not a permutation"
    cluster_of = assign.to(device)
    acfg = Gemma4AssistantConfig(text_config=drafter_text_kwargs(), **DRAFTER_KWARGS)
    torch.manual_seed(args.seed + 1)
    drafter = build_model(Gemma4AssistantForCausalLM, acfg, torch.float32).to(device)
    ensure_tied(drafter, "drafter")
    init_drafter(drafter, target, order, assign)
    n_params_d = sum(p.numel() for p in drafter.parameters())
    log(f"drafter params {n_params_d:,}; clusters cohesion {cohesion:.3f}")
    parity_seq = streams["heldout"][:400]
    pre_parity = check_drafter_parity(target, randomised_copy(drafter, args.seed), parity_seq,
                                      [1, 5, 127, 128, 129, 130, 257, 390], 3, device)
    log("pre-training parity (randomised norms):", pre_parity)
    if max(pre_parity["max_rel_diff_logits"], pre_parity["max_rel_diff_next_hidden"]) > 1e-3:
        raise RuntimeError(f"draft_forward disagrees with transformers: {pre_parity}")
    drafter_left = min(want_d, run.left() - args.post_drafter_seconds)
    pool, pool_info = generate_pool(target, streams["train"], drafter_left * args.pool_fraction, args, device)
    drafter_train_budget = max(10.0, min(want_d - (time.time() - t), run.left() - args.post_drafter_seconds))
    dtraining = train_drafter(drafter, target, pool, cluster_of, drafter_train_budget, args, device)
    del pool
    drafter16, files_d = save_model(drafter, ddir, "drafter")
    write_tokenizer_files(ddir, tok_obj, {"num_assistant_tokens": K_DRAFT,
                                          "num_assistant_tokens_schedule": "constant"})
    del drafter
    drafter = load_model(Gemma4AssistantForCausalLM, ddir, torch.float32, device)
    check_reload(drafter16, drafter, "drafter")
    del drafter16
    parity = check_drafter_parity(target, drafter, parity_seq, [1, 5, 127, 128, 129, 130, 257, 390], 3, device)
    log("parity (trained, reloaded):", parity)
    if max(parity["max_rel_diff_logits"], parity["max_rel_diff_next_hidden"]) > 1e-3:
        raise RuntimeError(f"draft_forward disagrees with transformers: {parity}")
    with open(os.path.join(ddir, "config.json")) as fcfg:
        dcfg_json = json.load(fcfg)
    res["drafter"] = dict(params=n_params_d, pool=pool_info, training=dtraining, parity=parity,
                          parity_pretraining=pre_parity, clusters=dict(method="spherical k-means (30 iters max) on "
                          "the target's normalised embedding rows, balanced greedy assignment (64 x 128)",
                          cohesion=cohesion), files=sorted(os.listdir(ddir)), file_bytes=files_d, config=dcfg_json)
    run.phase("drafter", time.time() - t, iterations=dtraining["iterations"], parity=parity["within_1e5"])
    pack(run, root)

    # ---- speculative decoding evaluation
    t = time.time()
    prompts, sources = eval_prompts(ids["heldout"], args.eval_prompts, args.eval_prompt_tokens)
    greedy = greedy_decode(target, prompts, args.eval_new, device)
    res["speculative"] = {}
    for head in ("centroid", "dense"):
        if head == "dense" and run.left() < 25:
            break
        gen, rounds = spec_decode(target, drafter, prompts, args.eval_new, K_DRAFT, device, head=head)
        st = spec_stats(rounds, K_DRAFT)
        st.update(prompts=len(prompts), prompt_tokens=args.eval_prompt_tokens, max_new=args.eval_new, head=head,
                  rows_equal_greedy=sum(int(g == r) for g, r in zip(gen, greedy)))
        res["speculative"][head] = st
        log(f"speculative ({head} head): tau {st['tau']:.3f} acceptance {st['acceptance_rate']:.3f} "
            f"per position {[round(x, 3) for x in st['acceptance_at']]} equal-greedy {st['rows_equal_greedy']}"
            f"/{len(prompts)}")
    res["speculative"]["prompt_sources"] = [(docs["heldout_paths"][fi], off) for fi, off in sources]
    run.phase("speculative_eval", time.time() - t, tau=round(res["speculative"]["centroid"]["tau"], 3))

    # ---- goldens, card, meta
    t = time.time()
    gold = write_goldens(run, target, drafter, tok, ids["heldout"], docs["heldout_paths"], root, device)
    res["family_bytes"] = sum(os.path.getsize(os.path.join(dp, fn)) for d in (tdir, ddir)
                              for dp, _, fns in os.walk(d) for fn in fns)
    stale = os.path.join(root, DSPARK_DIR)
    if os.path.isdir(stale):
        # Trained on the previous target's hidden states: with the same config.json it would still
        # load and stay lossless, but draft poorly. tools/train/embedded_dspark_cpu.sh retrains it.
        shutil.rmtree(stale)
        log(f"removed {DSPARK_DIR}: trained against the previous target; retrain it "
            "(tools/train/embedded_dspark_cpu.sh --install)")
    with open(os.path.join(root, "models", "README.md"), "w", encoding="utf-8") as fo:
        fo.write(model_card(res))
    meta = {
        "producer": "tools/train/train_family.py",
        "versions": res["versions"],
        "date_utc": res["started_utc"],
        "seed": args.seed,
        "smoke": args.smoke,
        "compute": "fp32 (TF32 off) from the bf16 checkpoints in models/, SDPA attention, CUDA",
        "conventions": {
            "input_ids.<i>": "prompt i (I32), starts with <bos> (id 2), from held-out file prompts[i].source",
            "logits.0": "target logits for prompt 0, F32 [S0, 8192], after the soft-cap 30",
            "generate_ids.<i>": f"prompt i + {GOLDEN_NEW} greedy tokens (I32), full no-cache forward per token",
            "spec_accepted.<i>": "accepted drafts per verify round (I32), greedy speculative decoding with K=4 "
                                 "and the engine's loop: the prefill emits the first token (no round), each round "
                                 "drafts k = min(4, remaining - 1) (spec_drafted.<i>), rounds with k = 0 included",
            "drafter": "centroid head (top-8 of 64 centroids), draft position = pending token position p, donors "
                       "[0, p) (sliding donor: newest 129), step 0 hidden = target post-norm hidden at p - 1",
        },
        "golden": gold,
        "configs": {"target": res["target"]["config"], "drafter": res["drafter"]["config"]},
        "target": {k: v for k, v in res["target"].items() if k != "config"},
        "drafter": {k: v for k, v in res["drafter"].items() if k != "config"},
        "speculative": res["speculative"],
        "tokenizer": res["tokenizer"],
        "corpus": res["corpus"],
        "budgets": res["budgets"],
        "phases": res["phases"],
        "model_files_sha256": {os.path.relpath(os.path.join(dp, fn), root): sha256_file(os.path.join(dp, fn))
                               for d in (tdir, ddir) for dp, _, fns in os.walk(d) for fn in sorted(fns)},
    }
    with open(os.path.join(root, GOLDEN_DIR, "meta.json"), "w", encoding="utf-8") as fo:
        json.dump(meta, fo, indent=1, default=str, ensure_ascii=False)
    run.phase("goldens", time.time() - t, prompts=[p["tokens"] for p in gold["prompts"]])
    res["total_seconds"] = round(time.time() - T0, 1)
    run.save_status()
    pack(run, root)
    log(f"done in {res['total_seconds']}s: heldout CE {held_ce:.4f}, tau {res['speculative']['centroid']['tau']:.3f}, "
        f"max GPU memory {torch.cuda.max_memory_allocated() / 2**30:.1f} GiB")


if __name__ == "__main__":
    try:
        main()
    except Exception:
        traceback.print_exc()
        sys.exit(1)
