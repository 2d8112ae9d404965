# SPDX-License-Identifier: Apache-2.0
"""train_family.py: the outputs: golden tensors (tests/golden/embedded), tokenizer checks and
the model card (models/README.md).
"""

import os

import torch

from family_common import CTX, GOLDEN_DIR, GOLDEN_NEW, GOLDEN_PROMPT_LENS, K_DRAFT, log
from family_models import target_forward
from family_decode import greedy_decode, spec_decode


# ----------------------------------------------------------------------------- outputs


def write_goldens(run, target, drafter, tok, held_docs, held_paths, root, device):
    from safetensors.torch import save_file

    exp = {}
    info = {"prompts": []}
    used = set()
    for i, L in enumerate(GOLDEN_PROMPT_LENS):
        fi = next(f for f, d in enumerate(held_docs) if f not in used and len(d) >= L + 1)
        used.add(fi)
        prompt = held_docs[fi][:L]  # starts with <bos>
        ids = torch.tensor(prompt, dtype=torch.long, device=device)
        if i == 0:
            _, _, logits = target_forward(target, ids[None])
            exp["logits.0"] = logits[0].float().cpu().contiguous()
        greedy = greedy_decode(target, [prompt], GOLDEN_NEW, device)[0]
        gen, rounds = spec_decode(target, drafter, [prompt], GOLDEN_NEW, K_DRAFT, device)
        exp[f"input_ids.{i}"] = torch.tensor(prompt, dtype=torch.int32)
        exp[f"generate_ids.{i}"] = torch.tensor(prompt + greedy, dtype=torch.int32)
        exp[f"spec_accepted.{i}"] = torch.tensor([n for _, n in rounds[0]], dtype=torch.int32)
        exp[f"spec_drafted.{i}"] = torch.tensor([k for k, _ in rounds[0]], dtype=torch.int32)
        info["prompts"].append(dict(index=i, tokens=L, source=held_paths[fi], spec_equals_greedy=gen[0] == greedy,
                                    rounds=len(rounds[0]), accepted=sum(n for _, n in rounds[0]),
                                    text_preview=tok.decode(prompt[1:], skip_special_tokens=False)[:160]))
        if gen[0] != greedy:
            # The C++ test (tests/unit/model/embedded_test.cpp) reads this: the reference has
            # disagreed with itself here before (the same position computed in two forwards).
            j = next(j for j, (x, y) in enumerate(zip(gen[0], greedy)) if x != y)
            info["prompts"][-1]["spec_first_difference"] = dict(new_token_index=j, spec=gen[0][j:j + 1],
                                                                golden=greedy[j:j + 1])
            log(f"WARNING golden prompt {i}: speculative tokens differ from greedy at new token {j}")
    os.makedirs(os.path.join(root, GOLDEN_DIR), exist_ok=True)
    save_file({k: v.contiguous() for k, v in exp.items()}, os.path.join(root, GOLDEN_DIR, "expected.safetensors"),
              metadata={"format": "pt", "producer": "tools/train/train_family.py"})
    info["tensors"] = {k: [str(v.dtype).replace("torch.", ""), list(v.shape)] for k, v in exp.items()}
    return info


def tokenizer_round_trips(tok):
    texts = [
        "def greet(name):\n    return f\"Hello, {name}!\"\n",
        "import os\nprint(os.path.join('a', 'b'))",
        "        if x is None:\n            raise ValueError('x')\n",
        "naïve café — 日本語 🙂",
        "<start_of_turn>user\nhi<end_of_turn>\n<|turn>model\n",
        "  two leading spaces and trailing  ",
        "",
    ]
    out = []
    for t in texts:
        e = tok.encode(t, add_special_tokens=True)
        dec = tok.decode(e.ids, skip_special_tokens=False)
        out.append(dict(text=t, ids=e.ids, tokens=e.tokens, decoded=dec,
                        round_trip=dec == "<bos>" + t))
    return out


def hf_tokenizer_check(folder, tok):
    try:
        from transformers import AutoTokenizer

        hf = AutoTokenizer.from_pretrained(folder)
        texts = ["def f(x):\n    return x + 1\n", "naïve 🙂 text", "<start_of_turn>user\nhi<end_of_turn>"]
        same = all(hf(t)["input_ids"] == tok.encode(t).ids for t in texts)
        return dict(auto_tokenizer_class=type(hf).__name__, matches_tokenizers=same)
    except Exception as e:  # noqa: BLE001
        return dict(error=f"{type(e).__name__}: {e}"[:300])


def drafter_pool_text(d):
    """The model card's lines on the drafter's training data (full run or --drafter-only)."""
    p = d["pool"]
    if p.get("mode") != "drafter_only":
        return ["Training: distilled from the frozen target on "
                f"{p['sequences']:,} greedy continuations ({p['new_tokens_per_sequence']} tokens each) of random",
                "training prompts, every position after the prompt an anchor,"]
    src = p.get("sources", {})
    lens = sorted({b["prompt_tokens"] for b in p.get("batch_list", [])})
    return [
        "Training (retrained alone with `--drafter-only` against the unchanged target): distilled from the",
        f"frozen target on {p['sequences']:,} greedy continuations ({p['new_tokens_per_sequence']} tokens each) of "
        f"prompts of {', '.join(str(x) for x in lens)} tokens cut at random offsets of the training "
        f"({src.get('train', 0):,} prompts) and validation ({src.get('valid', 0):,}) splits (never the held-out "
        f"split), plus {p.get('raw_sequences', 0):,} teacher-forced windows of raw training/validation text (the "
        "drafter sees the raw tokens, the KL target is the target's distribution there); one pool entry per "
        f"iteration, {d['training'].get('batch_sequences', 'n/a')} random rows of it, every position after the "
        "prompt an anchor,"]


def drafter_only_command(a):
    if not a:
        return []
    return [
        "    # then, to retrain only the drafter against the committed target (rewrites the assistant,",
        "    # the spec_* golden tensors, meta.json's drafter parts and this card):",
        "    python3 tools/train/train_family.py --drafter-only --corpus .carry/corpus --out . --pack-dir $OUT \\",
        f"        --drafter-minutes {a['drafter_minutes']} --deadline-seconds {a['deadline_seconds']:.0f} "
        f"--post-drafter-seconds {a['post_drafter_seconds']:.0f} --pool-seconds {a['pool_seconds']:.0f} \\",
        f"        --gen-batch {a['gen_batch']} --gen-new {a['gen_new']} "
        f"--prompt-lens {','.join(str(x) for x in a['prompt_lens'])} --pool-max-batches {a['pool_max_batches']} \\",
        f"        --pool-valid-fraction {a['pool_valid_fraction']} --raw-fraction {a['raw_fraction']} "
        f"--drafter-batch {a['drafter_batch']} --seed {a['seed']}",
    ]


def train_command(a):
    """The train_family.py command line of this run (the flags that differ from the defaults)."""
    flags = [f"--target-minutes {a['target_minutes']}", f"--drafter-minutes {a['drafter_minutes']}",
             f"--batch {a['batch']}", f"--tokenizer-max-chars {a['tokenizer_max_chars']:g}",
             f"--seed {a['seed']}", f"--deadline-seconds {a['deadline_seconds']:.0f}"]
    if a.get("baseline"):
        flags.append(f"--baseline {a['baseline']}")
    if a.get("init_target"):
        flags.append(f"--init-target {a['init_target']}")
    if a.get("unlikelihood_minutes"):
        flags.append(f"--unlikelihood-minutes {a['unlikelihood_minutes']} --ul-lr {a['ul_lr']} "
                     f"--ul-weight {a['ul_weight']} --ul-batch {a['ul_batch']}")
    return ["    python3 tools/train/train_family.py --corpus .carry/corpus --out . --pack-dir $OUT \\",
            "        " + " ".join(flags)]


def loops_limitation(loops):
    if not loops or loops["fraction"] >= 0.8:
        return []
    return [f"- Greedy decoding still loops: {loops['without_triple_line']} of {loops['prompts']} held-out "
            f"continuations ({100 * loops['fraction']:.0f}%) have no line repeated three times in a row; "
            "issue #32 asks for 80%."]


def baseline_text(res):
    b = res.get("baseline")
    if not b:
        return []
    t = res["target"]
    return [f"The previous target (`{b['path']}`, trained on the standard library alone, with its own tokenizer), "
            f"on the same held-out text: {b['heldout_ce']:.3f} nats/token, {b['heldout_ce_per_char']:.3f} "
            f"nats/character. This target: {t['heldout_ce']:.3f} nats/token "
            f"({b['heldout_ce'] - t['heldout_ce']:+.3f} better), {t['heldout_ce_per_char']:.3f} nats/character.",
            "",
            f"Loop check of the previous target: {b['without_triple_line']} of {b['loops']['prompts']} greedy "
            f"continuations without a line repeated three times in a row.",
            ""]


def unlikelihood_text(tt):
    u = tt.get("unlikelihood")
    if not u:
        return []
    first, last = (u["history"][0], u["history"][-1]) if u["history"] else ({}, {})
    return [f"Then {u['steps']} steps ({u['seconds']:.0f} s) of sequence-level unlikelihood fine-tuning against the "
            f"model's own greedy loops (`tools/train/family_unlikelihood.py`): each step greedy-continues "
            f"{u['batch_generated']} training-split prompts by {u['new_tokens']} tokens and penalises, with "
            f"-log(1 - p), the tokens of {u['rule']}; constant LR {u['lr']}, UL weight {u['weight']}. Its own "
            f"continuations looped in {first.get('looped_rows', 'n/a')}/{first.get('rows', 'n/a')} at the start and "
            f"{last.get('looped_rows', 'n/a')}/{last.get('rows', 'n/a')} at the end (per log window); validation "
            f"CE {tt.get('mle_valid_ce', float('nan')):.3f} before it (bf16 autocast).", ""]


def loops_text(loops):
    if not loops:
        return []
    extra = ""
    if "without_token_loop" in loops:
        extra = (f" Loops inside a line (a unit of at most 16 tokens repeated three times, for at least 6 tokens) "
                 f"are counted too: {loops['without_token_loop']} of {loops['prompts']} continuations have none, "
                 f"{loops['without_either']} have neither kind.")
    return [f"**Loop check:** {loops['without_triple_line']} of {loops['prompts']} held-out prompts "
            f"({100 * loops['fraction']:.0f}%) get {loops['new_tokens']} greedy tokens with no line repeated "
            "three times in a row." + extra, ""]


def model_card(res):
    t, d, tk, c = res["target"], res["drafter"], res["tokenizer"], res["corpus"]
    sp = res.get("speculative", {}).get("centroid", {})
    spd = res.get("speculative", {}).get("dense", {})

    def f(x, nd=3):
        return "n/a" if x is None else f"{x:.{nd}f}"

    tt = t["training"]
    best = next((h for h in tt["history"] if h["step"] == tt["best_step"]), None)
    best_tokens = best["tokens"] if best else tt["tokens"]
    best_epochs = best_tokens / max(tk["tokens"]["train"], 1)
    budgets = res.get("budgets", {})
    tau = sp.get("tau")
    prev = res.get("drafter_previous")

    lines = [
        "# specula embedded default models: gemma4-tiny-py + gemma4-tiny-py-assistant",
        "",
        "A tiny Gemma 4 target and its Gemma 4 assistant (multi-token-prediction drafter), trained by",
        "`tools/train/train_family.py` on the Python source of Debian packages so that specula runs out of the",
        "box. They are real `transformers` checkpoints (Hugging Face layout, bf16 safetensors) and load",
        "in transformers 5.17 as `Gemma4ForCausalLM` and `Gemma4AssistantForCausalLM`. They complete",
        "Python code; they know nothing else. Do not expect chat or reasoning.",
        "",
        "## Files",
        "",
        "| folder | model_type | class | params | files |",
        "|---|---|---|---|---|",
        f"| `gemma4-tiny-py/` | gemma4_text | Gemma4ForCausalLM | {t['params']:,} | "
        f"{', '.join(t['files'])} |",
        f"| `gemma4-tiny-py-assistant/` | gemma4_assistant | Gemma4AssistantForCausalLM | {d['params']:,} | "
        f"{', '.join(d['files'])} |",
        "",
        f"Total size {res['family_bytes'] / 1e6:.1f} MB; no file over 16 MB. Both folders carry the same",
        "`tokenizer.json`, `tokenizer_config.json`, `special_tokens_map.json`; `generation_config.json`:",
        "eos `[1]`, bos 2, pad 0 (the assistant's also says `num_assistant_tokens` 4).",
        "",
        "## Target (`gemma4-tiny-py`)",
        "",
        "vocab 8192, hidden 256, intermediate 768, 8 layers `[S,S,S,F,S,S,S,F]` (S = sliding window 128,",
        "F = full), 4 heads, 1 KV head, head_dim 64 (sliding) / 128 (full, written as `per_layer_config`),",
        "Per-Layer Embeddings 32 per layer (vocab 8192), `num_kv_shared_layers` 2 (layers 6, 7 reuse the K/V",
        "of donors 5 (sliding) and 3 (full)), final logit soft-cap 30, RoPE sliding default θ 1e4, full",
        "proportional (partial 0.25) θ 1e6, tied embeddings, `max_position_embeddings` 4096 (trained at",
        f"context {CTX}: quality beyond that is untested).",
        "",
        (f"Continued from the weights and tokenizer of `{res['args']['init_target']}` (see its previous "
         "card in git history). " if res["args"].get("init_target") else "") +
        f"Training: {tt['steps']} steps of {tt['batch']} x {CTX} tokens ({tt['tokens'] / 1e6:.0f}M tokens, "
        f"{tt['epochs']} epochs of the training split) in {tt['seconds']:.0f} s on one {res['versions']['device']}; "
        f"AdamW (fused, betas 0.9/0.95, weight decay {tt['weight_decay']}), peak LR {tt['peak_lr']}, warmup "
        f"{tt['warmup_steps']} steps, cosine by wall time, bf16 autocast, residual dropout {tt['dropout']} "
        f"(training only). **The saved weights are the best validation checkpoint, step {tt['best_step']}** "
        f"({best_tokens / 1e6:.0f}M tokens, about {best_epochs:.1f} epochs)"
        + ("; later steps only overfitted." if tt['best_step'] < 0.9 * tt['steps'] else "."),
        "",
        *unlikelihood_text(tt),
        f"**Held-out cross-entropy: {f(t['heldout_ce'])} nats/token** "
        f"({f(t.get('heldout_ce_per_char'))} nats/character) on `heldout.txt` "
        f"({t['heldout_tokens']:,} tokens, fp32 compute from the bf16 weights; validation "
        f"{f(t['valid_ce'])}).",
        "",
        *baseline_text(res),
        *loops_text(t.get("loops")),
        "## Assistant (`gemma4-tiny-py-assistant`)",
        "",
        "backbone_hidden_size 256; text_config hidden 128, intermediate 512, 4 layers `[S,S,S,F]`, 4 heads,",
        "1 KV head, head_dim 64 / 128, sliding window 128, no PLE, every layer KV-shared (Q-only attention",
        "over the target's donor K/V); centroid LM head: `num_centroids` 64, `centroid_intermediate_top_k` 8",
        "(1024 candidate tokens per step). `masked_embedding.token_ordering` is a balanced k-means of the",
        "target's normalised embedding rows into 64 clusters of exactly 128 tokens.",
        "",
        *drafter_pool_text(d),
        "4 unrolled draft steps with the engine's semantics (donors [0, p), sliding donor the newest 129 entries, query position p for",
        "every step, inputs [E_target(token)·16 ; hidden], feedback through `post_projection`), loss",
        "Σ_j 0.8^j (KL(target ‖ dense drafter head) + 0.5 · CE(centroid scores, cluster of the target's",
        f"argmax)); {d['training']['iterations']} iterations in {d['training']['seconds']:.0f} s. The vectorised "
        "training forward equals transformers' `Gemma4AssistantForCausalLM` forward (max relative difference "
        f"{d['parity']['max_rel_diff_logits']:.1e} logits, {d['parity']['max_rel_diff_next_hidden']:.1e} hidden, fp32).",
        "",
        "## Speculative decoding (greedy, K = 4, fp32 from the bf16 weights)",
        "",
        f"{sp.get('prompts', 0)} held-out prompts of {sp.get('prompt_tokens', 0)} tokens, "
        f"{sp.get('max_new', 0)} new tokens each, drafter using its centroid head as inference does:",
        "",
        f"- **τ (tokens per verify round) = {f(sp.get('tau'), 2)}**, acceptance rate {f(sp.get('acceptance_rate'))}",
        f"- acceptance by draft position: {', '.join(f(x) for x in sp.get('acceptance_at', []))} "
        f"(conditional on the previous: {', '.join(f(x) for x in sp.get('conditional_acceptance_at', []))})",
        f"- with the dense head instead: τ {f(spd.get('tau'), 2)}",
        f"- speculative output equals plain greedy output on {sp.get('rows_equal_greedy', 'n/a')} of "
        f"{sp.get('prompts', 0)} prompts",
        "",
        "## Tokenizer",
        "",
        f"Gemma-style BPE, vocab 8192, trained with Hugging Face `tokenizers` on the lines of the training split "
        f"({tk['training_chars'] / 1e6:.1f}M characters). Normalizer Replace(' ' → '▁'); pre-tokenizer",
        "Split(' ', MergedWithPrevious) as in Gemma's tokenizer.json (a no-op after the normalizer: one",
        "pre-token per text); byte fallback with all 256 `<0xNN>` tokens; decoder Replace('▁' → ' '),",
        "ByteFallback, Fuse; `<bos>` prepended by the post-processor. Ids: 0 `<pad>`, 1 `<eos>`, 2 `<bos>`,",
        "3 `<unk>`, 4 `<start_of_turn>`, 5 `<end_of_turn>`, 6 `<|turn>`, 7 `<turn|>`, 8 `<|channel>`,",
        "9 `<channel|>`, 10 `<|think|>`, 11–266 `<0x00>`–`<0xFF>`, then the merged tokens. "
        f"{tk['chars_per_token']:.2f} characters per token on the held-out split.",
        "",
        "## Corpus",
        "",
        f"The `*.py` files of {len(c['packages'])} Debian bookworm packages, pinned in "
        "`tools/train/corpus_packages.txt`: the CPython 3.11 standard library (`libpython3.11-stdlib`, "
        "`libpython3.11-minimal`) and python3-* libraries (numpy, scipy, sympy, django, pandas, twisted, ...). "
        f"Selection: {c['selection']}. Split by file: {c['split_rule']} "
        f"({c['counts']['train']:,} training files, {c['chars']['train'] / 1e6:.1f}M characters; "
        f"{c['counts']['valid']:,} validation, {c['chars']['valid'] / 1e6:.1f}M; {c['counts']['heldout']:,} held out, "
        f"{c['chars']['heldout'] / 1e6:.1f}M). Built by `tools/train/build_corpus.py` (deterministic for the "
        "pinned versions; its `manifest.json` lists every file with its sha256).",
        "",
        "## Limitations",
        "",
        f"- {tk['tokens']['train'] / 1e6:.1f}M training tokens for {t['params'] / 1e6:.1f}M parameters; the best "
        f"validation checkpoint came after about {best_epochs:.1f} epochs.",
        f"- τ = {f(tau, 2)} at K = 4 on held-out prompts; first-draft acceptance "
        f"{f((sp.get('acceptance_at') or [None])[0])}.",
        *loops_limitation(t.get("loops")),
        f"- Wall-time budgets of this run: target {budgets.get('target_seconds', 'n/a')} s, drafter "
        f"{budgets.get('drafter_seconds_planned', 'n/a')} s (requested {res['args']['target_minutes']} / "
        f"{res['args']['drafter_minutes']} minutes; the budgets shrink when the run's deadline cannot hold them).",
        "- Trained at context 512; nothing was checked beyond it.",
        "",
        "## Reproduce",
        "",
        "    python3 tools/train/build_corpus.py                # here: writes .carry/corpus/",
        "    # on the GPU machine, carrying .carry/corpus (tools/gpu/family_run.sh runs this):",
        *train_command(res["args"]),
        *drafter_only_command(res.get("drafter_only_args")),
        "",
        f"Versions: {', '.join(f'{k} {v}' for k, v in res['versions'].items())}. Wall-time budgets make runs",
        "not bit-reproducible (the number of steps depends on speed). Goldens for the C++ engine:",
        "`tests/golden/embedded/` (see its `meta.json`).",
        "",
        "## License",
        "",
        "The weights were trained from scratch here and are distributed with specula under its license.",
        "The training corpus is the Python source of the Debian packages listed in",
        "`tools/train/corpus_packages.txt`, each under its own license (see each package's copyright",
        "file); only statistics of it are in these files.",
        "",
    ]
    return "\n".join(lines)
