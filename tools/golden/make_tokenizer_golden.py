#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
"""Golden fixtures for engine/tokenizer, made with Hugging Face `tokenizers`
(and transformers' AutoTokenizer for the add_bos behaviour).

Runs on the GPU machine (which has tokenizers and transformers):

  python3 tools/golden/make_tokenizer_golden.py \
      --tokenizer-dir .carry/tokenizer-gemma3 --out tests/golden/tokenizer

Writes into --out:
  gemma_cases.jsonl        one object per line: text, ids (no special tokens),
                           ids_with_special (AutoTokenizer), ids_with_special_hf
                           (tokenizers post-processor), decoded (decode(ids)),
                           decoded_skip_special (decode(ids_with_special, skip=True))
  gemma_variants.json      normalizer/pre_tokenizer/decoder swaps applied to the
                           Gemma tokenizer.json (Llama-2 style, Metaspace, NFC ...)
  gemma_variants.jsonl     variant, text, ids, decoded for a subset of the cases
  gemma_corpus.txt         ~1.5 MB of mixed text built from the cases (seeded)
  gemma_corpus.ids.bin     its ids (int32 little-endian, no special tokens)
  bytelevel/tokenizer.json a tiny GPT-2 style byte-level BPE trained here
  bytelevel/variants.json  pre-tokenizer swaps for it
  bytelevel/cases.jsonl    variant, text, ids, ids_with_special, decoded (the last
                           two only where they differ from ids / text)
  hf_throughput.json       single-threaded encode MB/s of tokenizers on the corpus

--dump-texts DIR writes only the texts (cases.json, corpus.txt) and needs no
tokenizers package; it is for checking the generator anywhere.
Everything is deterministic (fixed seeds, no dependence on the machine).
"""
import argparse
import json
import os
import random
import struct
import sys
import time

SEED = 20260101

CODE_PY = '''def fib(n: int) -> list[int]:
    """Return the first n Fibonacci numbers."""
    a, b = 0, 1
    out = []
    for _ in range(n):
        out.append(a)
        a, b = b, a + b
    return out


if __name__ == "__main__":
    print(fib(10))  # [0, 1, 1, 2, 3, 5, 8, 13, 21, 34]
'''

CODE_CPP = '''#include <vector>
#include <cstdint>

template <typename T>
struct Span { T* data; size_t size; };

int main(int argc, char** argv) {
\tstd::vector<int32_t> ids{1, 2, 3};
\tfor (auto& id : ids) id <<= 2;  // shift
\treturn ids.size() > 2 ? 0 : -1;
}
'''

CODE_JSON = '''{
  "model": {"type": "BPE", "dropout": null, "vocab": {"a": 0, "b": 1}},
  "merges": ["a b", "ab c"],
  "list": [1, 2.5, -3e10, true, false, null],
  "nested": {"k\\u00e9y": "v\\u00e4lue", "emoji": "\\ud83d\\ude00"}
}
'''

SENTENCES = [
    "The quick brown fox jumps over the lazy dog.",
    "Hello, world! How are you doing today?",
    "Café crème brûlée à la française, s'il vous plaît.",
    "Größenwahn und Übermut: Die Straße ist naß.",
    "¿Dónde está la biblioteca? ¡Allí, señor!",
    "Tiếng Việt có nhiều dấu: ắ ằ ẳ ẵ ặ ố ồ ổ ỗ ộ.",
    "Съешь же ещё этих мягких французских булок, да выпей чаю.",
    "Ξεσκεπάζω την ψυχοφθόρα βδελυγμία.",
    "مرحبا بالعالم، كيف حالك اليوم؟",
    "שלום עולם, מה שלומך היום?",
    "नमस्ते दुनिया, आप कैसे हैं? हिन्दी में लिखा गया वाक्य।",
    "สวัสดีชาวโลก วันนี้เป็นอย่างไรบ้าง",
    "你好，世界！今天天气很好，我们去公园散步吧。",
    "日本語のテキスト：ひらがな、カタカナ、漢字が混ざっています。",
    "안녕하세요 세계! 오늘 날씨가 정말 좋네요.",
    "Zażółć gęślą jaźń. Příliš žluťoučký kůň úpěl ďábelské ódy.",
    "Türkçe: Pijamalı hasta yağız şoföre çabucak güvendi.",
    "Ελληνικά και English mixed με 123 αριθμούς.",
    "The year 2024 had 366 days; π ≈ 3.14159265358979.",
    "Email me at someone@example.com or visit https://example.org/path?q=1&r=2#frag.",
    "Markdown: **bold**, _italic_, `code`, [link](http://x.y), > quote",
    "Math: ∀x ∈ ℝ, x² ≥ 0; ∑_{i=1}^{n} i = n(n+1)/2; √2 ≠ 1.41",
    "Prices: $5.99, €4,50, £3.20, ¥1000, ₹250, ₿0.001",
]

EMOJI = [
    "😀", "👍🏽", "👩🏿‍💻", "👨‍👩‍👧‍👦", "🏳️‍🌈", "🇫🇷🇯🇵🇺🇸", "1️⃣", "❤️", "🧑‍🤝‍🧑", "🫠",
    "👋🏻👋🏼👋🏽👋🏾👋🏿", "🐈‍⬛", "😶‍🌫️", "🏴󠁧󠁢󠁳󠁣󠁴󠁿",
]

SPECIAL_INLINE = [
    "<start_of_turn>user\nWhat is 2+2?<end_of_turn>\n<start_of_turn>model\n4<end_of_turn>",
    "<bos>Hello<eos>",
    "text<pad><pad><pad>",
    "<unk> and <mask> and <unused0> and <unused99> and <unused6241>",
    "<image_soft_token><start_of_image><end_of_image>",
    "<start_of_tur almost special <end_of_turn",
    "<<bos>>",
    " <bos> spaced <eos> ",
    "[multimodal]x[multimodal]",
]

WORDS = ("time person year way day thing man world life hand part child eye woman place work week "
         "case point government company number group problem fact be have do say get make go know "
         "take see come think look want give use find tell ask seem feel try leave call good new "
         "first last long great little own other old right big high different small large next "
         "early young important few public bad same able to of in for on with at by from up about "
         "into over after tokenizer model inference speculative decoding draft verify accept reject "
         "kernel cache attention layer weight tensor").split()


def fixed_cases():
    cases = [
        "", " ", "  ", "   ", "\n", "\n\n", "\n\n\n\n\n", "\t", "\t\t\t", " \n \n ", "\r\n", "\r\n\r\n",
        "a", "A", "1", ".", "Hello", " Hello", "Hello ", "  Hello  world  ",
        "hello world", "Hello World", "HELLO WORLD", "hElLo WoRlD",
        CODE_PY, CODE_CPP, CODE_JSON,
        "x" * 500, "supercalifragilisticexpialidocious" * 12, "ab" * 300,
        "1234567890" * 30, "3.14159265358979323846264338327950288419716939937510",
        "0000000000000000000000", "1,000,000.00", "12:34:56", "2025-01-31T23:59:59Z",
        "e\u0301", "e\u0301\u0302\u0323", "Z\u0351\u0308\u034c\u0365a\u0360\u0352\u033el\u0357\u0346g\u0346\u0309o\u0310",
        "a\u0308o\u0308u\u0308", "\u00e9 vs e\u0301", "\u212b \u00c5 A\u030a", "\uac00 \u1100\u1161 \u1100\u1161\u11a8",
        "ﬁ ﬂ ﬀ ① ㈱ ｈｅｌｌｏ", "\u00a0non\u00a0breaking\u00a0", "zero\u200bwidth\u200cjoin\u200d",
        "\ufeffBOM at start", "soft\u00adhyphen", "\u2028line\u2029para",
        "\x00", "\x01\x02\x03", "a\x00b", "\x7f", "\x1b[31mred\x1b[0m", "\x0b\x0c",
        "\u2581", "\u2581\u2581 lower one eighth block \u2581", "tab\tseparated\tvalues\n1\t2\t3",
        "    indented four\n        indented eight\n\t\ttabs", "trailing spaces   \n   ",
        "\ue000\uf8ff private use", "\U000f0000\U0010fffd plane 15/16", "\u0378\u0379 unassigned",
        "\U00020000\U0002a6d6 CJK ext B", "\U0001d400\U0001d7ff math alnum", "\U0001f9ff\U0001fa70",
        "I'm you're we've they'll he'd it's 'quoted' ''double''",
        "don't DON'T Don't", "...", "!!!???", "----====____", "<<<>>>", "{}[]()", "#!/bin/bash",
        "a\nb\nc", "a\n\nb\n\n\nc", "a \n b", "word\t\n\tword",
    ]
    cases += SENTENCES
    cases += EMOJI
    cases += ["emoji in text " + e + " and more" for e in EMOJI]
    cases += SPECIAL_INLINE
    cases.append("\n".join(SENTENCES))
    cases.append(" ".join(EMOJI))
    return cases


def random_cases(rng, n):
    pool_words = WORDS + [w for s in SENTENCES for w in s.split()] + EMOJI
    seps = [" ", " ", " ", " ", "  ", "\n", "\n\n", "\t", "", ", ", ". ", " - "]
    out = []
    for _ in range(n):
        k = rng.randint(1, 40)
        parts = []
        for _ in range(k):
            r = rng.random()
            if r < 0.75:
                parts.append(rng.choice(pool_words))
            elif r < 0.85:
                parts.append(str(rng.randint(0, 10 ** rng.randint(1, 12))))
            elif r < 0.92:
                parts.append(rng.choice(["<start_of_turn>", "<end_of_turn>", "<bos>", "<eos>", "<pad>",
                                         "<unused3>", "\u2581", "\x00", "\ue000"]))
            else:
                parts.append(chr(rng.choice([rng.randint(0x20, 0x7e), rng.randint(0xa0, 0x24f),
                                             rng.randint(0x370, 0x52f), rng.randint(0x4e00, 0x9fff),
                                             rng.randint(0x1f300, 0x1f64f), rng.randint(0xac00, 0xd7a3)])))
            parts.append(rng.choice(seps))
        text = "".join(parts)
        if rng.random() < 0.2:
            text = text.upper()
        out.append(text)
    return out


def build_cases():
    rng = random.Random(SEED)
    return fixed_cases() + random_cases(rng, 220)


def build_corpus(cases, target_bytes):
    """Mixed text of about target_bytes UTF-8 bytes, seeded."""
    rng = random.Random(SEED + 1)
    small = [c for c in cases if 0 < len(c) < 400]
    chunks = []
    size = 0
    while size < target_bytes:
        r = rng.random()
        if r < 0.45:
            # A paragraph of plain words.
            n = rng.randint(20, 120)
            words = [rng.choice(WORDS) for _ in range(n)]
            for i in range(len(words)):
                if rng.random() < 0.08:
                    words[i] = words[i].capitalize() + rng.choice([".", ",", ";", ":", "!", "?"])
            chunk = " ".join(words) + "\n\n"
        elif r < 0.6:
            chunk = rng.choice([CODE_PY, CODE_CPP, CODE_JSON]).replace("10", str(rng.randint(0, 999)))
        elif r < 0.9:
            chunk = rng.choice(SENTENCES) + rng.choice([" ", "\n", " ", "\n\n"])
        else:
            chunk = rng.choice(small) + "\n"
        chunks.append(chunk)
        size += len(chunk.encode("utf-8"))
    return "".join(chunks)


# Pipeline swaps applied to the Gemma tokenizer.json, to exercise the other
# normalizers, pre-tokenizers and decoders on the real vocab.
GEMMA_VARIANTS = {
    "llama2": {
        "normalizer": {"type": "Sequence", "normalizers": [
            {"type": "Prepend", "prepend": "\u2581"},
            {"type": "Replace", "pattern": {"String": " "}, "content": "\u2581"}]},
        "pre_tokenizer": None,
        "decoder": {"type": "Sequence", "decoders": [
            {"type": "Replace", "pattern": {"String": "\u2581"}, "content": " "},
            {"type": "ByteFallback"}, {"type": "Fuse"},
            {"type": "Strip", "content": " ", "start": 1, "stop": 0}]},
    },
    "metaspace_first": {
        "normalizer": None,
        "pre_tokenizer": {"type": "Metaspace", "replacement": "\u2581", "prepend_scheme": "first",
                          "split": False},
        "decoder": {"type": "Sequence", "decoders": [
            {"type": "ByteFallback"},
            {"type": "Metaspace", "replacement": "\u2581", "prepend_scheme": "first", "split": False}]},
    },
    "metaspace_split": {
        "normalizer": None,
        "pre_tokenizer": {"type": "Metaspace", "replacement": "\u2581", "prepend_scheme": "always",
                          "split": True},
        "decoder": {"type": "Metaspace", "replacement": "\u2581", "prepend_scheme": "always",
                    "split": True},
    },
    "nfc": {
        "normalizer": {"type": "Sequence", "normalizers": [
            {"type": "NFC"}, {"type": "Replace", "pattern": {"String": " "}, "content": "\u2581"}]},
    },
    "nfd_strip": {
        "normalizer": {"type": "Sequence", "normalizers": [
            {"type": "NFD"}, {"type": "Strip", "strip_left": True, "strip_right": True},
            {"type": "Replace", "pattern": {"String": " "}, "content": "\u2581"}]},
    },
    "split_isolated": {
        "pre_tokenizer": {"type": "Split", "pattern": {"String": "\u2581"}, "behavior": "Isolated",
                          "invert": False},
    },
    "split_contiguous_digits": {
        "pre_tokenizer": {"type": "Sequence", "pretokenizers": [
            {"type": "Split", "pattern": {"String": "\u2581"}, "behavior": "MergedWithNext",
             "invert": False},
            {"type": "Digits", "individual_digits": True}]},
    },
}

GPT2_REGEX = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"

BYTELEVEL_VARIANTS = {
    "base": {},
    "prefix_space": {"pre_tokenizer": {"type": "ByteLevel", "add_prefix_space": True,
                                       "trim_offsets": True, "use_regex": True}},
    "split_regex": {"pre_tokenizer": {"type": "Sequence", "pretokenizers": [
        {"type": "Split", "pattern": {"Regex": GPT2_REGEX}, "behavior": "Isolated", "invert": False},
        {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": False}]}},
    "digits_whitespace": {"pre_tokenizer": {"type": "Sequence", "pretokenizers": [
        {"type": "WhitespaceSplit"},
        {"type": "Digits", "individual_digits": False},
        {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": True}]}},
    "template": {"post_processor": {
        "type": "TemplateProcessing",
        "single": [{"SpecialToken": {"id": "<|im_start|>", "type_id": 0}},
                   {"Sequence": {"id": "A", "type_id": 0}},
                   {"SpecialToken": {"id": "<|endoftext|>", "type_id": 0}}],
        "pair": [{"Sequence": {"id": "A", "type_id": 0}}, {"Sequence": {"id": "B", "type_id": 1}}],
        "special_tokens": {}}},  # ids filled in once the tokenizer is trained
}


def apply_variant(base_json, variant):
    j = json.loads(base_json)
    for key, value in variant.items():
        j[key] = value
    return json.dumps(j, ensure_ascii=False)


def write_jsonl(path, rows):
    with open(path, "w", encoding="utf-8") as f:
        for r in rows:
            f.write(json.dumps(r, ensure_ascii=False) + "\n")


def train_bytelevel(texts):
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(vocab_size=500, min_frequency=2, show_progress=False,
                                  special_tokens=["<|endoftext|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(texts, trainer)
    tok.add_special_tokens([AddedToken("<|im_start|>", special=True, normalized=False)])
    tok.add_tokens([
        AddedToken("[SEP]", lstrip=True, rstrip=True, normalized=False),
        AddedToken("magic", single_word=True, normalized=False),
        AddedToken("<norm>", normalized=True),
    ])
    return tok


def bytelevel_texts(variant, cases, extra):
    """All cases for the base variant; a third of the shorter ones for the others (keeps the file small)."""
    if variant == "base":
        return cases + extra
    return [c for c in cases if len(c) <= 300][::3] + extra


def hf_throughput(tok, corpus, reps):
    data = corpus.encode("utf-8")
    lines = corpus.split("\n")
    best_whole = best_lines = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        tok.encode(corpus, add_special_tokens=False)
        best_whole = min(best_whole, time.perf_counter() - t0)
        t0 = time.perf_counter()
        for line in lines:
            tok.encode(line, add_special_tokens=False)
        best_lines = min(best_lines, time.perf_counter() - t0)
    mb = len(data) / 1e6
    return {"bytes": len(data), "whole_MBps": mb / best_whole, "per_line_MBps": mb / best_lines,
            "whole_s": best_whole, "per_line_s": best_lines, "reps": reps}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokenizer-dir", help="folder with the Gemma tokenizer.json (+ tokenizer_config.json)")
    ap.add_argument("--out", help="output folder (tests/golden/tokenizer)")
    ap.add_argument("--dump-texts", help="only write the generated texts to this folder")
    ap.add_argument("--corpus-bytes", type=int, default=1_500_000)
    ap.add_argument("--bench-reps", type=int, default=3)
    args = ap.parse_args()

    cases = build_cases()
    corpus = build_corpus(cases, args.corpus_bytes)
    if args.dump_texts:
        os.makedirs(args.dump_texts, exist_ok=True)
        with open(os.path.join(args.dump_texts, "cases.json"), "w", encoding="utf-8") as f:
            json.dump(cases, f, ensure_ascii=False)
        with open(os.path.join(args.dump_texts, "corpus.txt"), "w", encoding="utf-8", newline="") as f:
            f.write(corpus)
        print(f"{len(cases)} cases, corpus {len(corpus.encode())} bytes", file=sys.stderr)
        return

    # Single-threaded tokenizers, no network.
    os.environ["RAYON_NUM_THREADS"] = "1"
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    os.environ["HF_HUB_OFFLINE"] = "1"
    import tokenizers
    from tokenizers import Tokenizer
    print(f"tokenizers {tokenizers.__version__}", file=sys.stderr)

    out = args.out
    os.makedirs(os.path.join(out, "bytelevel"), exist_ok=True)
    tok_path = os.path.join(args.tokenizer_dir, "tokenizer.json")
    with open(tok_path, encoding="utf-8") as f:
        gemma_json = f.read()
    tok = Tokenizer.from_str(gemma_json)

    auto = None
    try:
        import transformers
        from transformers import AutoTokenizer
        print(f"transformers {transformers.__version__}", file=sys.stderr)
        auto = AutoTokenizer.from_pretrained(args.tokenizer_dir)
        print(f"AutoTokenizer class {type(auto).__name__}", file=sys.stderr)
    except Exception as e:  # keep going: ids_with_special then come from tokenizers
        print(f"AutoTokenizer unavailable: {e!r}", file=sys.stderr)

    rows = []
    mismatch_auto = 0
    for text in cases:
        ids = tok.encode(text, add_special_tokens=False).ids
        ids_hf = tok.encode(text, add_special_tokens=True).ids
        ids_auto = auto(text, add_special_tokens=True)["input_ids"] if auto is not None else ids_hf
        if ids_auto != ids_hf:
            mismatch_auto += 1
            if mismatch_auto <= 5:
                print(f"AutoTokenizer differs from tokenizers on {text[:60]!r}: {ids_auto[:12]} vs {ids_hf[:12]}",
                      file=sys.stderr)
        rows.append({"text": text, "ids": ids, "ids_with_special": ids_auto, "ids_with_special_hf": ids_hf,
                     "decoded": tok.decode(ids, skip_special_tokens=False),
                     "decoded_skip_special": tok.decode(ids_auto, skip_special_tokens=True)})
        if auto is not None:
            rows[-1]["decoded_auto"] = auto.decode(ids_auto, skip_special_tokens=False)
    write_jsonl(os.path.join(out, "gemma_cases.jsonl"), rows)
    print(f"gemma cases: {len(rows)} (AutoTokenizer != tokenizers on {mismatch_auto})", file=sys.stderr)

    # Variants of the Gemma pipeline on a subset of the cases.
    subset = cases[::3]
    variant_rows = []
    for name, variant in GEMMA_VARIANTS.items():
        vt = Tokenizer.from_str(apply_variant(gemma_json, variant))
        for text in subset:
            ids = vt.encode(text, add_special_tokens=False).ids
            variant_rows.append({"variant": name, "text": text, "ids": ids,
                                 "decoded": vt.decode(ids, skip_special_tokens=False)})
    with open(os.path.join(out, "gemma_variants.json"), "w", encoding="utf-8") as f:
        json.dump(GEMMA_VARIANTS, f, ensure_ascii=False, indent=1)
    write_jsonl(os.path.join(out, "gemma_variants.jsonl"), variant_rows)
    print(f"gemma variants: {len(variant_rows)} rows", file=sys.stderr)

    # Corpus and its ids.
    with open(os.path.join(out, "gemma_corpus.txt"), "w", encoding="utf-8", newline="") as f:
        f.write(corpus)
    corpus_ids = tok.encode(corpus, add_special_tokens=False).ids
    with open(os.path.join(out, "gemma_corpus.ids.bin"), "wb") as f:
        f.write(struct.pack(f"<{len(corpus_ids)}i", *corpus_ids))
    print(f"corpus: {len(corpus.encode())} bytes, {len(corpus_ids)} ids", file=sys.stderr)

    # Tiny byte-level BPE (GPT-2 style), trained on the cases and a slice of the corpus.
    bl = train_bytelevel(cases + corpus[:200_000].split("\n"))
    bl_json = bl.to_str()
    with open(os.path.join(out, "bytelevel", "tokenizer.json"), "w", encoding="utf-8") as f:
        f.write(bl_json)
    bl = Tokenizer.from_str(bl_json)
    special = {}
    for name in ("<|im_start|>", "<|endoftext|>"):
        special[name] = {"id": name, "ids": [bl.token_to_id(name)], "tokens": [name]}
    BYTELEVEL_VARIANTS["template"]["post_processor"]["special_tokens"] = special
    extra = ["[SEP]", "a [SEP] b", "a  [SEP]  b", "x[SEP]y", "magic", "a magic b", "amagic", "magical",
             "magic_x", "_magic", "<norm>", "a<norm>b", "<|endoftext|>", "hi<|im_start|>there",
             " [SEP] [SEP]  [SEP] "]
    bl_rows = []
    for name, variant in BYTELEVEL_VARIANTS.items():
        vt = Tokenizer.from_str(apply_variant(bl_json, variant))
        for text in bytelevel_texts(name, cases, extra):
            ids = vt.encode(text, add_special_tokens=False).ids
            row = {"variant": name, "text": text, "ids": ids}
            with_special = vt.encode(text, add_special_tokens=True).ids
            if with_special != ids:
                row["ids_with_special"] = with_special  # absent: same as ids
            decoded = vt.decode(ids, skip_special_tokens=False)
            if decoded != text:
                row["decoded"] = decoded  # absent: same as text
            bl_rows.append(row)
    with open(os.path.join(out, "bytelevel", "variants.json"), "w", encoding="utf-8") as f:
        json.dump(BYTELEVEL_VARIANTS, f, ensure_ascii=False, indent=1)
    write_jsonl(os.path.join(out, "bytelevel", "cases.jsonl"), bl_rows)
    print(f"bytelevel: vocab {bl.get_vocab_size()}, {len(bl_rows)} rows", file=sys.stderr)

    # Single-threaded throughput of tokenizers on the corpus.
    perf = hf_throughput(tok, corpus, args.bench_reps)
    perf["tokenizers_version"] = tokenizers.__version__
    with open(os.path.join(out, "hf_throughput.json"), "w") as f:
        json.dump(perf, f, indent=1)
    print(f"HF tokenizers single-thread encode: whole corpus {perf['whole_MBps']:.2f} MB/s, "
          f"per line {perf['per_line_MBps']:.2f} MB/s", file=sys.stderr)


if __name__ == "__main__":
    main()
