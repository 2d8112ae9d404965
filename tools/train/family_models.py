# SPDX-License-Identifier: Apache-2.0
"""train_family.py: Hugging Face model helpers (build, load, save, reload checks, the softcapped
target forward) and the target's training loop.
"""

import math
import os
import time

import torch
import torch.nn.functional as F

from family_common import CTX, MAX_FILE_BYTES, PAD, SOFTCAP, log


# ----------------------------------------------------------------------------- HF models


def build_model(cls, config, dtype):
    last = None
    for kw in (dict(attn_implementation="sdpa", dtype=dtype), dict(attn_implementation="sdpa", torch_dtype=dtype)):
        try:
            return cls._from_config(config, **kw)
        except (TypeError, ValueError) as e:
            last = e
    raise last


def load_model(cls, path, dtype, device):
    last = None
    for kw in (dict(attn_implementation="sdpa", dtype=dtype), dict(attn_implementation="sdpa", torch_dtype=dtype)):
        try:
            m = cls.from_pretrained(path, **kw)
            return m.to(device).eval().requires_grad_(False)
        except (TypeError, ValueError) as e:
            last = e
    raise last


def ensure_tied(model, name):
    def tied():
        return model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()

    if not tied():
        model.tie_weights()
    if not tied():
        raise RuntimeError(f"{name}: lm_head is not tied to model.embed_tokens")


def softcap(x, c=SOFTCAP):
    return torch.tanh(x / c) * c  # transformers' order: divide, tanh, multiply


def target_forward(target, ids):
    """Post-norm hidden [B,T,H], donor K/V {type: (K, V) [B,kv,T,D]} and soft-capped logits
    [B,T,V] (transformers' Gemma4ForCausalLM math) of one no-cache forward."""
    base = target.model(input_ids=ids, use_cache=False, return_shared_kv_states=True)
    h = base.last_hidden_state
    kv = {t: (k, v) for t, (k, v) in base.shared_kv_states.items()}
    logits = softcap(target.lm_head(h).float())
    return h, kv, logits


def target_forward_padded(target, seqs, device):
    """target_forward over right-padded rows (pads sit after every real token: causal masks keep
    real positions exact)."""
    T = max(len(s) for s in seqs)
    ids = torch.full((len(seqs), T), PAD, dtype=torch.long, device=device)
    for i, s in enumerate(seqs):
        ids[i, :len(s)] = torch.tensor(s, dtype=torch.long, device=device)
    return target_forward(target, ids)


def save_model(model, dst, name):
    """Saves in bf16 (sharded at 12 MB); returns the list of written files with sizes."""
    os.makedirs(dst, exist_ok=True)
    model = model.to(torch.bfloat16)
    try:
        model.save_pretrained(dst, safe_serialization=True, max_shard_size="12MB")
    except TypeError:
        model.save_pretrained(dst, max_shard_size="12MB")
    files = {f: os.path.getsize(os.path.join(dst, f)) for f in sorted(os.listdir(dst))}
    big = {f: s for f, s in files.items() if s > MAX_FILE_BYTES}
    if big:
        raise RuntimeError(f"{name}: files over 16 MB: {big}")
    return model, files


def check_reload(saved16, reloaded, name):
    a = saved16.state_dict()
    b = reloaded.state_dict()
    for k, v in a.items():
        if k not in b:
            raise RuntimeError(f"{name}: tensor {k} missing after reload")
        if not torch.equal(v.to(b[k].device).to(b[k].dtype), b[k]):
            raise RuntimeError(f"{name}: tensor {k} changed after save/reload")


# ----------------------------------------------------------------------------- target training


def add_dropout_hooks(model, p):
    """Residual-branch dropout (training only) on the outputs of the post-attention, post-MLP
    and post-PLE norms; hooks are not part of the saved model."""
    handles = []
    if p <= 0:
        return handles

    def hook(mod, inputs, output):
        return F.dropout(output, p, mod.training)

    for layer in model.model.layers:
        for n in ("post_attention_layernorm", "post_feedforward_layernorm", "post_per_layer_input_norm"):
            m = getattr(layer, n, None)
            if m is not None:
                handles.append(m.register_forward_hook(hook))
    return handles


def lm_loss(model, x, reduction="mean"):
    h = model.model(input_ids=x[:, :-1], use_cache=False).last_hidden_state
    logits = softcap(model.lm_head(h).float())
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), x[:, 1:].reshape(-1), reduction=reduction)


@torch.no_grad()
def eval_ce(model, windows, batch, autocast):
    was_training = model.training
    model.eval()
    total, count = 0.0, 0
    for i in range(0, windows.shape[0], batch):
        x = windows[i:i + batch]
        with torch.autocast(windows.device.type, dtype=torch.bfloat16, enabled=autocast):
            total += float(lm_loss(model, x, reduction="sum"))
        count += x[:, 1:].numel()
    model.train(was_training)
    return total / max(count, 1)


def lr_at(step, progress, peak, warmup, min_ratio=0.1):
    cos = min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * min(progress, 1.0)))
    return peak * min(1.0, (step + 1) / warmup) * cos


def train_target(model, train_stream, val_windows, budget, args, device):
    model.train()
    hooks = add_dropout_hooks(model, args.dropout)
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": args.weight_decay},
                             {"params": no_decay, "weight_decay": 0.0}], lr=args.lr, betas=(0.9, 0.95), eps=1e-8,
                            fused=device.type == "cuda")
    gen = torch.Generator(device=device).manual_seed(args.seed)
    ar = torch.arange(CTX + 1, device=device)
    n = train_stream.numel()
    t_start = time.time()
    next_val = t_start + args.val_every
    step = 0
    best = (float("inf"), None, 0)
    history = []
    loss_acc = torch.zeros((), device=device)
    acc_n = 0
    tokens = 0
    while True:
        el = time.time() - t_start
        if el >= budget:
            break
        lr = lr_at(step, el / budget, args.lr, args.warmup)
        for g in opt.param_groups:
            g["lr"] = lr
        starts = torch.randint(0, n - CTX - 1, (args.batch,), device=device, generator=gen)
        x = train_stream[starts[:, None] + ar]
        with torch.autocast(device.type, dtype=torch.bfloat16):
            loss = lm_loss(model, x)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        step += 1
        tokens += x[:, 1:].numel()
        loss_acc += loss.detach()
        acc_n += 1
        now = time.time()
        if now >= next_val or now - t_start >= budget:
            train_loss = float(loss_acc) / acc_n
            loss_acc.zero_()
            acc_n = 0
            val = eval_ce(model, val_windows, 32, True)
            el = time.time() - t_start
            history.append(dict(step=step, seconds=round(el, 1), lr=lr, train_loss=round(train_loss, 4),
                                val_loss=round(val, 4), tokens=tokens))
            log(f"target step {step} ({el:.0f}s, {tokens / max(el, 1e-9):.0f} tok/s) lr {lr:.2e} "
                f"train {train_loss:.4f} val {val:.4f}")
            if val < best[0]:
                best = (val, {k: v.detach().clone() for k, v in model.state_dict().items()}, step)
            next_val = time.time() + args.val_every
    for h in hooks:
        h.remove()
    if best[1] is not None:
        model.load_state_dict(best[1])
    model.eval()
    seconds = time.time() - t_start
    return dict(steps=step, seconds=round(seconds, 1), tokens=tokens, tokens_per_second=round(tokens / seconds),
                epochs=round(tokens / n, 2), best_val_loss=best[0], best_step=best[2], history=history,
                optimizer="AdamW(fused) betas (0.9, 0.95) eps 1e-8", peak_lr=args.lr, warmup_steps=args.warmup,
                schedule="linear warmup, cosine to 0.1 x peak over the wall-time budget",
                weight_decay=args.weight_decay, dropout=args.dropout, batch=args.batch, context=CTX,
                grad_clip=1.0, autocast="bfloat16", early_stopping="best valid.txt loss (checked every "
                f"{args.val_every}s)")
