#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
"""DSpark golden fixtures for the specula C++ engine (contract: docs/dspark.md, "Golden fixtures").

Over the dense_kev target fixture (tests/golden/dense_kev) this writes
  <out>/dspark/           specula layout (seed v2): dspark.json + model.safetensors, computed by the
                          reference below, a direct transcription of docs/dspark.md;
  <out>/dspark_deepspec/  DeepSpec layout: config.json + model.safetensors (save_pretrained),
                          computed with DeepSpec's own modeling and eval code (--deepspec DIR);
each with expected.safetensors and meta.json (format: tests/golden/README.md).

The context taps come from ONE transformers forward of dense_kev's golden greedy sequence. For
every round r (context t_r, anchor sequence[t_r]) the drafter's base logits, Markov-corrected
logits along the greedy chain, confidences and draft tokens are recorded. Checks (any failure
exits non-zero): prefix forward == full forward (causality), incremental context-KV cache ==
whole context from scratch (both layouts; for DeepSpec through its DynamicCache path), DeepSpec's
outputs == an independent transcription of docs/dspark.md's DeepSpec math, checkpoints survive a
save/reload, top-2 margins along the greedy chains >= MIN_MARGIN (seeds are retried otherwise).

Run (GPU machine, transformers 5.17; everything on CPU in fp32, one thread):
    python3 tools/golden/make_dspark_golden.py --out /tmp/g --deepspec .gpu/deepspec
"""

import argparse
import copy
import dataclasses
import datetime
import hashlib
import importlib
import inspect
import json
import os
import platform
import subprocess
import sys
import traceback
import types

import torch
import torch.nn.functional as F

import transformers

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
CONTEXTS = [12, 13, 17, 25, 40]  # t_r: increasing; 12 -> 13 appends a single row
PREFIX_CHECK_T = 17  # the context length whose prefix forward is compared with the full forward
TOL = 1e-5  # the C++ tests' tolerance; our own cross-checks must be at least this tight
DOCS_TOL = 1e-4  # DeepSpec vs the docs transcription (different op order, softmax vs SDPA)
MIN_MARGIN = 1e-3  # smallest top1-top2 gap of the chained logits; else the next seed is tried
MIN_DISTINCT = 4  # distinct draft tokens over all rounds (a constant drafter tests little)
MAX_SEED_ATTEMPTS = 20

# specula layout (seed v2): tap_layers in the engine convention (hidden_states index; 4 = post-norm).
SPECULA = dict(block_size=5, hidden_size=32, num_layers=2, num_heads=4, ffn_mult=2, markov_rank=16,
               tap_layers=[1, 2, 4])
SPECULA_SEED = 7100
# DeepSpec layout: build_draft_config's model_args (as in config/dspark/dspark_gemma4_12b.py).
# target_layer_ids [0, 2] are engine taps [1, 3]; confidence_head_alpha > 0 enables the head.
DEEPSPEC_ARGS = dict(block_size=7, num_draft_layers=2, target_layer_ids=[0, 2], mask_token_id=4, num_anchors=1,
                     markov_rank=16, markov_head_type="vanilla", confidence_head_alpha=1.0,
                     confidence_head_with_markov=True)
DEEPSPEC_SEED = 7200
# dense_kev's full-attention geometry (per_layer_config in its config.json); the draft needs it flat.
GLOBAL_HEAD_DIM, NUM_GLOBAL_KV_HEADS = 32, 1
# Keys the C++ loader reads from the DeepSpec config.json (docs/dspark.md, DeepSpec layout).
DEEPSPEC_JSON_KEYS = ("architectures", "hidden_size", "vocab_size", "intermediate_size", "num_hidden_layers",
                      "num_attention_heads", "num_key_value_heads", "global_head_dim", "num_global_key_value_heads",
                      "attention_k_eq_v", "rms_norm_eps", "rope_parameters", "final_logit_softcapping",
                      "hidden_activation", "enable_moe_block", "hidden_size_per_layer_input", "tie_word_embeddings",
                      "block_size", "mask_token_id", "target_layer_ids", "num_target_layers", "markov_rank",
                      "markov_head_type", "enable_confidence_head", "confidence_head_with_markov")
DEEPSPEC_FILES = ("deepspec/modeling/dspark/gemma4/config.py", "deepspec/modeling/dspark/gemma4/modeling.py",
                  "deepspec/modeling/dspark/common.py", "deepspec/modeling/dspark/markov_head.py",
                  "deepspec/eval/dspark/draft_ops.py", "deepspec/eval/dspark/evaluator.py",
                  "deepspec/utils/sampling.py")


# ----------------------------------------------------------------------------- helpers


def log(*args):
    print(*args, flush=True)


def versions():
    return {"torch": torch.__version__, "transformers": transformers.__version__,
            "python": platform.python_version()}


def rms(x, w, eps):
    """docs rms(x; w) (w None: rms0). Same formula and op order as Gemma4RMSNorm (pow, not rsqrt)."""
    y = x * torch.pow(x.pow(2).mean(-1, keepdim=True) + eps, -0.5)
    return y if w is None else y * w


def softcap(x, cap):
    return x if cap is None else torch.tanh(x / cap) * cap


def margin(logits):
    """Smallest top1-top2 gap over the last axis."""
    top = torch.topk(logits.float(), 2, dim=-1).values
    return float((top[..., 0] - top[..., 1]).min())


def max_diff(a, b):
    d = (a.float() - b.float()).abs().max()
    if torch.isnan(d):
        raise RuntimeError("NaN in a comparison")
    return float(d)


def canonical_config_string(cfg):
    """The target identity hashed into dspark.json target.config_hash (docs/dspark.md): the fields
    a drafter's taps and head depend on, in a fixed order, so the C++ loader (which sees the parsed
    config, not the file) builds the same text. Floats use %g (30.0 -> "30"); a missing softcap is
    "none"."""
    cap = cfg.get("final_logit_softcapping")
    fields = [
        ("hidden_size", cfg["hidden_size"]),
        ("num_hidden_layers", cfg["num_hidden_layers"]),
        ("vocab_size", cfg["vocab_size"]),
        ("intermediate_size", cfg["intermediate_size"]),
        ("num_attention_heads", cfg["num_attention_heads"]),
        ("num_key_value_heads", cfg["num_key_value_heads"]),
        ("head_dim", cfg["head_dim"]),
        ("sliding_window", cfg.get("sliding_window") or 0),
        ("final_logit_softcapping", "none" if cap is None else format(float(cap), "g")),
        ("layer_types", ",".join(cfg["layer_types"])),
    ]
    return "gemma4-target-v1;" + ";".join(f"{k}={v}" for k, v in fields)


def sha256_file(path):
    with open(path, "rb") as f:
        return hashlib.sha256(f.read()).hexdigest()


def load_pretrained(cls, path, **extra):
    """from_pretrained in fp32 with eager attention, across the keyword spellings of 5.x."""
    last = None
    for kw in (dict(attn_implementation="eager", dtype=torch.float32),
               dict(attn_implementation="eager", torch_dtype=torch.float32)):
        try:
            return cls.from_pretrained(path, **kw, **extra).eval()
        except TypeError as e:  # keyword unknown in this version
            last = e
    raise last


def save_expected(out_dir, tensors, producer):
    from safetensors.torch import save_file

    for k, v in tensors.items():
        assert v.dtype in (torch.float32, torch.int32), (k, v.dtype)
    save_file({k: v.detach().contiguous().clone() for k, v in tensors.items()},
              os.path.join(out_dir, "expected.safetensors"), metadata={"format": "pt", "producer": producer})


def write_meta(out_dir, meta):
    with open(os.path.join(out_dir, "meta.json"), "w") as f:
        json.dump(meta, f, indent=1, sort_keys=True, default=str)


def stack_rounds(rounds, seq):
    """Per-round dicts -> expected.safetensors tensors (docs/dspark.md "Golden fixtures")."""
    return {
        "sequence": seq.to(torch.int32),
        "contexts": torch.tensor(CONTEXTS, dtype=torch.int32),
        "base_logits": torch.stack([r["base"] for r in rounds]).float(),
        "block_logits": torch.stack([r["block"] for r in rounds]).float(),
        "confidences": torch.stack([r["conf"] for r in rounds]).float(),
        "draft_tokens": torch.stack([r["tokens"] for r in rounds]).to(torch.int32),
    }


def chain_quality(exp):
    return {"min_top2_margin": margin(exp["block_logits"]),
            "distinct_draft_tokens": int(torch.unique(exp["draft_tokens"]).numel()),
            "confidence_range": [float(exp["confidences"].min()), float(exp["confidences"].max())]}


def compare_rounds(a, b, what):
    """Max abs diff between two stack_rounds results; draft tokens must be identical."""
    if not torch.equal(a["draft_tokens"], b["draft_tokens"]):
        raise RuntimeError(f"{what}: draft tokens differ: {a['draft_tokens'].tolist()} vs {b['draft_tokens'].tolist()}")
    return max(max_diff(a[k], b[k]) for k in ("base_logits", "block_logits", "confidences"))


def greedy_heads(U, h, anchor, w1, w2, cw, cb):
    """docs/dspark.md Heads: e_k = W1[prev_k], logits_k = U_k + e_k W2^T, c_k = sigmoid(w.[h_k; e_k] + b),
    prev_0 = anchor, prev_k = argmax logits_{k-1}. cw None: no confidence features from e (DeepSpec
    without Markov features is not used here)."""
    prev, block, toks, conf = anchor, [], [], []
    for k in range(U.shape[0]):
        e = w1[prev]
        lk = U[k] + e @ w2.T
        tok = int(torch.argmax(lk))
        conf.append(torch.sigmoid(torch.cat([h[k], e]) @ cw[0] + cb[0]))
        block.append(lk)
        toks.append(tok)
        prev = tok
    return {"base": U, "block": torch.stack(block), "conf": torch.stack(conf), "tokens": torch.tensor(toks)}


# ----------------------------------------------------------------------------- target


def load_target(target_dir):
    """dense_kev: its greedy sequence, the hidden states of one forward over it, the tied table."""
    from safetensors.torch import load_file
    from transformers import Gemma4ForCausalLM

    with open(os.path.join(target_dir, "config.json")) as f:
        cfg = json.load(f)
    golden = load_file(os.path.join(target_dir, "expected.safetensors"))
    seq = golden["generate_ids"].long()
    prompt = int(golden["input_ids"].numel())
    model = load_pretrained(Gemma4ForCausalLM, target_dir)
    out = model(input_ids=seq[None], use_cache=False, output_hidden_states=True)
    L = cfg["num_hidden_layers"]
    if len(out.hidden_states) != L + 1:
        raise RuntimeError(f"expected {L + 1} hidden states, got {len(out.hidden_states)}")
    hs = [h[0].float() for h in out.hidden_states]
    # The loaded target must be the one that produced the golden sequence.
    pred = out.logits[0, prompt - 1:-1].argmax(-1)
    if not torch.equal(pred, seq[prompt:]):
        raise RuntimeError("teacher-forced argmax of dense_kev does not reproduce its generate_ids")
    # The target is causal, so the taps of a prefix forward equal the full forward's first rows:
    # the fixture's "context = first t rows of one forward" is what incremental prefill commits.
    pre = model(input_ids=seq[None, :PREFIX_CHECK_T], use_cache=False, output_hidden_states=True)
    prefix_diff = max(max_diff(p[0], h[:PREFIX_CHECK_T]) for p, h in zip(pre.hidden_states, hs))
    if prefix_diff > TOL:
        raise RuntimeError(f"prefix forward differs from the full forward by {prefix_diff}")
    geom = full_attention_geometry(cfg, model)
    E = model.get_input_embeddings().weight.detach().float()  # unscaled: the scale is a separate buffer
    info = dict(target_prompt_len=prompt, target_sequence_len=int(seq.numel()), prefix_check_t=PREFIX_CHECK_T,
                prefix_forward_max_abs_diff=prefix_diff, teacher_forced_match=True, target_full_geometry=geom,
                target_config_sha256_file=sha256_file(os.path.join(target_dir, "config.json")))
    return types.SimpleNamespace(model=model, cfg=cfg, seq=seq, hs=hs, hs_batched=out.hidden_states, E=E,
                                 cap=cfg.get("final_logit_softcapping"), eps=cfg["rms_norm_eps"], info=info)


def full_attention_geometry(cfg, model):
    """dense_kev's full-layer head dim / KV heads, from config.json's per_layer_config (5.17 form) or
    the flat fields, checked against the loaded modules; must be (GLOBAL_HEAD_DIM, NUM_GLOBAL_KV_HEADS)."""
    plc = {int(k): v for k, v in (cfg.get("per_layer_config") or {}).items()}
    full = [i for i, t in enumerate(cfg["layer_types"]) if t == "full_attention"]
    flat_hd = cfg.get("global_head_dim") or cfg["head_dim"]
    flat_kv = cfg.get("num_global_key_value_heads") if cfg.get("attention_k_eq_v") else None
    seen = set()
    for i in full:
        o = plc.get(i, {})
        hd = o.get("head_dim", flat_hd)
        kv = o.get("num_key_value_heads", flat_kv or cfg["num_key_value_heads"])
        k_shape = tuple(model.model.layers[i].self_attn.k_proj.weight.shape)
        if k_shape != (kv * hd, cfg["hidden_size"]):
            raise RuntimeError(f"target layer {i}: k_proj {k_shape}, config says {kv} x {hd}")
        seen.add((hd, kv))
    if seen != {(GLOBAL_HEAD_DIM, NUM_GLOBAL_KV_HEADS)}:
        raise RuntimeError(f"dense_kev full-attention geometry {seen}, expected {(GLOBAL_HEAD_DIM, NUM_GLOBAL_KV_HEADS)}")
    return {"full_layers": full, "head_dim": GLOBAL_HEAD_DIM, "num_kv_heads": NUM_GLOBAL_KV_HEADS}


# ----------------------------------------------------------------------------- specula layout


def specula_params(gen, H, V, E_std):
    """Every tensor of docs/dspark.md's specula layout, random. Linear std 1/sqrt(in) keeps each
    product ~unit; out_proj then gives logits of std ~ E_std * sqrt(H) (~1.7, like the target);
    the Markov bias has std ~1 and the confidence logit ~1, so neither saturates."""
    c = SPECULA
    d, L, r, g, m = c["hidden_size"], c["num_layers"], c["markov_rank"], c["block_size"], len(c["tap_layers"])
    F_ = c["ffn_mult"] * d

    def n(*shape, std):
        return torch.randn(shape, generator=gen) * std

    def u(*shape, lo=0.5, hi=1.5):
        return torch.rand(shape, generator=gen) * (hi - lo) + lo

    P = {}
    for i in range(L):
        p = f"layers.{i}."
        P[p + "attn_norm"] = u(d)
        for k in ("q_proj", "k_proj", "v_proj", "o_proj"):
            P[p + k] = n(d, d, std=d ** -0.5)
        P[p + "ffn_norm"] = u(d)
        P[p + "gate_proj"] = n(F_, d, std=d ** -0.5)
        P[p + "up_proj"] = n(F_, d, std=d ** -0.5)
        P[p + "down_proj"] = n(d, F_, std=F_ ** -0.5)
    P["context_proj"] = n(d, m * H, std=(m * H) ** -0.5)
    P["context_norm"] = u(d)
    P["token_proj"] = n(d, H, std=1.0 / (E_std * H ** 0.5))  # E rows have std E_std: ~unit output
    P["mask_embed"] = n(g - 1, d, std=0.5)
    P["block_pos"] = n(g, d, std=0.5)
    P["out_norm"] = u(d)
    P["out_proj"] = n(H, d, std=d ** -0.5)
    P["markov.w1"] = n(V, r, std=0.5)
    P["markov.w2"] = n(V, r, std=0.5)
    P["confidence.weight"] = n(1, d + r, std=0.2)
    P["confidence.bias"] = u(1, lo=-1.0, hi=1.0)
    return P


def specula_context_kv(P, ctx_taps, eps):
    """Context rows -> per layer (K, V) [n, d]; independent of the block (no RoPE), hence cacheable."""
    ctx = rms(ctx_taps @ P["context_proj"].T, P["context_norm"], eps)
    out = []
    for i in range(SPECULA["num_layers"]):
        nc = rms(ctx, P[f"layers.{i}.attn_norm"], eps)
        out.append((nc @ P[f"layers.{i}.k_proj"].T, nc @ P[f"layers.{i}.v_proj"].T))
    return out


def specula_block(P, kv, anchor, E, cap, eps):
    """docs/dspark.md "specula layout forward": -> h [g, d] (after out_norm), U [g, V]."""
    c = SPECULA
    g, d, nh = c["block_size"], c["hidden_size"], c["num_heads"]
    hd = d // nh
    x0 = E[anchor] @ P["token_proj"].T + P["block_pos"][0]
    X = torch.cat([x0[None], P["mask_embed"] + P["block_pos"][1:]])
    for i, (Kc, Vc) in enumerate(kv):
        w = lambda name: P[f"layers.{i}.{name}"]  # noqa: E731
        nd = rms(X, w("attn_norm"), eps)
        Q = (nd @ w("q_proj").T).view(g, nh, hd)
        K = torch.cat([Kc, nd @ w("k_proj").T]).view(-1, nh, hd)  # context rows first
        V = torch.cat([Vc, nd @ w("v_proj").T]).view(-1, nh, hd)
        att = torch.softmax(torch.einsum("qhd,khd->hqk", Q, K) * hd ** -0.5, dim=-1)  # no mask
        X = X + torch.einsum("hqk,khd->qhd", att, V).reshape(g, d) @ w("o_proj").T
        n2 = rms(X, w("ffn_norm"), eps)
        X = X + (F.gelu(n2 @ w("gate_proj").T, approximate="tanh") * (n2 @ w("up_proj").T)) @ w("down_proj").T
    h = rms(X, P["out_norm"], eps)
    return h, softcap((h @ P["out_proj"].T) @ E.T, cap)


def specula_rounds(P, tgt, incremental):
    """All rounds; incremental: the context-KV cache grows by the new rows only (as on_committed)."""
    taps = torch.cat([tgt.hs[t] for t in SPECULA["tap_layers"]], dim=-1)
    kv, prev_t, rounds = None, 0, []
    for t in CONTEXTS:
        if incremental and kv is not None:
            new = specula_context_kv(P, taps[prev_t:t], tgt.eps)
            kv = [(torch.cat([a[0], b[0]]), torch.cat([a[1], b[1]])) for a, b in zip(kv, new)]
        else:
            kv = specula_context_kv(P, taps[:t], tgt.eps)
        prev_t = t
        anchor = int(tgt.seq[t])
        h, U = specula_block(P, kv, anchor, tgt.E, tgt.cap, tgt.eps)
        rounds.append(greedy_heads(U, h, anchor, P["markov.w1"], P["markov.w2"], P["confidence.weight"],
                                   P["confidence.bias"]))
    return stack_rounds(rounds, tgt.seq)


def make_specula(out_root, tgt, meta_common):
    from safetensors.torch import load_file, save_file

    H, V, L = tgt.cfg["hidden_size"], tgt.cfg["vocab_size"], tgt.cfg["num_hidden_layers"]
    if max(SPECULA["tap_layers"]) > L:
        raise RuntimeError(f"tap_layers {SPECULA['tap_layers']} exceed L = {L}")
    attempts = []
    for a in range(MAX_SEED_ATTEMPTS):
        seed = SPECULA_SEED + a
        P = specula_params(torch.Generator().manual_seed(seed), H, V, float(tgt.E.std()))
        q = chain_quality(specula_rounds(P, tgt, incremental=True))
        q["ok"] = q["min_top2_margin"] >= MIN_MARGIN and q["distinct_draft_tokens"] >= MIN_DISTINCT
        attempts.append(dict(seed=seed, **q))
        log(f"[dspark] seed {seed}: {q}")
        if q["ok"]:
            break
    if not attempts[-1]["ok"]:
        raise RuntimeError(f"no seed gave margin >= {MIN_MARGIN} and >= {MIN_DISTINCT} distinct drafts")
    out_dir = os.path.join(out_root, "dspark")
    os.makedirs(out_dir, exist_ok=True)
    path = os.path.join(out_dir, "model.safetensors")
    save_file({k: v.float().contiguous() for k, v in P.items()}, path, metadata={"format": "pt"})
    P = load_file(path)  # compute from what the file holds
    canon = canonical_config_string(tgt.cfg)
    g = SPECULA["block_size"]
    dspark_json = {
        "kind": "dspark-drafter", "variant": "dspark", "version": 1,
        "target": {"hidden_size": H, "vocab_size": V, "num_hidden_layers": L,
                   "config_hash": hashlib.sha256(canon.encode("utf-8")).hexdigest()},
        "config": dict(SPECULA, rms_norm_eps=tgt.eps),
        # Synthetic (samples 0): position 0 is never pruned; the fixture's confidences decide the rest.
        "calibration": {"thresholds": [0.0] + [0.5] * (g - 1), "target": 0.5, "samples": 0},
    }
    with open(os.path.join(out_dir, "dspark.json"), "w") as f:
        json.dump(dspark_json, f, indent=1)
    exp = specula_rounds(P, tgt, incremental=True)
    scratch = specula_rounds(P, tgt, incremental=False)
    inc_diff = compare_rounds(exp, scratch, "specula incremental vs scratch")
    if inc_diff > TOL:
        raise RuntimeError(f"specula: incremental context-KV differs from scratch by {inc_diff}")
    save_expected(out_dir, exp, "tools/golden/make_dspark_golden.py")
    meta = dict(meta_common, fixture="dspark", layout="specula (seed v2)", target_fixture="dense_kev",
                seed=attempts[-1]["seed"], seed_attempts=attempts, dtype="float32", dspark_json=dspark_json,
                checkpoint_tensors={k: list(v.shape) for k, v in sorted(P.items())},
                target_config_hash_input=canon,
                target_config_hash_rule="sha256 hex of canonical_config_string (docs/dspark.md)",
                init={"norms": "uniform(0.5, 1.5)", "linears": "N(0, 1/in)", "token_proj": "N(0, 1/(E_std^2 H))",
                      "mask_embed, block_pos": "N(0, 0.25)", "markov.w1, markov.w2": "N(0, 0.25)",
                      "confidence.weight": "N(0, 0.04)", "confidence.bias": "uniform(-1, 1)"},
                contexts=CONTEXTS, anchors=[int(tgt.seq[t]) for t in CONTEXTS],
                incremental_vs_scratch_max_abs_diff=inc_diff,
                expected_tensors={k: [str(v.dtype).replace("torch.", ""), list(v.shape)] for k, v in exp.items()},
                draft_tokens=exp["draft_tokens"].tolist(), **chain_quality(exp), **tgt.info)
    write_meta(out_dir, meta)
    log(f"[dspark] ok: seed {meta['seed']}, margin {meta['min_top2_margin']:.4g}, inc diff {inc_diff:.2e}")


# ----------------------------------------------------------------------------- DeepSpec layout


class ModelArgs(dict):
    """build_draft_config reads model_args.x and tests `"x" in model_args`."""

    def __getattr__(self, key):
        try:
            return self[key]
        except KeyError:
            raise AttributeError(key) from None


def _deepspec_modules():
    g4 = importlib.import_module("deepspec.modeling.dspark.gemma4")
    common = importlib.import_module("deepspec.modeling.dspark.common")
    ops = importlib.import_module("deepspec.eval.dspark.draft_ops")
    return types.SimpleNamespace(Model=g4.Gemma4DSparkModel, build_draft_config=g4.build_draft_config,
                                 extract_context_feature=common.extract_context_feature,
                                 forward_dspark_draft_block=ops.forward_dspark_draft_block,
                                 build_dspark_proposal=ops.build_dspark_proposal)


def import_deepspec(root):
    """Imports DeepSpec's modules from a checkout. If the package __init__ chain fails (it pulls in
    trainers, EAGLE-3 and Qwen3 code written for transformers 5.10), retries with the packages
    registered empty so only the DSpark modules (and what they import) run; records which."""
    if not os.path.isdir(os.path.join(root, "deepspec")):
        raise RuntimeError(f"--deepspec {root}: no deepspec/ package in it")
    sys.path.insert(0, root)
    try:
        return _deepspec_modules(), "regular package import"
    except Exception as e:  # noqa: BLE001 - fall back below and record why
        first = f"{type(e).__name__}: {e}"
    for name in [n for n in sys.modules if n == "deepspec" or n.startswith("deepspec.")]:
        del sys.modules[name]
    for pkg in ("deepspec", "deepspec.modeling", "deepspec.modeling.dspark", "deepspec.eval",
                "deepspec.eval.dspark", "deepspec.utils", "deepspec.data"):
        mod = types.ModuleType(pkg)
        mod.__path__ = [os.path.join(root, *pkg.split("."))]
        sys.modules[pkg] = mod
    stubs = []
    # draft_ops imports Qwen3DSparkModel only for a type alias and DraftProposal as a base dataclass.
    try:
        importlib.import_module("deepspec.modeling.dspark.qwen3")
    except Exception as e:  # noqa: BLE001
        stub = types.ModuleType("deepspec.modeling.dspark.qwen3")
        stub.Qwen3DSparkModel = type("Qwen3DSparkModel", (), {})
        sys.modules[stub.__name__] = stub
        stubs.append(f"qwen3 ({type(e).__name__}: {e})")
    try:
        importlib.import_module("deepspec.eval.base_evaluator")
    except Exception as e:  # noqa: BLE001
        stub = types.ModuleType("deepspec.eval.base_evaluator")

        @dataclasses.dataclass
        class DraftProposal:  # same fields as DeepSpec's
            draft_token_count: int
            verify_input_ids: object
            draft_probs: object

        stub.DraftProposal = DraftProposal
        sys.modules[stub.__name__] = stub
        stubs.append(f"base_evaluator.DraftProposal ({type(e).__name__}: {e})")
    return _deepspec_modules(), f"minimal import after [{first}]; stubs: {stubs or 'none'}"


def deepspec_commit(root, given):
    if given:
        return given, "--deepspec-commit"
    try:
        r = subprocess.run(["git", "-C", root, "rev-parse", "HEAD"], capture_output=True, text=True, timeout=30)
        if r.returncode == 0 and r.stdout.strip():
            return r.stdout.strip(), "git rev-parse HEAD"
    except Exception:  # noqa: BLE001 - git missing: read .git by hand
        pass
    head = os.path.join(root, ".git", "HEAD")  # a detached checkout's HEAD holds the commit itself
    if os.path.isfile(head) and not open(head).read().startswith("ref: "):
        return open(head).read().strip(), ".git/HEAD"
    return "unknown", "no --deepspec-commit and no readable .git"


def flatten_gemma4_config(cfg):
    """Makes a Gemma4TextConfig homogeneous with flat global_head_dim / num_global_key_value_heads,
    the 5.10 form DeepSpec expects. 5.15+ folds those into per_layer_config, then refuses global reads
    of head_dim / num_key_value_heads (hasattr raises) and drops global_head_dim; the draft's layers
    are all full attention and DeepSpec reads only the global_* fields, so per_layer_config goes."""
    if getattr(cfg, "per_layer_config", None) is not None:
        cfg.per_layer_config = None  # 5.15+ setter: drops the heterogeneity spec
    cfg.global_head_dim = GLOBAL_HEAD_DIM
    cfg.num_global_key_value_heads = NUM_GLOBAL_KV_HEADS
    return cfg


def replicate_build_draft_config(text_cfg, args):
    """DeepSpec's build_draft_config steps (deepspec/modeling/dspark/gemma4/config.py), used only if
    calling it fails; meta.json says which was used."""
    dc = copy.deepcopy(text_cfg)
    dc.architectures = ["Gemma4DSparkModel"]
    dc.target_model_type = "gemma4"
    dc.target_text_model_type = str(dc.model_type)
    dc.num_target_layers = int(dc.num_hidden_layers)
    dc.num_hidden_layers = int(args.num_draft_layers)
    dc.block_size = int(args.block_size)
    dc.tie_word_embeddings = False
    dc.layer_types = ["full_attention"] * int(args.num_draft_layers)
    dc.mask_token_id = int(args.mask_token_id)
    dc.target_layer_ids = list(args.target_layer_ids)
    dc.num_anchors = int(args.num_anchors)
    dc.enable_confidence_head = float(args.confidence_head_alpha) > 0.0
    dc.confidence_head_with_markov = bool(args.confidence_head_with_markov)
    dc.markov_rank = int(args.markov_rank)
    dc.markov_head_type = str(args.markov_head_type)
    return dc


def deepspec_draft_config(ds, tgt):
    tc = flatten_gemma4_config(copy.deepcopy(tgt.model.config))
    args = ModelArgs(DEEPSPEC_ARGS)
    try:
        from transformers import Gemma4Config

        top, how = Gemma4Config(text_config=tc), "Gemma4Config(text_config=flattened copy of dense_kev's config)"
    except Exception as e:  # noqa: BLE001 - build_draft_config reads only .model_type and .text_config
        top = types.SimpleNamespace(model_type="gemma4", text_config=tc)
        how = f"SimpleNamespace(model_type='gemma4', text_config=...) since Gemma4Config raised {type(e).__name__}: {e}"
    try:
        dc = ds.build_draft_config(top, args)
        how += "; DeepSpec's build_draft_config"
    except Exception as e:  # noqa: BLE001
        dc = replicate_build_draft_config(tc, args)
        how += f"; replicated build_draft_config's steps since it raised {type(e).__name__}: {e}"
    flatten_gemma4_config(dc)
    dc._attn_implementation = "eager"  # with attention_mask None DeepSpec calls SDPA whatever this says
    return dc, how


def expected_deepspec_shapes(c, H, V):
    nh, hd, kv, r = c.num_attention_heads, GLOBAL_HEAD_DIM, NUM_GLOBAL_KV_HEADS, c.markov_rank
    s = {"embed_tokens.weight": (V, H), "fc.weight": (H, len(c.target_layer_ids) * H), "hidden_norm.weight": (H,),
         "norm.weight": (H,), "lm_head.weight": (V, H), "markov_head.markov_w1.weight": (V, r),
         "markov_head.markov_w2.weight": (V, r), "confidence_head.proj.weight": (1, H + r),
         "confidence_head.proj.bias": (1,)}
    for i in range(c.num_hidden_layers):
        p = f"layers.{i}."
        s.update({p + "self_attn.q_proj.weight": (nh * hd, H), p + "self_attn.k_proj.weight": (kv * hd, H),
                  p + "self_attn.o_proj.weight": (H, nh * hd), p + "self_attn.q_norm.weight": (hd,),
                  p + "self_attn.k_norm.weight": (hd,), p + "mlp.gate_proj.weight": (c.intermediate_size, H),
                  p + "mlp.up_proj.weight": (c.intermediate_size, H), p + "mlp.down_proj.weight": (H, c.intermediate_size),
                  p + "layer_scalar": (1,)})
        for n in ("input", "post_attention", "pre_feedforward", "post_feedforward"):
            s[f"{p}{n}_layernorm.weight"] = (H,)
    return s  # no v_proj: attention_k_eq_v (checked by the caller)


def randomise_deepspec(model, gen):
    """Every parameter and layer_scalar random; embed_tokens / lm_head independent of the target's."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name == "confidence_head.proj.bias":
                p.copy_(torch.rand(p.shape, generator=gen) * 2 - 1)
            elif p.dim() <= 1:  # every norm weight
                p.copy_(torch.rand(p.shape, generator=gen) + 0.5)
            else:
                std = 0.3 if ("embed_tokens" in name or "lm_head" in name) else \
                    0.5 if "markov" in name else 0.2 if "confidence" in name else 0.1
                p.copy_(torch.randn(p.shape, generator=gen) * std)
        for name, b in model.named_buffers():
            if name.endswith("layer_scalar"):
                b.copy_(torch.rand(b.shape, generator=gen) + 0.5)


def check_deepspec_model(model, tgt):
    """Shapes per docs/dspark.md and that nothing kept a constant initial value."""
    c = model.config
    want = expected_deepspec_shapes(c, tgt.cfg["hidden_size"], tgt.cfg["vocab_size"])
    # embed_scale (sqrt(H)) is a non-persistent buffer in 5.x; tolerated here if a version saves it.
    got = {k: tuple(v.shape) for k, v in model.state_dict().items() if not k.endswith("embed_scale")}
    if got != want:
        diff = sorted(set(got.items()) ^ set(want.items()))
        raise RuntimeError(f"DeepSpec draft tensors differ from docs/dspark.md: {diff}")
    for i, layer in enumerate(model.layers):
        a = layer.self_attn
        if (a.head_dim, a.num_key_value_heads, a.num_attention_heads, a.v_proj) != (GLOBAL_HEAD_DIM, NUM_GLOBAL_KV_HEADS,
                                                                                    c.num_attention_heads, None):
            raise RuntimeError(f"layer {i}: attention geometry {a.head_dim}, {a.num_key_value_heads}, {a.v_proj}")
    for k, v in model.state_dict().items():
        if (v.numel() > 1 and float(v.float().std()) == 0.0) or (v.numel() == 1 and float(v) in (0.0, 1.0)):
            raise RuntimeError(f"{k} still holds a constant value")
    if torch.allclose(model.embed_tokens.weight, tgt.E):
        raise RuntimeError("DeepSpec embed_tokens equals the target's")
    return {k: list(v) for k, v in sorted(got.items())}


def proportional_inv_freq(tgt):
    """docs/dspark.md RoPE: the target's full-attention rope over global_head_dim (HF proportional)."""
    rp = tgt.cfg["rope_parameters"]["full_attention"]
    hd = GLOBAL_HEAD_DIM
    angles = int(rp.get("partial_rotary_factor", 1.0) * hd // 2)
    inv = 1.0 / (rp["rope_theta"] ** (torch.arange(0, 2 * angles, 2, dtype=torch.int64).float() / hd))
    return torch.cat([inv, torch.zeros(hd // 2 - angles)]) / rp.get("factor", 1.0)


def rope(x, pos, inv_freq):
    """x [n, heads, hd] at positions pos [n]: x cos + rotate_half(x) sin, cos/sin = cat(f, f)."""
    f = pos.float()[:, None] * inv_freq[None, :]
    emb = torch.cat([f, f], dim=-1)
    cos, sin = emb.cos()[:, None, :], emb.sin()[:, None, :]
    half = x.shape[-1] // 2
    return x * cos + torch.cat([-x[..., half:], x[..., :half]], dim=-1) * sin


def deepspec_docs_block(sd, c, ctx_taps, anchor, t, inv_freq, cap):
    """Independent transcription of docs/dspark.md "DeepSpec layout forward" from the raw tensors."""
    H, nh, hd, g, eps = c.hidden_size, c.num_attention_heads, GLOBAL_HEAD_DIM, c.block_size, c.rms_norm_eps
    keq = bool(c.attention_k_eq_v)
    kvh = c.num_global_key_value_heads if keq else c.num_key_value_heads
    ids = torch.tensor([anchor] + [c.mask_token_id] * (g - 1))
    X = sd["embed_tokens.weight"][ids] * torch.tensor(H ** 0.5)
    ctx = rms(ctx_taps @ sd["fc.weight"].T, sd["hidden_norm.weight"], eps)
    pc, pb = torch.arange(t), torch.arange(t, t + g)
    for i in range(c.num_hidden_layers):
        w = lambda name: sd[f"layers.{i}.{name}"]  # noqa: E731
        xn = rms(X, w("input_layernorm.weight"), eps)
        q = rope(rms((xn @ w("self_attn.q_proj.weight").T).view(g, nh, hd), w("self_attn.q_norm.weight"), eps),
                 pb, inv_freq)

        def kv(z, pos):
            k = (z @ w("self_attn.k_proj.weight").T).view(len(z), kvh, hd)
            v = k if keq else (z @ w("self_attn.v_proj.weight").T).view(len(z), kvh, hd)
            return rope(rms(k, w("self_attn.k_norm.weight"), eps), pos, inv_freq), rms(v, None, eps)

        (kc, vc), (kb, vb) = kv(ctx, pc), kv(xn, pb)
        K = torch.cat([kc, kb]).repeat_interleave(nh // kvh, dim=1)
        V = torch.cat([vc, vb]).repeat_interleave(nh // kvh, dim=1)
        att = torch.softmax(torch.einsum("qhd,khd->hqk", q, K), dim=-1)  # scale 1.0, no mask
        o = torch.einsum("hqk,khd->qhd", att, V).reshape(g, nh * hd) @ w("self_attn.o_proj.weight").T
        X = X + rms(o, w("post_attention_layernorm.weight"), eps)
        m = rms(X, w("pre_feedforward_layernorm.weight"), eps)
        m = (F.gelu(m @ w("mlp.gate_proj.weight").T, approximate="tanh") * (m @ w("mlp.up_proj.weight").T)) \
            @ w("mlp.down_proj.weight").T
        X = (X + rms(m, w("post_feedforward_layernorm.weight"), eps)) * w("layer_scalar")
    h = rms(X, sd["norm.weight"], eps)
    return h, softcap(h @ sd["lm_head.weight"].T, cap)


def deepspec_rounds(model, ds, tgt, taps, incremental):
    """DeepSpec's inference path, as Gemma4DSparkEvaluator._propose / build_dspark_proposal use it.
    incremental: one DynamicCache across rounds fed only the new context rows (their _update);
    else a fresh cache and the whole context every round."""
    from transformers import DynamicCache

    g, mask = model.block_size, int(model.mask_token_id)
    cache, prev_t, rounds = DynamicCache(), 0, []
    for t in CONTEXTS:
        if not incremental:
            cache, prev_t = DynamicCache(), 0
        if cache.get_seq_length() != prev_t:
            raise RuntimeError(f"draft cache holds {cache.get_seq_length()} rows before round t={t}, want {prev_t}")
        ids = torch.full((1, g), mask, dtype=torch.long)
        ids[0, 0] = tgt.seq[t]
        bh = ds.forward_dspark_draft_block(model, draft_input_ids=ids, position_ids=torch.arange(t + g)[None],
                                           past_key_values_draft=cache, target_hidden_states=taps[:, prev_t:t],
                                           start=t, block_size=g)
        if cache.get_seq_length() != t:  # cropped to the context: the block never stays
            raise RuntimeError(f"draft cache holds {cache.get_seq_length()} rows after round t={t}")
        prev_t = t
        hidden = bh[:, :g]
        base = model.compute_logits(hidden)
        toks, block = model.sample_draft_tokens(base, first_prev_token_ids=ids[:, 0], temperature=0.0,
                                                hidden_states=hidden)
        prev = torch.cat([ids[:, :1], toks[:, :-1]], dim=1)
        conf = model.predict_confidence_step(hidden, prev_token_ids=prev)
        prop = ds.build_dspark_proposal(model, draft_input_ids=ids, block_hidden=bh, block_size=g, temperature=0.0,
                                        confidence_threshold=0.0)
        if not torch.equal(prop.verify_input_ids[0, 1:], toks[0]) or max_diff(prop.confidence_logits, conf) > TOL:
            raise RuntimeError("build_dspark_proposal disagrees with sample_draft_tokens / predict_confidence_step")
        rounds.append({"base": base[0], "block": block[0], "conf": torch.sigmoid(conf[0].float()), "tokens": toks[0]})
    return stack_rounds(rounds, tgt.seq)


def deepspec_docs_rounds(model, tgt, taps):
    sd = {k: v.detach().float() for k, v in model.state_dict().items()}
    inv = proportional_inv_freq(tgt)
    rounds = []
    for t in CONTEXTS:
        anchor = int(tgt.seq[t])
        h, U = deepspec_docs_block(sd, model.config, taps[0, :t], anchor, t, inv, tgt.cap)
        rounds.append(greedy_heads(U, h, anchor, sd["markov_head.markov_w1.weight"], sd["markov_head.markov_w2.weight"],
                                   sd["confidence_head.proj.weight"], sd["confidence_head.proj.bias"]))
    return stack_rounds(rounds, tgt.seq)


def save_reload_deepspec(model, ds, out_dir):
    """save_pretrained, make sure config.json carries every key the C++ loader reads, reload, and
    check that every tensor survived."""
    from transformers import Gemma4TextConfig

    os.makedirs(out_dir, exist_ok=True)
    model.save_pretrained(out_dir)
    gen_cfg = os.path.join(out_dir, "generation_config.json")
    if os.path.exists(gen_cfg):
        os.remove(gen_cfg)  # not part of the contract
    path = os.path.join(out_dir, "config.json")
    with open(path) as f:
        d = json.load(f)
    caveats = []
    if d.get("per_layer_config"):
        raise RuntimeError(f"draft config.json still has per_layer_config {d['per_layer_config']}")
    for k in DEEPSPEC_JSON_KEYS:
        v = getattr(model.config, k)
        if k not in d:  # to_diff_dict may drop default-valued keys; the C++ loader wants them all
            d[k] = v
            caveats.append(f"config.json: added {k}={v!r} (save_pretrained omitted it)")
        elif json.loads(json.dumps(v)) != d[k]:
            raise RuntimeError(f"config.json {k} = {d[k]!r}, model config says {v!r}")
    if caveats:
        with open(path, "w") as f:
            json.dump(d, f, indent=2, sort_keys=True)
    cfg = flatten_gemma4_config(Gemma4TextConfig.from_pretrained(out_dir))  # 5.15+ pops global_head_dim
    cfg._attn_implementation = "eager"
    reloaded = load_pretrained(ds.Model, out_dir, config=cfg)
    a, b = model.state_dict(), reloaded.state_dict()
    if sorted(a) != sorted(b):
        raise RuntimeError(f"tensor names changed on reload: {sorted(set(a) ^ set(b))}")
    for k in a:
        if not torch.equal(a[k], b[k]):
            raise RuntimeError(f"{k} changed after save/reload")
    from safetensors import safe_open

    with safe_open(os.path.join(out_dir, "model.safetensors"), "pt") as f:
        names = sorted(f.keys())
    if names != sorted(a):
        raise RuntimeError(f"model.safetensors names {names} != state_dict {sorted(a)}")
    return reloaded, d, caveats


def patch_rotary_for_transformers_517(target_dir):
    """DeepSpec (written for transformers 5.10) builds `Gemma4TextRotaryEmbedding(config,
    layer_type="full_attention")`; 5.17's takes no layer_type (it builds every layer type's
    inv_freq from config.per_layer_config, which the flattened draft config no longer has) and
    picks the type in forward(), which DeepSpec already passes. So the draft's rotary module is
    built from the target's own config: the target's full-attention RoPE, as docs/dspark.md says."""
    from transformers import AutoConfig

    modeling = importlib.import_module("deepspec.modeling.dspark.gemma4.modeling")
    base = modeling.Gemma4TextRotaryEmbedding
    if "layer_type" in inspect.signature(base.__init__).parameters:
        return "not needed (this transformers takes layer_type)"
    target_cfg = AutoConfig.from_pretrained(target_dir)

    class TargetRotary(base):
        def __init__(self, config, device=None, layer_type=None):  # noqa: ARG002 - see docstring
            super().__init__(target_cfg)

    modeling.Gemma4TextRotaryEmbedding = TargetRotary
    return "Gemma4TextRotaryEmbedding built from the target config (transformers >= 5.15 signature)"


def make_deepspec(out_root, tgt, meta_common, root, commit_arg, target_dir):
    ds, import_mode = import_deepspec(os.path.abspath(root))
    import_mode += "; rotary: " + patch_rotary_for_transformers_517(target_dir)
    commit, commit_src = deepspec_commit(root, commit_arg)
    log(f"[dspark_deepspec] DeepSpec {commit} ({commit_src}); import: {import_mode}")
    dc, how = deepspec_draft_config(ds, tgt)
    taps = ds.extract_context_feature(tgt.hs_batched, dc.target_layer_ids).float()  # [1, N, m H]
    engine_taps = [k + 1 for k in dc.target_layer_ids]
    if max_diff(taps[0], torch.cat([tgt.hs[k] for k in engine_taps], dim=-1)) != 0.0:
        raise RuntimeError(f"extract_context_feature({dc.target_layer_ids}) != hidden_states{engine_taps}")
    attempts = []
    for a in range(MAX_SEED_ATTEMPTS):
        seed = DEEPSPEC_SEED + a
        torch.manual_seed(seed)
        model = ds.Model(copy.deepcopy(dc)).float().eval()
        randomise_deepspec(model, torch.Generator().manual_seed(seed))
        shapes = check_deepspec_model(model, tgt)
        first = deepspec_rounds(model, ds, tgt, taps, incremental=True)
        q = chain_quality(first)
        q["ok"] = q["min_top2_margin"] >= MIN_MARGIN and q["distinct_draft_tokens"] >= MIN_DISTINCT
        attempts.append(dict(seed=seed, **q))
        log(f"[dspark_deepspec] seed {seed}: {q}")
        if q["ok"]:
            break
    if not attempts[-1]["ok"]:
        raise RuntimeError(f"no seed gave margin >= {MIN_MARGIN} and >= {MIN_DISTINCT} distinct drafts")
    out_dir = os.path.join(out_root, "dspark_deepspec")
    model, cfg_json, caveats = save_reload_deepspec(model, ds, out_dir)
    check_deepspec_model(model, tgt)
    # Everything below runs on the reloaded checkpoint.
    exp = deepspec_rounds(model, ds, tgt, taps, incremental=True)
    reload_diff = compare_rounds(exp, first, "DeepSpec before vs after save/reload")
    scratch = deepspec_rounds(model, ds, tgt, taps, incremental=False)
    inc_diff = compare_rounds(exp, scratch, "DeepSpec incremental cache vs scratch")
    if inc_diff > TOL or reload_diff > TOL:
        raise RuntimeError(f"DeepSpec: incremental vs scratch {inc_diff}, reload {reload_diff} (tol {TOL})")
    inv = proportional_inv_freq(tgt)
    model_inv = getattr(model.rotary_emb, "full_attention_inv_freq", None)
    if model_inv is not None and max_diff(model_inv, inv) > 0:
        raise RuntimeError(f"DeepSpec full-attention inv_freq {model_inv.tolist()} != docs {inv.tolist()}")
    docs_diff = compare_rounds(exp, deepspec_docs_rounds(model, tgt, taps), "DeepSpec vs docs/dspark.md math")
    if docs_diff > DOCS_TOL:
        raise RuntimeError(f"DeepSpec's outputs differ from the docs/dspark.md transcription by {docs_diff}")
    if docs_diff > TOL:
        caveats.append(f"docs transcription differs from DeepSpec by {docs_diff} (> {TOL}, <= {DOCS_TOL})")
    save_expected(out_dir, exp, "tools/golden/make_dspark_golden.py (DeepSpec modeling)")
    if commit == "unknown":
        caveats.append("DeepSpec commit unknown: pass --deepspec-commit")
    meta = dict(meta_common, fixture="dspark_deepspec", layout="DeepSpec (Gemma4DSparkModel)",
                target_fixture="dense_kev", seed=attempts[-1]["seed"], seed_attempts=attempts, dtype="float32",
                deepspec_commit=commit, deepspec_commit_source=commit_src, deepspec_import=import_mode,
                deepspec_file_sha256={p: sha256_file(os.path.join(root, p)) for p in DEEPSPEC_FILES
                                      if os.path.isfile(os.path.join(root, p))},
                model_args=DEEPSPEC_ARGS, draft_config_construction=how, config=cfg_json, engine_taps=engine_taps,
                checkpoint_tensors=shapes, rope_full_attention_inv_freq=inv.tolist(),
                init={"norms, layer_scalar": "uniform(0.5, 1.5)", "embed_tokens, lm_head": "N(0, 0.09)",
                      "markov": "N(0, 0.25)", "confidence weight": "N(0, 0.04)", "confidence bias": "uniform(-1, 1)",
                      "other linears": "N(0, 0.01)"},
                inference_path="forward_dspark_draft_block (DynamicCache, crop to the context) + compute_logits + "
                               "sample_draft_tokens (vanilla Markov, greedy) + predict_confidence_step; "
                               "cross-checked with build_dspark_proposal",
                contexts=CONTEXTS, anchors=[int(tgt.seq[t]) for t in CONTEXTS],
                incremental_vs_scratch_max_abs_diff=inc_diff, reload_max_abs_diff=reload_diff,
                docs_math_max_abs_diff=docs_diff, caveats=caveats,
                expected_tensors={k: [str(v.dtype).replace("torch.", ""), list(v.shape)] for k, v in exp.items()},
                draft_tokens=exp["draft_tokens"].tolist(), **chain_quality(exp), **tgt.info)
    write_meta(out_dir, meta)
    log(f"[dspark_deepspec] ok: seed {meta['seed']}, margin {meta['min_top2_margin']:.4g}, "
        f"inc diff {inc_diff:.2e}, docs diff {docs_diff:.2e}")


# ----------------------------------------------------------------------------- main


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True, help="output folder; gets dspark/ and dspark_deepspec/")
    ap.add_argument("--target", default=os.path.join(REPO, "tests", "golden", "dense_kev"),
                    help="the dense_kev target fixture (default: the repository's)")
    ap.add_argument("--deepspec", default=None, help="a checkout of github.com/deepseek-ai/DeepSpec")
    ap.add_argument("--deepspec-commit", default=None, help="its commit (default: read from DIR/.git)")
    ap.add_argument("--only", default=None, help="dspark or dspark_deepspec (default: both)")
    args = ap.parse_args()
    only = set(args.only.split(",")) if args.only else {"dspark", "dspark_deepspec"}
    if "dspark_deepspec" in only and not args.deepspec:
        ap.error("dspark_deepspec needs --deepspec DIR (or --only dspark)")

    log("versions:", versions())
    torch.set_num_threads(1)  # CPU fp32, one thread: deterministic reductions
    torch.set_grad_enabled(False)
    meta_common = dict(versions=versions(), device="cpu", attn_implementation="eager", producer=
                       "tools/golden/make_dspark_golden.py",
                       date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                       min_margin_required=MIN_MARGIN, tolerance=TOL)
    tgt = load_target(args.target)
    log("target:", tgt.info)
    failures = []
    for name, make in (("dspark", lambda: make_specula(args.out, tgt, meta_common)),
                       ("dspark_deepspec", lambda: make_deepspec(args.out, tgt, meta_common, args.deepspec,
                                                                 args.deepspec_commit, args.target))):
        if name not in only:
            continue
        try:
            make()
        except Exception:  # noqa: BLE001 - report every fixture, then fail
            traceback.print_exc()
            failures.append(name)
    if failures:
        log("FAILED:", failures)
        sys.exit(1)
    log("fixtures written to", args.out)


if __name__ == "__main__":
    main()
