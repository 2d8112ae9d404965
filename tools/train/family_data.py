# SPDX-License-Identifier: Apache-2.0
"""train_family.py: the corpus (build_corpus.py's output) and the Gemma-style BPE tokenizer;
token streams and training windows.
"""

import json
import math
import os

import torch

from corpus_io import read_manifest, read_split
from family_common import BOS, EOS, LIMIT_ALPHABET, PAD, SPECIAL_TOKENS, VOCAB


# ----------------------------------------------------------------------------- corpus + tokenizer


def load_corpus(path):
    """{split: [file texts]} from build_corpus.py's output (manifest offsets)."""
    manifest = read_manifest(path)
    docs = {}
    for split in ("train", "valid", "heldout"):
        docs[split], docs[split + "_paths"] = read_split(path, manifest, split)
    if not docs["valid"]:  # older corpus without valid split: carve every 10th train file
        docs["valid"] = docs["train"][5::10]
        docs["train"] = [d for i, d in enumerate(docs["train"]) if i % 10 != 5]
    return manifest, docs


def tokenizer_json(trained_model, vocab_size):
    """The final tokenizer.json: Gemma's pipeline around the trained BPE merges, ids
    [specials][256 byte tokens][trained tokens in training order][<unusedN> padding]."""
    vocab = {}
    for t in SPECIAL_TOKENS + [f"<0x{b:02X}>" for b in range(256)]:
        vocab[t] = len(vocab)
    trained_vocab = trained_model["vocab"]
    collisions = []
    for tok, _ in sorted(trained_vocab.items(), key=lambda kv: kv[1]):
        if tok in vocab:  # a trained string equal to a fixed token keeps the fixed id
            collisions.append(tok)
            continue
        vocab[tok] = len(vocab)
    if len(vocab) > vocab_size:
        raise RuntimeError(f"tokenizer: {len(vocab)} tokens > vocab {vocab_size}")
    n_unused = 0
    while len(vocab) < vocab_size:  # unreachable by BPE: no merge produces them
        vocab[f"<unused{n_unused}>"] = len(vocab)
        n_unused += 1
    merges = []
    for m in trained_model["merges"]:
        pair = m.split(" ") if isinstance(m, str) else list(m)
        if len(pair) != 2:
            raise RuntimeError(f"tokenizer: bad merge {m!r}")
        merges.append(pair)
    added = [{"id": i, "content": t, "single_word": False, "lstrip": False, "rstrip": False, "normalized": False,
              "special": True} for i, t in enumerate(SPECIAL_TOKENS)]
    obj = {
        "version": "1.0",
        "truncation": None,
        "padding": None,
        "added_tokens": added,
        "normalizer": {"type": "Replace", "pattern": {"String": " "}, "content": "\u2581"},
        # As Gemma's tokenizer.json: after the normalizer there is no space left, so the whole
        # text is one pre-token and BPE sees "\u2581" runs (indentation) like any character.
        "pre_tokenizer": {"type": "Split", "pattern": {"String": " "}, "behavior": "MergedWithPrevious",
                          "invert": False},
        "post_processor": {
            "type": "TemplateProcessing",
            "single": [{"SpecialToken": {"id": "<bos>", "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}}],
            "pair": [{"SpecialToken": {"id": "<bos>", "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}},
                     {"SpecialToken": {"id": "<bos>", "type_id": 1}}, {"Sequence": {"id": "B", "type_id": 1}}],
            "special_tokens": {"<bos>": {"id": "<bos>", "ids": [BOS], "tokens": ["<bos>"]}},
        },
        "decoder": {"type": "Sequence", "decoders": [
            {"type": "Replace", "pattern": {"String": "\u2581"}, "content": " "},
            {"type": "ByteFallback"},
            {"type": "Fuse"},
        ]},
        "model": {"type": "BPE", "dropout": None, "unk_token": "<unk>", "continuing_subword_prefix": None,
                  "end_of_word_suffix": None, "fuse_unk": True, "byte_fallback": True, "ignore_merges": False,
                  "vocab": vocab, "merges": merges},
    }
    return obj, {"trained_tokens": len(trained_vocab), "merges": len(merges), "unused_padding": n_unused,
                 "collisions": collisions}


def train_tokenizer(train_docs, cap_chars):
    """BPE on the lines of train.txt (each line, with its "\\n", is one training word: merges
    never cross a line end, so applying them to a whole text gives the same tokens)."""
    from tokenizers import Tokenizer, models, normalizers, pre_tokenizers, trainers

    total = sum(len(d) for d in train_docs)
    step = max(1, math.ceil(total / cap_chars))
    docs = train_docs[::step]
    lines = []
    for d in docs:
        parts = d.split("\n")
        lines.extend(p + "\n" for p in parts[:-1])
        if parts[-1]:
            lines.append(parts[-1])
    n_fixed = len(SPECIAL_TOKENS) + 256
    tok = Tokenizer(models.BPE())
    tok.normalizer = normalizers.Replace(" ", "\u2581")
    tok.pre_tokenizer = pre_tokenizers.Split(" ", behavior="merged_with_previous")
    trainer = trainers.BpeTrainer(vocab_size=VOCAB - n_fixed, min_frequency=2, show_progress=False,
                                  special_tokens=[], limit_alphabet=LIMIT_ALPHABET)
    tok.train_from_iterator(lines, trainer=trainer, length=len(lines))
    trained = json.loads(tok.to_str())["model"]
    obj, info = tokenizer_json(trained, VOCAB)
    final = Tokenizer.from_str(json.dumps(obj, ensure_ascii=False))
    if final.get_vocab_size(with_added_tokens=True) != VOCAB:
        raise RuntimeError(f"tokenizer: final vocab {final.get_vocab_size(with_added_tokens=True)} != {VOCAB}")
    info.update(training_files=len(docs), training_chars=sum(len(d) for d in docs), training_lines=len(lines),
                limit_alphabet=LIMIT_ALPHABET, min_frequency=2)
    return final, obj, info


def write_tokenizer_files(dst, tok_obj, generation_extra=None):
    os.makedirs(dst, exist_ok=True)
    with open(os.path.join(dst, "tokenizer.json"), "w", encoding="utf-8") as f:
        json.dump(tok_obj, f, ensure_ascii=False, indent=1)
    extra = SPECIAL_TOKENS[4:]
    cfg = {"add_bos_token": True, "add_eos_token": False, "bos_token": "<bos>", "eos_token": "<eos>",
           "pad_token": "<pad>", "unk_token": "<unk>", "model_max_length": 4096, "padding_side": "left",
           "clean_up_tokenization_spaces": False, "spaces_between_special_tokens": False,
           "tokenizer_class": "PreTrainedTokenizerFast"}
    with open(os.path.join(dst, "tokenizer_config.json"), "w") as f:
        json.dump(cfg, f, indent=1)
    with open(os.path.join(dst, "special_tokens_map.json"), "w") as f:
        json.dump({"bos_token": "<bos>", "eos_token": "<eos>", "pad_token": "<pad>", "unk_token": "<unk>",
                   "additional_special_tokens": extra}, f, indent=1)
    gen = {"bos_token_id": BOS, "eos_token_id": [EOS], "pad_token_id": PAD}
    gen.update(generation_extra or {})
    with open(os.path.join(dst, "generation_config.json"), "w") as f:
        json.dump(gen, f, indent=1)


def encode_docs(tok, docs):
    """[bos] + ids + [eos] per document."""
    encs = tok.encode_batch(docs, add_special_tokens=False)
    return [[BOS] + e.ids + [EOS] for e in encs]


def windows_of(stream, length):
    """Consecutive windows of `length` + 1 tokens overlapping by one token ([N, length + 1])."""
    n = (stream.numel() - 1) // length
    idx = torch.arange(n, device=stream.device)[:, None] * length + torch.arange(length + 1, device=stream.device)
    return stream[idx]
