# SPDX-License-Identifier: Apache-2.0
"""Batched PyTorch forward of the specula-layout DSpark drafter, for training (docs/dspark.md
"specula layout forward" and "Heads").

The math is tools/golden/make_dspark_golden.py's per-anchor reference (specula_context_kv,
specula_block, greedy_heads), from which the C++ golden fixtures come, written for a batch of
sequences with several anchors each: a sequence's context rows are projected once and every
anchor attends to the rows before it through a key mask (context of anchor t = positions < t).
`train_dspark.py --check-reference` runs this module on the golden checkpoint and compares it with
tests/golden/dspark/expected.safetensors and with the reference functions themselves.

Parameters are a dict name -> tensor with the exact checkpoint names and [out, in] shapes.
"""

import math

import torch
import torch.nn.functional as F


def rms(x, w, eps):
    """docs rms(x; w), computed in f32 (same formula and op order as the golden reference)."""
    x = x.float()
    y = x * torch.pow(x.pow(2).mean(-1, keepdim=True) + eps, -0.5)
    return y if w is None else y * w.float()


def softcap(x, cap):
    return x if cap is None else torch.tanh(x / cap) * cap


def param_shapes(cfg, H, V, m):
    """name -> shape, in docs/dspark.md's order. cfg: the dspark.json "config" fields."""
    d, L, r, g = cfg["hidden_size"], cfg["num_layers"], cfg["markov_rank"], cfg["block_size"]
    Fd = cfg["ffn_mult"] * d
    s = {}
    for i in range(L):
        p = f"layers.{i}."
        s[p + "attn_norm"] = [d]
        for k in ("q_proj", "k_proj", "v_proj", "o_proj"):
            s[p + k] = [d, d]
        s[p + "ffn_norm"] = [d]
        s[p + "gate_proj"] = [Fd, d]
        s[p + "up_proj"] = [Fd, d]
        s[p + "down_proj"] = [d, Fd]
    s["context_proj"] = [d, m * H]
    s["context_norm"] = [d]
    s["token_proj"] = [d, H]
    if g > 1:
        s["mask_embed"] = [g - 1, d]
    s["block_pos"] = [g, d]
    s["out_norm"] = [d]
    s["out_proj"] = [H, d]
    if r > 0:
        s["markov.w1"] = [V, r]
        s["markov.w2"] = [V, r]
    s["confidence.weight"] = [1, d + r]
    s["confidence.bias"] = [1]
    return s


def init_params(cfg, H, V, m, E_std, gen):
    """Training init, f32 on the CPU. Norm weights 1; linears N(0, 1/in) (residual outputs o_proj and
    down_proj further scaled by 1/sqrt(2 L)); token_proj N(0, 1/(E_std² H)) so the anchor row is
    ~unit; mask_embed, block_pos, markov.w1 N(0, 0.02²). markov.w2 and the confidence head are zero
    (seed §4.4: the Markov bias starts at 0, so the drafter starts as the base logits U; the
    confidence starts at σ(0) = 0.5)."""
    L = cfg["num_layers"]
    P = {}
    for name, shape in param_shapes(cfg, H, V, m).items():
        leaf = name.split(".")[-1]
        if leaf in ("attn_norm", "ffn_norm") or name in ("context_norm", "out_norm"):
            t = torch.ones(shape)
        elif name in ("markov.w2", "confidence.weight", "confidence.bias"):
            t = torch.zeros(shape)
        elif name in ("mask_embed", "block_pos", "markov.w1"):
            t = torch.randn(shape, generator=gen) * 0.02
        elif name == "token_proj":
            t = torch.randn(shape, generator=gen) / (E_std * math.sqrt(H))
        else:
            t = torch.randn(shape, generator=gen) * shape[1] ** -0.5
            if leaf in ("o_proj", "down_proj"):
                t = t / math.sqrt(2 * L)
        P[name] = t
    return P


def context_kv(P, cfg, ctx_taps, eps):
    """ctx_taps [S, C, m·H] -> per layer (K, V) [S, C, d]: ctx = rms(taps·W_cᵀ; context_norm), then
    nc = rms(ctx; attn_norm_i), K = nc·Wkᵀ, V = nc·Wvᵀ (independent of the block: no RoPE)."""
    ctx = rms(ctx_taps.float() @ P["context_proj"].T, P["context_norm"], eps)
    out = []
    for i in range(cfg["num_layers"]):
        nc = rms(ctx, P[f"layers.{i}.attn_norm"], eps)
        out.append((nc @ P[f"layers.{i}.k_proj"].T, nc @ P[f"layers.{i}.v_proj"].T))
    return out


def block_hidden(P, cfg, kv, key_mask, anchor_emb, eps):
    """The backbone for A anchors of each of S sequences.
    kv: context_kv of the S sequences' context rows [S, C, d]; key_mask bool [S, A, C]: context row c
    is visible to anchor a (the engine's context: positions < t); anchor_emb [S, A, H]: E_raw[anchor]
    (the target's unscaled embedding row). Returns h = rms(X; out_norm) [S, A, γ, d]."""
    g, d, nh = cfg["block_size"], cfg["hidden_size"], cfg["num_heads"]
    hd = d // nh
    S, A = anchor_emb.shape[:2]
    x0 = anchor_emb.float() @ P["token_proj"].T + P["block_pos"][0]
    rest = (P["mask_embed"] + P["block_pos"][1:]) if g > 1 else P["block_pos"][:0]
    X = torch.cat([x0[:, :, None], rest.expand(S, A, g - 1, d)], dim=2)
    # Rows with no visible context attend to the block only (not the engine's case: t >= 1).
    neg = torch.finfo(torch.float32).min
    for i, (Kc, Vc) in enumerate(kv):
        w = lambda n: P[f"layers.{i}.{n}"]  # noqa: E731
        C = Kc.shape[1]
        nd = rms(X, w("attn_norm"), eps)
        Q = (nd @ w("q_proj").T).view(S, A, g, nh, hd)
        Kb = (nd @ w("k_proj").T).view(S, A, g, nh, hd)
        Vb = (nd @ w("v_proj").T).view(S, A, g, nh, hd)
        Kc4, Vc4 = Kc.view(S, C, nh, hd), Vc.view(S, C, nh, hd)
        sc = torch.einsum("saqhd,skhd->sahqk", Q, Kc4).float() * hd ** -0.5  # [S, A, nh, g, C]
        sb = torch.einsum("saqhd,sakhd->sahqk", Q, Kb).float() * hd ** -0.5  # [S, A, nh, g, g]
        sc = sc.masked_fill(~key_mask[:, :, None, None, :], neg)
        att = torch.softmax(torch.cat([sc, sb], dim=-1), dim=-1)  # context rows first, no mask in block
        o = torch.einsum("sahqk,skhd->saqhd", att[..., :C].to(Vc4.dtype), Vc4) + \
            torch.einsum("sahqk,sakhd->saqhd", att[..., C:].to(Vb.dtype), Vb)
        X = X + o.reshape(S, A, g, d) @ w("o_proj").T
        n2 = rms(X, w("ffn_norm"), eps)
        X = X + (F.gelu(n2 @ w("gate_proj").T, approximate="tanh") * (n2 @ w("up_proj").T)) @ w("down_proj").T
    return rms(X, P["out_norm"], eps)


def base_logits(P, h, E, cap):
    """U = softcap(out_proj(h) · Eᵀ) [.., V] in f32 (the target's tied head and soft-cap)."""
    y = h @ P["out_proj"].T
    return softcap((y.to(E.dtype) @ E.T).float(), cap)


def heads(P, U, h, prev):
    """Teacher-forced heads: prev [.., γ] = the token each position extends (the anchor, then the
    previous block token). Returns draft logits U + W1[prev]·W2ᵀ [.., γ, V] and confidence logits
    w·[h; W1[prev]] + b [.., γ] (before the sigmoid)."""
    if "markov.w1" in P:
        e = P["markov.w1"][prev]
        logits = U + (e @ P["markov.w2"].T).float()
        feat = torch.cat([h.float(), e.float()], dim=-1)
    else:
        logits, feat = U, h.float()
    conf = feat @ P["confidence.weight"][0].float() + P["confidence.bias"][0].float()
    return logits, conf


def loss_terms(D, conf_logit, T, labels, gamma):
    """Seed §4.5 (paper Eq 8-12). D draft logits, T frozen target logits [B, γ, V] f32; conf_logit
    [B, γ]; labels [B, γ]. Position weights w_k = exp(-(k-1)/γ), k = 1..γ. Returns a dict of the loss
    and its terms, plus ℓ1 [B, γ] for the analytic acceptance."""
    w = torch.exp(-torch.arange(gamma, device=D.device, dtype=torch.float32) / gamma)
    logp_d = torch.log_softmax(D, dim=-1)
    p_d = logp_d.exp()
    with torch.no_grad():
        p_t = torch.softmax(T, dim=-1)
    ce = -logp_d.gather(-1, labels[..., None].long())[..., 0]  # [B, γ]
    l1 = (p_d - p_t).abs().sum(-1)  # [B, γ], the full L1 (2 TV)
    target_c = (1 - 0.5 * l1).detach().clamp(0, 1)  # c*_k = Σ min(p_d, p_t), stop-gradient
    # BCE on the logit: the seed's BCE(clip(σ(x), 1e-6, 1-1e-6), c*) without its clip's flat spots.
    bce = F.binary_cross_entropy_with_logits(conf_logit.float(), target_c, reduction="none")
    L_ce = (ce * w).sum(-1).mean()
    L_tv = (l1 * w).sum(-1).mean()
    L_conf = (bce * w).sum(-1).mean()
    loss = 0.1 * L_ce + 0.9 * L_tv + 1.0 * L_conf
    return {"loss": loss, "ce": L_ce, "tv": L_tv, "conf": L_conf, "l1": l1.detach()}


def analytic_acceptance(l1):
    """Seed §4.5 monitor: a_k = 1 - ½ℓ1_k; τ = 1 + Σ_j Π_{i<=j} a_i per anchor. l1 [B, γ]."""
    a = (1 - 0.5 * l1).clamp(0, 1)
    tau = 1 + torch.cumprod(a, dim=-1).sum(-1)
    return a, tau
