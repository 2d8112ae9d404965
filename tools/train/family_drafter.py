# SPDX-License-Identifier: Apache-2.0
"""train_family.py: the assistant drafter: balanced k-means of the target's embeddings, the
engine's draft-step forward, the distillation pool and loop, and the parity check against
transformers' drafter forward.
"""

import copy
import time

import torch
import torch.nn.functional as F

from family_common import BOS, FULL, K_DRAFT, PAD, SLIDING, VOCAB, log
from family_models import lr_at, target_forward


# ----------------------------------------------------------------------------- clustering


def balanced_assign(sim, cap):
    """Greedy capacity-constrained assignment: rows propose to their best open cluster, each
    cluster keeps its strongest proposals up to its capacity, repeat. sim [N, G] -> [N]."""
    N, G = sim.shape
    assign = torch.full((N,), -1, dtype=torch.long)
    left = torch.full((G,), cap, dtype=torch.long)
    while True:
        todo = (assign < 0).nonzero().squeeze(1)
        if todo.numel() == 0:
            return assign
        s = sim[todo].clone()
        s[:, left == 0] = float("-inf")
        score, best = s.max(dim=1)
        order = torch.argsort(score, descending=True)
        b_sorted = best[order]
        grp = torch.sort(b_sorted, stable=True).indices
        clusters = b_sorted[grp]
        counts = torch.bincount(clusters, minlength=G)
        starts = torch.cumsum(counts, 0) - counts
        rank = torch.arange(clusters.numel()) - starts[clusters]
        ok = rank < left[clusters]
        rows = todo[order[grp[ok]]]
        assign[rows] = clusters[ok]
        left -= torch.bincount(clusters[ok], minlength=G)


def balanced_kmeans(x, groups, iters, seed):
    """Spherical k-means with balanced assignment; x [N, d] (N divisible by groups) -> [N]."""
    x = F.normalize(x.float().cpu(), dim=-1)
    n = x.shape[0] // groups
    g = torch.Generator().manual_seed(seed)
    c = x[torch.randperm(x.shape[0], generator=g)[:groups]].clone()
    assign = None
    for _ in range(iters):
        new = balanced_assign(x @ c.T, n)
        if assign is not None and torch.equal(new, assign):
            break
        assign = new
        c = F.normalize(torch.zeros_like(c).index_add_(0, assign, x), dim=-1)
    counts = torch.bincount(assign, minlength=groups)
    if not bool((counts == n).all()):
        raise RuntimeError(f"balanced k-means: cluster sizes {counts.tolist()}")
    cohesion = float((x * c[assign]).sum(-1).mean())
    return assign, cohesion


# ----------------------------------------------------------------------------- drafter


def donor_masks(pos, T, window):
    """Engine donor visibility for queries at positions pos [B|1, A]: full donor keys k < p,
    sliding donor the newest window + 1 of them. Bool [B|1, 1, A, T] (True = attend)."""
    k = torch.arange(T, device=pos.device)[None, None, :]
    p = pos[..., None]
    full = k < p
    sliding = full & (k >= p - (window + 1))
    return {FULL: full[:, None], SLIDING: sliding[:, None]}


def rotate_half(x):
    h = x.shape[-1] // 2
    return torch.cat((-x[..., h:], x[..., :h]), dim=-1)


def attend(q, k, v, mask):
    """Scaling 1.0 attention; q [B,Nh,A,D], k/v [B,Nh,T,D], mask bool broadcastable to [B,Nh,A,T]."""
    if hasattr(F, "scaled_dot_product_attention"):
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=1.0)
    s = (q @ k.transpose(-1, -2)).float().masked_fill(~mask, float("-inf"))
    return torch.softmax(s, dim=-1).to(q.dtype) @ v


def draft_forward(dr, x_in, pos, kv, masks):
    """One draft step for every (row, anchor) at once, with transformers' modules' parameters.

    x_in [B, A, 2*Hb] = [E_target(token) ; hidden]; pos [B, A] query positions; kv {type: (K, V)
    [B, kv, T, D]} the target's donor K/V; masks from donor_masks. Returns (h_a [B, A, H_a] the
    normed drafter state, next_hidden [B, A, Hb] = post_projection(h_a))."""
    m = dr.model
    tc = dr.config.get_text_config()
    h = dr.pre_projection(x_in)
    B, A = h.shape[:2]
    rope = {t: m.rotary_emb(h, pos, t) for t in set(tc.layer_types)}
    for i, layer in enumerate(m.layers):
        t = tc.layer_types[i]
        attn = layer.self_attn
        D = attn.head_dim
        r = h
        x = layer.input_layernorm(h)
        q = attn.q_proj(x).view(B, A, -1, D)
        q = attn.q_norm(q)
        cos, sin = rope[t]
        q = q * cos[:, :, None, :] + rotate_half(q) * sin[:, :, None, :]
        q = q.transpose(1, 2)
        K, V = kv[t]
        nh, nkv = q.shape[1], K.shape[1]
        if nkv != nh:
            K = K[:, :, None].expand(K.shape[0], nkv, nh // nkv, *K.shape[2:]).reshape(K.shape[0], nh, *K.shape[2:])
            V = V[:, :, None].expand(V.shape[0], nkv, nh // nkv, *V.shape[2:]).reshape(V.shape[0], nh, *V.shape[2:])
        o = attend(q, K.to(q.dtype), V.to(q.dtype), masks[t])
        o = attn.o_proj(o.transpose(1, 2).reshape(B, A, -1))
        h = r + layer.post_attention_layernorm(o)
        r = h
        h = r + layer.post_feedforward_layernorm(layer.mlp(layer.pre_feedforward_layernorm(h)))
        h = h * layer.layer_scalar.to(h.dtype)
    ha = m.norm(h)
    return ha, dr.post_projection(ha)


def centroid_argmax(dr, ha):
    """The drafter's token as inference picks it with the centroid head: top-k centroids, score
    their tokens, everything else min - 1, argmax with the lowest id on ties. ha [N, H_a] -> [N]."""
    me = dr.masked_embedding
    G, k = me.num_centroids, me.centroid_intermediate_top_k
    V = dr.lm_head.weight.shape[0]
    n = V // G
    top = torch.topk(me.centroids(ha), k, dim=-1).indices
    cand = me.token_ordering.long().view(G, n)[top].reshape(ha.shape[0], k * n)
    scores = torch.einsum("nh,nch->nc", ha, dr.lm_head.weight[cand].to(ha.dtype))
    full = torch.full((ha.shape[0], V), float("-inf"), dtype=scores.dtype, device=ha.device)
    return full.scatter_(1, cand, scores).argmax(-1)


def init_drafter(drafter, target, order, assign):
    """token_ordering from the balanced clusters; embed table = the target's embeddings projected
    on their top principal directions; centroids = cluster means of that table."""
    with torch.no_grad():
        me = drafter.masked_embedding
        me.token_ordering.copy_(order.to(me.token_ordering.device))
        e_t = target.model.embed_tokens.weight.float()
        hd = drafter.model.embed_tokens.weight.shape[1]
        _, _, vh = torch.linalg.svd(e_t, full_matrices=False)
        e_d = e_t @ vh[:hd].T
        drafter.model.embed_tokens.weight.copy_(e_d)
        G = me.num_centroids
        cent = torch.zeros(G, hd, device=e_d.device).index_add_(0, assign.to(e_d.device), e_d) / (VOCAB // G)
        me.centroids.weight.copy_(cent)


@torch.no_grad()
def generate_pool(gen_model, stream, budget, args, device, log_prefix="pool"):
    """Greedy continuations of random training prompts ([bos] + L0-1 stream tokens) by the
    target (bf16 autocast over the fp32 copy of the bf16 weights): the sequences the drafter is
    trained on (every token after the prompt is the target's greedy choice, exactly what greedy
    speculative decoding commits)."""
    gc = gen_model.generation_config
    gc.eos_token_id = None
    gc.pad_token_id = PAD
    gc.do_sample = False
    g = torch.Generator(device=device).manual_seed(args.seed + 7)
    pool = []
    t_start = time.time()
    per_call = None
    i = 0
    while True:
        el = time.time() - t_start
        if pool and (el + (per_call or 0) > budget or i >= args.pool_max_batches):
            break
        L0 = args.prompt_lens[i % len(args.prompt_lens)]
        starts = torch.randint(0, stream.numel() - L0, (args.gen_batch,), device=device, generator=g)
        body = stream[starts[:, None] + torch.arange(L0 - 1, device=device)]
        prompts = torch.cat([torch.full((args.gen_batch, 1), BOS, dtype=torch.long, device=device), body], 1)
        t1 = time.time()
        with torch.autocast(device.type, dtype=torch.bfloat16):
            out = gen_model.generate(input_ids=prompts, attention_mask=torch.ones_like(prompts),
                                     max_new_tokens=args.gen_new, do_sample=False, eos_token_id=None,
                                     pad_token_id=PAD)
        if out.shape != (args.gen_batch, L0 + args.gen_new):
            raise RuntimeError(f"generate returned {tuple(out.shape)}, expected {(args.gen_batch, L0 + args.gen_new)}")
        per_call = time.time() - t1
        pool.append((L0, out))
        i += 1
        log(f"{log_prefix}: batch {i} L0 {L0} in {per_call:.1f}s")
    n_seq = sum(p[1].shape[0] for p in pool)
    return pool, dict(batches=len(pool), sequences=n_seq, new_tokens_per_sequence=args.gen_new,
                      prompt_lens=args.prompt_lens, seconds=round(time.time() - t_start, 1))


def train_drafter(drafter, target, pool, cluster_of, budget, args, device):
    drafter.train()
    params = list(drafter.parameters())
    opt = torch.optim.AdamW(params, lr=args.drafter_lr, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.01,
                            fused=device.type == "cuda")
    gen = torch.Generator(device=device).manual_seed(args.seed + 11)
    cpu_gen = torch.Generator().manual_seed(args.seed + 12)
    weights = [args.step_decay ** j for j in range(K_DRAFT)]
    window = drafter.config.get_text_config().sliding_window
    E_t = target.model.embed_tokens
    G = drafter.masked_embedding.num_centroids
    t_start = time.time()
    it = 0
    history = []
    loss_acc = torch.zeros((), device=device)
    acc_n = 0
    next_log = t_start + args.drafter_log_every
    while True:
        el = time.time() - t_start
        if el >= budget:
            break
        do_log = time.time() >= next_log
        lr = lr_at(it, el / budget, args.drafter_lr, args.drafter_warmup)
        for g in opt.param_groups:
            g["lr"] = lr
        L0, seqs = pool[int(torch.randint(0, len(pool), (1,), generator=cpu_gen))]
        rows = torch.randint(0, seqs.shape[0], (args.drafter_batch,), device=device, generator=gen)
        seq = seqs[rows]
        T = seq.shape[1]
        with torch.no_grad(), torch.autocast(device.type, dtype=torch.bfloat16):
            h_t, kv, logits_t = target_forward(target, seq)
            logp_t = torch.log_softmax(logits_t[:, L0:].float(), -1)  # positions L0 .. T-1
            greedy = logp_t.argmax(-1)
            del logits_t
        anchors = torch.arange(L0, T - (K_DRAFT - 1), device=device)
        A = anchors.numel()
        masks = donor_masks(anchors[None], T, window)
        pos = anchors[None].expand(seq.shape[0], A)
        hid = h_t[:, anchors - 1]
        total = 0.0
        stats = {"kl": [], "closs": [], "top1": [], "centroid_top1": []}
        for j in range(K_DRAFT):
            lab = greedy[:, anchors + j - L0]
            with torch.autocast(device.type, dtype=torch.bfloat16):
                emb = E_t(seq[:, anchors + j]).to(torch.bfloat16)
                x_in = torch.cat([emb, hid.to(torch.bfloat16)], -1)
                ha, nh = draft_forward(drafter, x_in, pos, kv, masks)
                logits_d = drafter.lm_head(ha)
                cl = drafter.masked_embedding.centroids(ha)
            logq = torch.log_softmax(logits_d.float(), -1)
            lp = logp_t[:, anchors + j - L0]
            kl = (lp.exp() * (lp - logq)).sum(-1).mean()
            closs = F.cross_entropy(cl.float().reshape(-1, G), cluster_of[lab].reshape(-1))
            total = total + weights[j] * (kl + args.centroid_weight * closs)
            hid = nh
            if do_log:
                with torch.no_grad():
                    stats["kl"].append(round(float(kl), 4))
                    stats["closs"].append(round(float(closs), 4))
                    stats["top1"].append(round(float((logits_d.argmax(-1) == lab).float().mean()), 4))
                    sub = ha.reshape(-1, ha.shape[-1])[:512].float()
                    stats["centroid_top1"].append(round(float(
                        (centroid_argmax(drafter, sub) == lab.reshape(-1)[:512]).float().mean()), 4))
        opt.zero_grad(set_to_none=True)
        total.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        it += 1
        loss_acc += total.detach()
        acc_n += 1
        if do_log:
            el = time.time() - t_start
            mean_loss = float(loss_acc) / acc_n
            loss_acc.zero_()
            acc_n = 0
            history.append(dict(it=it, seconds=round(el, 1), lr=lr, loss=round(mean_loss, 4),
                                anchors_per_batch=int(seq.shape[0] * A), **stats))
            log(f"drafter it {it} ({el:.0f}s) lr {lr:.2e} loss {mean_loss:.4f} kl {stats['kl']} "
                f"top1 {stats['top1']} centroid_top1 {stats['centroid_top1']}")
            next_log = time.time() + args.drafter_log_every
    drafter.eval()
    seconds = time.time() - t_start
    return dict(iterations=it, seconds=round(seconds, 1), history=history, peak_lr=args.drafter_lr,
                warmup=args.drafter_warmup, batch_sequences=args.drafter_batch, unroll=K_DRAFT,
                step_weights=weights, centroid_weight=args.centroid_weight,
                loss="sum_j w_j * (KL(p_target || softmax(dense drafter logits)) + c * CE(centroid scores, "
                     "cluster of the target argmax))",
                teacher_forcing="token inputs = the target's greedy continuation (the pool sequences)")


@torch.no_grad()
def check_drafter_parity(target, drafter, seq, anchors, steps, device):
    """Vectorised draft_forward (all anchors at once) vs transformers' Gemma4AssistantForCausalLM
    forward, one anchor at a time, fed donors cropped to [0, p), position p, a 2-D mask of ones.
    Returns the largest relative differences of logits and next_hidden, and token agreement."""
    ids = seq[None].to(device)
    T = ids.shape[1]
    h, kv, _ = target_forward(target, ids)
    E = target.model.embed_tokens
    window = drafter.config.get_text_config().sliding_window
    p = torch.tensor(anchors, device=device)
    masks = donor_masks(p[None], T, window)
    hid = h[:, p - 1]
    mine = []
    for j in range(steps):
        x_in = torch.cat([E(ids[:, p + j]), hid], -1)
        ha, nh = draft_forward(drafter, x_in, p[None], kv, masks)
        mine.append((ha[0], nh[0]))
        hid = nh
    d_logits = d_hidden = 0.0
    tokens_equal = True
    for a, pa in enumerate(anchors):
        shared = {t: (k[:, :, :pa], v[:, :, :pa]) for t, (k, v) in kv.items()}
        hid = h[:, pa - 1:pa]
        for j in range(steps):
            x_in = torch.cat([E(ids[:, pa + j:pa + j + 1]), hid], -1)
            out = drafter(inputs_embeds=x_in, position_ids=torch.tensor([[pa]], device=device),
                          attention_mask=torch.ones(1, pa, dtype=torch.long, device=device), shared_kv_states=shared)
            ref_l, ref_h = out.logits[0, 0].float(), out.last_hidden_state[0, 0].float()
            ha_m, nh_m = mine[j][0][a], mine[j][1][a]
            my_l = drafter.masked_embedding(ha_m[None, None], drafter.lm_head.weight)[0, 0].float()
            d_logits = max(d_logits, float((my_l - ref_l).abs().max()) / max(1.0, float(ref_l.abs().max())))
            d_hidden = max(d_hidden, float((nh_m - ref_h).abs().max()) / max(1.0, float(ref_h.abs().max())))
            tokens_equal &= int(centroid_argmax(drafter, ha_m[None])[0]) == int(ref_l.argmax())
            hid = out.last_hidden_state
    return dict(anchors=list(anchors), steps=steps, max_rel_diff_logits=d_logits, max_rel_diff_next_hidden=d_hidden,
                tokens_equal=tokens_equal, within_1e5=max(d_logits, d_hidden) <= 1e-5)


def randomised_copy(drafter, seed):
    """A copy whose constant-initialised parameters are random (so a w / 1+w or layer_scalar
    mix-up in draft_forward cannot hide), for the pre-training parity check."""
    d = copy.deepcopy(drafter).float().eval()
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for n, prm in d.named_parameters():
            if prm.dim() == 1:
                prm.copy_((torch.rand(prm.shape, generator=g) + 0.5).to(prm.device))
        for n, b in d.named_buffers():
            if n.endswith("layer_scalar"):
                b.copy_((torch.rand(b.shape, generator=g) + 0.5).to(b.device))
    return d
