# SPDX-License-Identifier: Apache-2.0
"""train_family.py: greedy and speculative decoding simulations (the engine's semantics) and
their statistics; held-out evaluation prompts.
"""

import torch

from family_common import BOS
from family_models import target_forward_padded
from family_drafter import centroid_argmax, donor_masks, draft_forward


# ----------------------------------------------------------------------------- speculative decoding


@torch.no_grad()
def greedy_decode(target, prompts, max_new, device):
    """Plain greedy decoding with a full no-cache forward per token (rows of equal length)."""
    seqs = [list(p) for p in prompts]
    for _ in range(max_new):
        _, _, logits = target_forward_padded(target, seqs, device)
        for i, s in enumerate(seqs):
            s.append(int(logits[i, len(s) - 1].argmax()))
    return [s[len(p):] for s, p in zip(seqs, prompts)]


@torch.no_grad()
def spec_decode(target, drafter, prompts, max_new, k_draft, device, head="centroid"):
    """Greedy speculative decoding with the engine's loop (engine/speculative/decoder.cpp): the prefill
    emits the first token; each round drafts k = min(k_draft, remaining - 1) tokens at the pending
    token's position, verifies [pending, drafts] in one target forward, accepts the longest prefix
    equal to the target argmax plus one target token. Returns per-row generated tokens and
    per-round (k, accepted)."""
    B = len(prompts)
    window = drafter.config.get_text_config().sliding_window
    E = target.model.embed_tokens
    seqs = [list(p) for p in prompts]
    gen = [[] for _ in range(B)]
    rounds = [[] for _ in range(B)]
    h, kv, logits = target_forward_padded(target, seqs, device)
    for i in range(B):
        t = int(logits[i, len(seqs[i]) - 1].argmax())
        seqs[i].append(t)
        gen[i].append(t)
    while True:
        active = [i for i in range(B) if len(gen[i]) < max_new]
        if not active:
            break
        ks = {i: max(0, min(k_draft, max_new - len(gen[i]) - 1)) for i in active}
        drafts = {i: [] for i in active}
        rows = [i for i in active if ks[i] > 0]
        if rows:
            T = h.shape[1]
            ridx = torch.tensor(rows, device=device)
            p = torch.tensor([len(seqs[i]) - 1 for i in rows], device=device)
            hid = h[ridx, p - 1][:, None]
            kv_rows = {t: (k[ridx], v[ridx]) for t, (k, v) in kv.items()}
            masks = donor_masks(p[:, None], T, window)
            tok = torch.tensor([seqs[i][-1] for i in rows], device=device)
            for s in range(max(ks[i] for i in rows)):
                x_in = torch.cat([E(tok)[:, None], hid], -1)
                ha, nh = draft_forward(drafter, x_in, p[:, None], kv_rows, masks)
                if head == "centroid":
                    d = centroid_argmax(drafter, ha[:, 0])
                else:
                    d = drafter.lm_head(ha[:, 0]).argmax(-1)
                for r, i in enumerate(rows):
                    if s < ks[i]:
                        drafts[i].append(int(d[r]))
                tok = d
                hid = nh
        cand = [seqs[i] + drafts.get(i, []) for i in range(B)]
        h, kv, logits = target_forward_padded(target, cand, device)
        for i in active:
            p = len(seqs[i]) - 1
            tgt = logits[i, p:p + ks[i] + 1].argmax(-1).tolist()
            n = 0
            while n < ks[i] and drafts[i][n] == tgt[n]:
                n += 1
            new = drafts[i][:n] + [tgt[n]]
            seqs[i].extend(new)
            gen[i].extend(new)
            rounds[i].append((ks[i], n))
    return gen, rounds


def spec_stats(rounds, k_draft):
    r = sum(len(x) for x in rounds)
    drafted = sum(k for x in rounds for k, _ in x)
    accepted = sum(n for x in rounds for _, n in x)
    drafted_at = [sum(1 for x in rounds for k, _ in x if k > j) for j in range(k_draft)]
    accepted_at = [sum(1 for x in rounds for _, n in x if n > j) for j in range(k_draft)]
    full_k = [(k, n) for x in rounds for k, n in x if k == k_draft]
    return dict(rounds=r, drafted=drafted, accepted=accepted,
                acceptance_rate=accepted / max(drafted, 1), tau=(accepted + r) / max(r, 1),
                tau_full_k_rounds=(sum(n for _, n in full_k) + len(full_k)) / max(len(full_k), 1),
                drafted_at=drafted_at, accepted_at=accepted_at,
                acceptance_at=[a / max(d, 1) for a, d in zip(accepted_at, drafted_at)],
                conditional_acceptance_at=[accepted_at[j] / max(accepted_at[j - 1] if j else drafted_at[0], 1)
                                           for j in range(k_draft)])


def eval_prompts(held_docs, n, length):
    """Up to n prompts of `length` tokens: [bos] + held-out file tokens, first from the start of
    every file, then from offsets 512, 1024, ... (round robin over files)."""
    prompts, sources = [], []
    off = 0
    while len(prompts) < n:
        added = False
        for fi, d in enumerate(held_docs):
            if len(prompts) >= n:
                break
            if off + length <= len(d) - 1:
                body = d[off:off + length] if off == 0 else [BOS] + d[off + 1:off + length]
                prompts.append(body)
                sources.append((fi, off))
                added = True
        if not added:
            break
        off += 512
    return prompts, sources


# ----------------------------------------------------------------------------- loops


def repeats_a_line(text, times=3):
    """True when some line (trailing whitespace ignored) occurs `times` times in a row: the
    degenerate loop ("mainname = mainname" ...) that issue #32 counts."""
    lines = [ln.rstrip() for ln in text.split("\n")]
    run = 1
    for a, b in zip(lines, lines[1:]):
        run = run + 1 if a == b else 1
        if run >= times:
            return True
    return False


def periodic_mask(gen, max_period=16, min_run=6):
    """1 for each token of `gen` that extends a token-level loop: for some period p <= max_period,
    the last r tokens each equal the token p before them, with r >= max(2p, min_run) (three
    copies of the repeating unit, at least min_run + p tokens in all): "token_token_token_",
    "filepath : filepath : filepath :", a row of one token. Catches the loops that stay inside
    one line, which the line rule cannot see."""
    mask = [0] * len(gen)
    runs = [0] * (max_period + 1)
    for t in range(len(gen)):
        for p in range(1, max_period + 1):
            runs[p] = runs[p] + 1 if t >= p and gen[t] == gen[t - p] else 0
            if runs[p] >= max(2 * p, min_run):
                mask[t] = 1
    return mask


def loop_check(target, tok, prompts, max_new, device, eos):
    """Greedy continuations of `prompts` (token lists) and how many contain no line repeated
    three times in a row (the text after the prompt, cut at the first <eos>)."""
    gens = greedy_decode(target, prompts, max_new, device)
    texts = []
    for g in gens:
        if eos in g:
            g = g[:g.index(eos)]
        texts.append(tok.decode(g, skip_special_tokens=False))
    clean = [not repeats_a_line(t) for t in texts]
    # Loops inside a line (which the line rule cannot see), counted beside it.
    no_token_loop = [not any(periodic_mask(g[:g.index(eos)] if eos in g else g)) for g in gens]
    both = [a and b for a, b in zip(clean, no_token_loop)]
    return dict(prompts=len(prompts), new_tokens=max_new, without_triple_line=sum(clean),
                fraction=sum(clean) / max(len(clean), 1), without_token_loop=sum(no_token_loop),
                without_either=sum(both), examples=[t for t, c in zip(texts, clean) if not c][:3],
                token_loop_examples=[t for t, c in zip(texts, no_token_loop) if not c][:3])
