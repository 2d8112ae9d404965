# SPDX-License-Identifier: Apache-2.0
"""make_golden.py: helpers shared by the target and assistant fixtures (building, randomising,
saving and reloading models; writing meta.json and expected.safetensors; greedy margins).
"""

import json
import os
import platform

import torch

import transformers

from golden_configs import EMBED_STD, LINEAR_STD, SELECTOR_STD


# ----------------------------------------------------------------------------- helpers


def log(*args):
    print(*args, flush=True)


def versions():
    return {
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "python": platform.python_version(),
    }


def i32(t):
    return t.detach().to(torch.int32).contiguous().cpu()


def f32(t):
    return t.detach().to(torch.float32).contiguous().cpu()


def _with_eager_attention(make, dtype):
    """Returns make(**kw) for the first keyword set this transformers version accepts: eager
    attention (and eager experts where supported) in `dtype` (older versions spell it torch_dtype).
    Raises the last error when none is accepted."""
    attempts = [
        dict(attn_implementation="eager", experts_implementation="eager", dtype=dtype),
        dict(attn_implementation="eager", dtype=dtype),
        dict(attn_implementation="eager", torch_dtype=dtype),
    ]
    last = None
    for kw in attempts:
        try:
            return make(**kw)
        except (TypeError, ValueError) as e:  # keyword unknown or unsupported in this version
            last = e
    raise last


def build_model(cls, config, dtype):
    """Instantiates cls from config with eager attention (and eager experts if supported)."""
    return _with_eager_attention(lambda **kw: cls._from_config(config, **kw), dtype)


def load_model(cls, path, dtype):
    """Loads cls from the checkpoint folder `path`, eager attention as build_model."""
    return _with_eager_attention(lambda **kw: cls.from_pretrained(path, **kw), dtype)


def randomise(model, gen):
    """Overwrites every parameter (and the constant-initialised buffers) with random values.

    RMSNorm weights and every other 1-D parameter (router.scale, router.per_expert_scale) get
    uniform(0.5, 1.5); `layer_scalar` too; `token_ordering` becomes a random permutation.
    """
    report = {"params": 0, "one_d": [], "buffers": []}
    with torch.no_grad():
        for name, p in model.named_parameters():
            report["params"] += 1
            if p.dim() <= 1:
                p.copy_(torch.rand(p.shape, generator=gen) + 0.5)
                report["one_d"].append(name)
            elif "embed_tokens" in name:
                p.copy_(torch.randn(p.shape, generator=gen) * EMBED_STD)
            elif "router.proj" in name or "centroids" in name:
                p.copy_(torch.randn(p.shape, generator=gen) * SELECTOR_STD)
            else:
                p.copy_(torch.randn(p.shape, generator=gen) * LINEAR_STD)
        for name, b in model.named_buffers():
            if name.endswith("layer_scalar"):
                b.copy_(torch.rand(b.shape, generator=gen) + 0.5)
                report["buffers"].append(name)
            elif name.endswith("token_ordering"):
                b.copy_(torch.randperm(b.numel(), generator=gen).to(b.dtype).view(b.shape))
                report["buffers"].append(name)
    return report


def ensure_tied(model, name):
    """The LM head must be the embedding table (tie_word_embeddings)."""
    def tied():
        lm = model.get_output_embeddings()
        return lm is None or lm.weight.data_ptr() == model.get_input_embeddings().weight.data_ptr()

    if not tied():
        model.tie_weights()
    if not tied():
        raise RuntimeError(f"{name}: lm_head is not tied to embed_tokens")


def disable_eos(model):
    gc = model.generation_config
    gc.eos_token_id = None
    gc.pad_token_id = 0
    gc.do_sample = False


def config_form(config_json):
    tc = config_json.get("text_config", config_json)
    return {
        "has_per_layer_config": "per_layer_config" in tc,
        "has_global_head_dim": "global_head_dim" in tc,
        "has_num_global_key_value_heads": "num_global_key_value_heads" in tc,
        "per_layer_config": tc.get("per_layer_config"),
    }


def save_and_reload(model, cls, out_dir, dtype):
    os.makedirs(out_dir, exist_ok=True)
    try:
        model.save_pretrained(out_dir, safe_serialization=True)
    except TypeError:  # newer versions always write safetensors
        model.save_pretrained(out_dir)
    for extra in ("generation_config.json",):
        p = os.path.join(out_dir, extra)
        if os.path.exists(p):
            os.remove(p)  # not part of the contract; keeps fixtures minimal
    reloaded = load_model(cls, out_dir, dtype).eval()
    # Every tensor must survive the round trip (catches non-persistent buffers).
    a = model.state_dict()
    b = reloaded.state_dict()
    for k, v in a.items():
        if k not in b:
            raise RuntimeError(f"{out_dir}: tensor {k} missing after reload")
        if not torch.equal(v.to(b[k].dtype), b[k]):
            raise RuntimeError(f"{out_dir}: tensor {k} changed after save/reload")
    with open(os.path.join(out_dir, "config.json")) as f:
        cfg = json.load(f)
    from safetensors import safe_open

    with safe_open(os.path.join(out_dir, "model.safetensors"), "pt") as f:
        names = sorted(f.keys())
    return reloaded, cfg, names


def fixture_meta(meta_common, fixture, kind, seed, model, cfg_json, names, rep, exp, **extra):
    """meta.json's dict for a randomised fp32 fixture (a target or an assistant): meta_common, then
    the fields both record (identity, config and its form, checkpoint tensor names, what randomise()
    reported, the init scales, each expected tensor's dtype and shape), then `extra`. A key of
    `extra` that repeats one of these is a TypeError. write_meta sorts the keys, so their order
    here does not reach the file."""
    meta = dict(meta_common)
    meta.update(
        fixture=fixture,
        kind=kind,
        seed=seed,
        dtype="float32",
        model_class=type(model).__name__,
        config=cfg_json,
        config_form=config_form(cfg_json),
        checkpoint_tensors=names,
        randomised_1d_parameters=rep["one_d"],
        randomised_buffers=rep["buffers"],
        init={"embed_std": EMBED_STD, "linear_std": LINEAR_STD, "router_centroid_std": SELECTOR_STD,
              "one_d_and_layer_scalar": "uniform(0.5, 1.5)"},
        expected_tensors={k: [str(v.dtype).replace("torch.", ""), list(v.shape)] for k, v in exp.items()},
        **extra,
    )
    return meta


def write_meta(out_dir, meta):
    with open(os.path.join(out_dir, "meta.json"), "w") as f:
        json.dump(meta, f, indent=1, sort_keys=True, default=str)


def save_expected(out_dir, tensors):
    from safetensors.torch import save_file

    for k, v in tensors.items():
        assert v.dtype in (torch.float32, torch.int32), (k, v.dtype)
    save_file({k: v.contiguous().clone() for k, v in tensors.items()}, os.path.join(out_dir, "expected.safetensors"),
              metadata={"format": "pt", "producer": "tools/golden/make_golden.py"})


def get_shared_kv(model, ids, device):
    """Donor K/V of one no-cache forward: {type: (K, V)} each [B, kv, T, D]."""
    out = model(input_ids=ids, attention_mask=torch.ones_like(ids), output_hidden_states=True,
                return_shared_kv_states=True, use_cache=False)
    shared = getattr(out, "shared_kv_states", None)
    via = "Gemma4ForCausalLM output"
    base = None
    if shared is None:
        base = model.model(input_ids=ids, attention_mask=torch.ones_like(ids), output_hidden_states=True,
                           return_shared_kv_states=True, use_cache=False)
        shared = base.shared_kv_states
        via = "model.model output"
    return out, shared, via, base


def greedy_margin(scores):
    """Smallest top1-top2 gap over a list of [1, V] score tensors."""
    m = float("inf")
    for s in scores:
        top = torch.topk(s.float()[0], 2).values
        m = min(m, float(top[0] - top[1]))
    return m


def logits_margin(logits):
    top = torch.topk(logits.float(), 2, dim=-1).values
    return float((top[..., 0] - top[..., 1]).min())
