# SPDX-License-Identifier: Apache-2.0
"""train_family.py: fine-tuning the target against its own greedy loops.

Sequence-level unlikelihood training (Welleck et al. 2019, "Neural Text Generation with
Unlikelihood Training", section 5.2), with a source line as the unit of repetition instead of an
n-gram, because code repeats n-grams legitimately (`self.`, indentation) but almost never a whole
line twice in a row. Each step:
  1. greedy-continues `--ul-batch` prompts cut from train.txt ([bos] + 63 tokens, the loop
     check's shape) by `--loop-new` tokens with the current weights (eval mode, no dropout);
  2. marks the tokens of every continuation line that equals the line before it (trailing
     whitespace ignored): a non-blank line from its second copy on, a blank line from its third
     (PEP 8 puts two blank lines between top-level definitions); and the tokens that extend a
     token-level loop inside a line (periodic_mask). A first run with the line rule alone
     (2026-12-04) moved the loops inside lines ("token_token_token_...", "filepath : filepath :
     ..."): the loop check passed 63/64 while the output got no better;
  3. loss = MLE on a train.txt batch + ul_weight * mean over the marked tokens of
     -log(1 - p(token | its prefix)).
Only training text is used: the loop check's prompts come from the held-out split.
"""

import time

import torch

from family_common import BOS, CTX, log
from family_decode import greedy_decode, periodic_mask
from family_models import add_dropout_hooks, lm_loss, softcap


@torch.no_grad()
def greedy_decode_cached(model, prompts, max_new, device):
    """greedy_decode (family_decode.py) through transformers' KV cache: one forward over the prompts
    (rows of equal length), then one token a step. Same tokens up to fp32 rounding between the two
    attention paths; train_unlikelihood checks that before it relies on it."""
    x = torch.tensor(prompts, dtype=torch.long, device=device)
    out = model(input_ids=x, use_cache=True)
    nxt = out.logits[:, -1].argmax(-1)
    steps = [nxt]
    for _ in range(max_new - 1):
        out = model(input_ids=nxt[:, None], past_key_values=out.past_key_values, use_cache=True)
        nxt = out.logits[:, -1].argmax(-1)
        steps.append(nxt)
    return torch.stack(steps, 1).tolist()


def pick_generator(model, prompts, max_new, device):
    """greedy_decode_cached when it gives greedy_decode's tokens on these prompts (at least 7 of
    every 8 rows equal: a row may part at a near tie), else greedy_decode; and the check's counts."""
    want = greedy_decode(model, prompts, max_new, device)
    try:
        got = greedy_decode_cached(model, prompts, max_new, device)
    except Exception as e:  # an API difference: keep the slow path rather than lose the run
        log(f"unlikelihood: cached generation failed ({type(e).__name__}: {e}); using full forwards")
        return greedy_decode, dict(cached=False, error=f"{type(e).__name__}: {e}")
    equal = sum(int(a == b) for a, b in zip(got, want))
    ok = 8 * equal >= 7 * len(want)
    log(f"unlikelihood: cached generation equals full forwards on {equal}/{len(want)} rows; "
        f"{'using it' if ok else 'using full forwards'}")
    return (greedy_decode_cached if ok else greedy_decode), dict(cached=ok, rows_equal=equal, rows=len(want))


def repeated_line_mask(tok, gen):
    """For one continuation `gen` (token ids): 1 for each token whose text lies (even partly) in a
    repeated line (the rule above), else 0."""
    if not gen:
        return []
    # Character end of every token from decoding each prefix: robust to byte-fallback pieces,
    # whose single-token text is not their text in context.
    prefixes = tok.decode_batch([gen[:i + 1] for i in range(len(gen))], skip_special_tokens=False)
    ends, top = [], 0
    for p in prefixes:
        top = max(top, len(p))
        ends.append(top)
    text = prefixes[-1]
    marked = bytearray(len(text) + 1)
    start, prev, run = 0, None, 0
    for line in text.split("\n"):
        key = line.rstrip()
        run = run + 1 if key == prev else 1
        if run >= (3 if key == "" else 2):
            marked[start:start + len(line) + 1] = b"\x01" * (len(line) + 1)  # the line and its newline
        prev = key
        start += len(line) + 1
    mask, begin = [], 0
    for end in ends:
        mask.append(1 if end > begin and any(marked[begin:end]) else 0)
        begin = end
    return mask


def degenerate_mask(tok, gen):
    """The tokens the fine-tune penalises: repeated lines (repeated_line_mask) or token-level
    loops (periodic_mask)."""
    return [a | b for a, b in zip(repeated_line_mask(tok, gen), periodic_mask(gen))]


def unlikelihood_term(model, seqs, masks, device):
    """Mean of -log(1 - p) over the marked target tokens of `seqs` (equal-length rows; masks
    align with seqs, 1 = penalise that token as a prediction), and the number marked."""
    x = torch.tensor(seqs, dtype=torch.long, device=device)
    m = torch.tensor(masks, dtype=torch.bool, device=device)[:, 1:]
    h = model.model(input_ids=x[:, :-1], use_cache=False).last_hidden_state
    logits = softcap(model.lm_head(h).float())
    p = torch.log_softmax(logits, -1).gather(-1, x[:, 1:, None]).squeeze(-1).exp()
    ul = -torch.log1p(-p.clamp(max=1.0 - 1e-5))
    count = m.sum()
    return (ul * m).sum() / count.clamp(min=1), int(count)


def train_unlikelihood(model, train_stream, tok, budget, args, device, eos):
    """Fine-tunes `model` in place for `budget` seconds (see the module docstring); returns the
    run's statistics, including how many of each step's own greedy continuations looped."""
    model.train()
    hooks = add_dropout_hooks(model, args.dropout)
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": args.weight_decay},
                             {"params": no_decay, "weight_decay": 0.0}], lr=args.ul_lr, betas=(0.9, 0.95),
                            eps=1e-8, fused=device.type == "cuda")
    gen_rng = torch.Generator(device=device).manual_seed(args.seed + 7)
    n = train_stream.numel()
    ar_prompt = torch.arange(args.eval_prompt_tokens - 1, device=device)
    ar_mle = torch.arange(CTX + 1, device=device)
    t_start = time.time()
    next_log = t_start + args.val_every
    step, history = 0, []
    looped_rows = total_rows = marked_total = 0
    window = dict(looped=0, rows=0, ul=0.0, mle=0.0, steps=0)
    model.eval()
    check_starts = torch.randint(0, n - CTX - 1, (16,), device=device, generator=gen_rng)
    generate, generator_check = pick_generator(
        model, [[BOS] + b for b in train_stream[check_starts[:, None] + ar_prompt].tolist()], args.loop_new,
        device)
    model.train()
    while time.time() - t_start < budget:
        lr = args.ul_lr * min(1.0, (step + 1) / 20)
        for g in opt.param_groups:
            g["lr"] = lr
        starts = torch.randint(0, n - CTX - 1, (args.ul_batch,), device=device, generator=gen_rng)
        body = train_stream[starts[:, None] + ar_prompt].tolist()
        prompts = [[BOS] + b for b in body]
        model.eval()
        gens = generate(model, prompts, args.loop_new, device)
        model.train()
        seqs, masks, looped = [], [], 0
        for p, g in zip(prompts, gens):
            cut = g.index(eos) if eos in g else len(g)
            m = degenerate_mask(tok, g[:cut]) + [0] * (len(g) - cut)
            looped += int(any(m))
            seqs.append(p + g)
            masks.append([0] * len(p) + m)
        x = train_stream[torch.randint(0, n - CTX - 1, (args.batch,), device=device, generator=gen_rng)[:, None]
                         + ar_mle]
        with torch.autocast(device.type, dtype=torch.bfloat16):
            mle = lm_loss(model, x)
            ul, marked = unlikelihood_term(model, seqs, masks, device)
            loss = mle + args.ul_weight * ul
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        step += 1
        looped_rows += looped
        total_rows += len(prompts)
        marked_total += marked
        window["looped"] += looped
        window["rows"] += len(prompts)
        window["ul"] += float(ul)
        window["mle"] += float(mle)
        window["steps"] += 1
        now = time.time()
        if now >= next_log or now - t_start >= budget:
            k = max(window["steps"], 1)
            history.append(dict(step=step, seconds=round(now - t_start, 1), looped_rows=window["looped"],
                                rows=window["rows"], ul_loss=round(window["ul"] / k, 4),
                                mle_loss=round(window["mle"] / k, 4)))
            log(f"unlikelihood step {step} ({now - t_start:.0f}s): {window['looped']}/{window['rows']} own "
                f"continuations looped, ul {window['ul'] / k:.4f}, mle {window['mle'] / k:.4f}")
            window = dict(looped=0, rows=0, ul=0.0, mle=0.0, steps=0)
            next_log = time.time() + args.val_every
    for h in hooks:
        h.remove()
    model.eval()
    return dict(steps=step, seconds=round(time.time() - t_start, 1), lr=args.ul_lr, weight=args.ul_weight,
                batch_generated=args.ul_batch, batch_mle=args.batch, new_tokens=args.loop_new,
                looped_rows=looped_rows, rows=total_rows, marked_tokens=marked_total, history=history,
                generator=generator_check,
                rule="tokens of a continuation line equal to the line before it (non-blank: 2nd copy on; "
                     "blank: 3rd copy on) and tokens that extend a token-level loop (period p <= 16 "
                     "tokens repeated for max(2p, 6) tokens)")
