#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
"""PyTorch / transformers baseline for `specula bench --micro` on the same GPU.

Builds a transformers Gemma4ForCausalLM (text only) of a released shape with random bf16 weights
on CUDA, plus a random Gemma4AssistantForCausalLM drafter of the released drafter shape, and times:

- prefill of --prefill-tokens tokens (one forward, logits of the last token only);
- plain greedy generate at each --batch: time per step = (t(max_new_tokens=N) - t(1)) / (N - 1)
  on a --context-token prompt, tokens/s = batch / time per step;
- assisted generation (assistant_model=drafter, greedy, constant --draft-tokens per round): decode
  tokens/s = (N - 1) / (t(assisted, N) - t(plain, 1)), and tau = committed tokens per target
  forward after the prefill (target forwards counted with a hook).

The shapes come from specula itself (`specula bench --print-preset-config NAME` and
`--print-assistant-config NAME`, or --config / --assistant-config files), so both sides measure
the same model. With --specula-json (the output of `specula bench --micro --json`) the ratios
specula / torch are added. Prints one JSON line (also written to --out); every stage is guarded, so
a failure is reported in the JSON instead of ending the run.

Run on the GPU machine (torch 2.11, transformers 5.17):
    python3 tools/gpu/torch_bench.py --preset 31b --specula build-gpu/apps/specula
"""

import argparse
import json
import platform
import statistics
import subprocess
import sys
import time
import traceback

import torch

import transformers

# Keys of specula's config.json that are not Gemma4TextConfig constructor arguments.
NOT_KWARGS = ("model_type", "architectures", "torch_dtype", "dtype", "transformers_version")


def log(*args):
    print(*args, file=sys.stderr, flush=True)


def versions():
    v = {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "cuda": torch.version.cuda,
    }
    if torch.cuda.is_available():
        v["gpu"] = torch.cuda.get_device_name(0)
    return v


def error_record(e):
    return {"error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc(limit=6)}


def read_config(path, specula, flag, preset):
    if path:
        with open(path) as f:
            return json.load(f), path
    if not specula:
        raise SystemExit(f"give --config/--assistant-config or --specula to run `specula bench {flag}`")
    out = subprocess.run([specula, "bench", flag, preset], check=True, capture_output=True, text=True)
    return json.loads(out.stdout), f"{specula} bench {flag} {preset}"


def text_kwargs(cfg):
    return {k: v for k, v in cfg.items() if k not in NOT_KWARGS}


def build(cls, config, attn):
    """Instantiates cls on CUDA in bf16 (weights initialised on the device, which is fast)."""
    attempts = [
        dict(attn_implementation=attn, dtype=torch.bfloat16),
        dict(attn_implementation=attn, torch_dtype=torch.bfloat16),
        dict(attn_implementation="eager", dtype=torch.bfloat16),
        dict(attn_implementation="eager", torch_dtype=torch.bfloat16),
    ]
    last = None
    for kw in attempts:
        try:
            with torch.device("cuda"):
                model = cls._from_config(config, **kw)
            return model.to(device="cuda", dtype=torch.bfloat16).eval(), kw.get("attn_implementation")
        except (TypeError, ValueError) as e:  # keyword or attention kind unsupported here
            last = e
    raise last


def randomise_buffers(model, seed):
    """transformers initialises token_ordering to zeros (every candidate = token 0): permute it."""
    gen = torch.Generator(device="cpu").manual_seed(seed)
    with torch.no_grad():
        for name, b in model.named_buffers():
            if name.endswith("token_ordering"):
                b.copy_(torch.randperm(b.numel(), generator=gen).to(b.dtype).view(b.shape))


def shape_check(model, cfg):
    """The first full-attention layer's q_proj must have heads x global_head_dim outputs (a
    transformers version that ignored the flat global_head_dim would build another model)."""
    try:
        i = cfg["layer_types"].index("full_attention")
        q = model.model.layers[i].self_attn.q_proj.weight.shape[0]
        want = cfg["num_attention_heads"] * cfg.get("global_head_dim", cfg["head_dim"])
        return {"layer": i, "q_proj_rows": q, "expected": want, "ok": q == want}
    except Exception as e:  # noqa: BLE001 - informational only
        return error_record(e)


def n_params(model):
    return sum(p.numel() for p in model.parameters())


def sync_time(fn):
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    out = fn()
    torch.cuda.synchronize()
    return time.perf_counter() - t0, out


def median_time(fn, reps, warmup=1):
    for _ in range(warmup):
        sync_time(fn)
    return statistics.median(sync_time(fn)[0] for _ in range(reps))


def random_ids(gen, vocab, *shape):
    return torch.randint(3, vocab, shape, generator=gen).to("cuda")


def disable_eos(model):
    gc = model.generation_config
    gc.eos_token_id = None
    gc.pad_token_id = 0


def bench_prefill(model, vocab, n, reps, gen):
    ids = random_ids(gen, vocab, 1, n)

    def run():
        with torch.inference_mode():
            try:
                return model(input_ids=ids, use_cache=True, logits_to_keep=1)
            except TypeError:  # older signature without logits_to_keep
                return model(input_ids=ids, use_cache=True)

    t = median_time(run, reps)
    return {"tokens": n, "ms": t * 1e3, "tokens_per_second": n / t}


def generate_time(model, ids, new_tokens, reps, **kw):
    def run():
        with torch.inference_mode():
            return model.generate(input_ids=ids, attention_mask=torch.ones_like(ids),
                                  max_new_tokens=new_tokens, do_sample=False, eos_token_id=None,
                                  pad_token_id=0, **kw)

    t = median_time(run, reps)
    _, out = sync_time(run)
    return t, int(out.shape[1] - ids.shape[1])


def bench_decode(model, vocab, batch, context, new_tokens, reps, gen, cache):
    ids = random_ids(gen, vocab, batch, context)
    kw = {"cache_implementation": cache} if cache else {}
    t1, _ = generate_time(model, ids, 1, reps, **kw)
    tn, made = generate_time(model, ids, new_tokens, reps, **kw)
    step = (tn - t1) / max(1, made - 1)
    return {"batch": batch, "context": context, "new_tokens": made, "t_one_token_s": t1,
            "t_all_tokens_s": tn, "step_ms": step * 1e3, "tokens_per_second": batch / step,
            "cache_implementation": cache or "default"}


def bench_assisted(model, drafter, vocab, context, new_tokens, k, reps, gen):
    ids = random_ids(gen, vocab, 1, context)
    dg = drafter.generation_config
    dg.num_assistant_tokens = k
    dg.num_assistant_tokens_schedule = "constant"
    if hasattr(dg, "assistant_confidence_threshold"):
        dg.assistant_confidence_threshold = 0.0
    disable_eos(drafter)
    calls = {"n": 0}

    def count(*_args, **_kw):
        calls["n"] += 1

    t1, _ = generate_time(model, ids, 1, reps)
    kw = dict(assistant_model=drafter, num_assistant_tokens=k, num_assistant_tokens_schedule="constant")
    tn, made = generate_time(model, ids, new_tokens, reps, **kw)
    hook = model.register_forward_pre_hook(count)
    try:
        sync_time(lambda: model.generate(input_ids=ids, attention_mask=torch.ones_like(ids),
                                         max_new_tokens=new_tokens, do_sample=False, eos_token_id=None,
                                         pad_token_id=0, **kw))
    finally:
        hook.remove()
    rounds = max(1, calls["n"] - 1)  # the first forward is the prefill (it makes token 1)
    return {"draft_tokens": k, "context": context, "new_tokens": made, "t_s": tn,
            "decode_tokens_per_second": (made - 1) / max(1e-9, tn - t1),
            "target_forwards": calls["n"], "tau": (made - 1) / rounds}


def specula_ratios(path, result):
    """specula / torch for the numbers both sides measure."""
    with open(path) as f:
        s = json.load(f)
    micro = s.get("micro", {})
    ratios = {}
    sdec = {d["batch"]: d["tokens_per_second"] for d in micro.get("decode", [])}
    for d in result.get("decode", []):
        if isinstance(d, dict) and d.get("batch") in sdec:
            ratios[f"decode_batch{d['batch']}"] = sdec[d["batch"]] / d["tokens_per_second"]
    if "tokens_per_second" in result.get("prefill", {}) and "prefill" in micro:
        p = micro["prefill"]
        if p.get("tokens") == result["prefill"]["tokens"]:
            ratios["prefill"] = p["tokens_per_second"] / result["prefill"]["tokens_per_second"]
    a = result.get("assisted", {})
    spec_rows = [r for r in s.get("results", []) if r.get("mode") == "speculative"]
    if "decode_tokens_per_second" in a and spec_rows:
        same_k = [r for r in spec_rows if r.get("draft_tokens") == a["draft_tokens"]]
        row = same_k[0] if same_k else max(spec_rows, key=lambda r: r["decode_tokens_per_second"])
        ratios["assisted"] = row["decode_tokens_per_second"] / a["decode_tokens_per_second"]
        ratios["assisted_specula_k"] = row["draft_tokens"]
        ratios["assisted_specula_tau"] = row["tau"]
    return ratios


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--preset", default="31b", help="e2b, e4b, 31b or 26b-a4b")
    ap.add_argument("--specula", help="specula binary, to read the preset configs from")
    ap.add_argument("--config", help="target config.json (instead of --specula)")
    ap.add_argument("--assistant-config", help="assistant config.json (instead of --specula)")
    ap.add_argument("--assistant-head", choices=["centroid", "dense", "released"], default="centroid",
                    help="drafter head; centroid matches `specula bench --draft random` (default)")
    ap.add_argument("--prefill-tokens", type=int, default=4096)
    ap.add_argument("--context", type=int, default=512, help="prompt tokens before decoding")
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--batch", type=int, nargs="+", default=[1])
    ap.add_argument("--draft-tokens", type=int, default=4)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--attn", default="sdpa", help="attn_implementation (falls back to eager)")
    ap.add_argument("--cache-implementation", default=None,
                    help="generate's cache_implementation for plain decoding (default: transformers')")
    ap.add_argument("--seed", type=int, default=1234)
    ap.add_argument("--no-assisted", action="store_true")
    ap.add_argument("--specula-json", help="output of `specula bench --micro --json`, for ratios")
    ap.add_argument("--out", help="also write the JSON here")
    args = ap.parse_args()

    result = {"tool": "torch_bench", "preset": args.preset, "versions": versions(),
              "args": vars(args)}
    torch.manual_seed(args.seed)
    gen = torch.Generator(device="cpu").manual_seed(args.seed)
    model = None
    try:
        from transformers import Gemma4ForCausalLM, Gemma4TextConfig

        tcfg_json, result["config_source"] = read_config(args.config, args.specula,
                                                         "--print-preset-config", args.preset)
        tcfg = Gemma4TextConfig(**text_kwargs(tcfg_json))
        t, (model, attn) = sync_time(lambda: build(Gemma4ForCausalLM, tcfg, args.attn))
        disable_eos(model)
        result["target"] = {"shape_check": shape_check(model, tcfg_json),"params": n_params(model), "build_s": t, "attn_implementation": attn,
                            "config": tcfg.to_dict() if hasattr(tcfg, "to_dict") else None}
        log(f"target: {result['target']['params'] / 1e9:.2f}B params in {t:.1f} s ({attn})")
    except Exception as e:  # noqa: BLE001 - reported in the JSON
        result["target"] = error_record(e)

    vocab = tcfg_json.get("vocab_size", 262144) if model is not None else 0
    if model is not None:
        try:
            result["prefill"] = bench_prefill(model, vocab, args.prefill_tokens, args.reps, gen)
            log("prefill:", result["prefill"])
        except Exception as e:  # noqa: BLE001
            result["prefill"] = error_record(e)
        torch.cuda.empty_cache()
        result["decode"] = []
        for b in args.batch:
            try:
                d = bench_decode(model, vocab, b, args.context, args.new_tokens, args.reps, gen,
                                 args.cache_implementation)
            except Exception as e:  # noqa: BLE001
                d = {"batch": b, **error_record(e)}
            log("decode:", d)
            result["decode"].append(d)
            torch.cuda.empty_cache()

    if model is not None and not args.no_assisted:
        try:
            from transformers import Gemma4AssistantConfig, Gemma4AssistantForCausalLM

            acfg_json, result["assistant_config_source"] = read_config(
                args.assistant_config, args.specula, "--print-assistant-config", args.preset)
            kw = text_kwargs(acfg_json)
            kw["text_config"] = text_kwargs(kw["text_config"])
            if args.assistant_head != "released":
                kw["use_ordered_embeddings"] = args.assistant_head == "centroid"
            acfg = Gemma4AssistantConfig(**kw)
            drafter, attn = build(Gemma4AssistantForCausalLM, acfg, args.attn)
            randomise_buffers(drafter, args.seed + 1)
            result["assistant"] = {"params": n_params(drafter), "attn_implementation": attn,
                                   "head": "centroid" if kw.get("use_ordered_embeddings") else "dense"}
            result["assisted"] = bench_assisted(model, drafter, vocab, args.context, args.new_tokens,
                                                args.draft_tokens, args.reps, gen)
            log("assisted:", result["assisted"])
        except Exception as e:  # noqa: BLE001 - transformers may not support it
            result["assisted"] = error_record(e)

    if args.specula_json:
        try:
            result["specula_over_torch"] = specula_ratios(args.specula_json, result)
        except Exception as e:  # noqa: BLE001
            result["specula_over_torch"] = error_record(e)

    line = json.dumps(result, default=str)
    print(line, flush=True)
    if args.out:
        with open(args.out, "w") as f:
            f.write(line + "\n")


if __name__ == "__main__":
    main()
