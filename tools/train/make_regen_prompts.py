#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
"""Cuts completion prompts for `specula regen` out of one split of build_corpus.py's corpus.

Each prompt is a run of whole lines of one file: a file drawn uniformly from the split's files with
at least --min-lines lines, a start line drawn uniformly, and a length drawn uniformly from
[--min-lines, --max-lines]. Blank-only runs are drawn again. Deterministic for a given corpus and
--seed. Writes JSONL in DeepSpec's layout ({"turns": [text]}), which `specula regen --prompt-file`
reads (the first turn as plain text with BOS).

    python3 tools/train/make_regen_prompts.py --corpus .carry/corpus --split train --count 6000 \\
        --out .carry/regen_prompts.jsonl

Standard library only. The held-out split is never a default: drafters train on train only.
"""

import argparse
import json
import os
import random
import sys

from corpus_io import read_manifest, read_split


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--corpus", default=".carry/corpus")
    ap.add_argument("--split", default="train", choices=("train", "valid", "heldout"))
    ap.add_argument("--count", type=int, default=6000)
    ap.add_argument("--min-lines", type=int, default=8)
    ap.add_argument("--max-lines", type=int, default=32)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    if a.count < 1 or not 1 <= a.min_lines <= a.max_lines:
        sys.exit(f"make_regen_prompts: need --count >= 1 and 1 <= --min-lines <= --max-lines "
                 f"(got {a.count}, {a.min_lines}, {a.max_lines})")
    texts, _ = read_split(a.corpus, read_manifest(a.corpus), a.split)
    files = [t.split("\n") for t in texts]
    files = [lines for lines in files if len(lines) >= a.min_lines]
    if not files:
        sys.exit(f"make_regen_prompts: no file of the {a.split} split has {a.min_lines} lines")
    rng = random.Random(a.seed)
    out = []
    while len(out) < a.count:
        lines = files[rng.randrange(len(files))]
        n = rng.randint(a.min_lines, min(a.max_lines, len(lines)))
        start = rng.randrange(len(lines) - n + 1)
        text = "\n".join(lines[start:start + n]) + "\n"
        if text.strip():
            out.append(text)
    tmp = a.out + ".tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        for text in out:
            f.write(json.dumps({"turns": [text]}, ensure_ascii=False) + "\n")
    os.replace(tmp, a.out)
    print(f"make_regen_prompts: {len(out)} prompts from {len(files)} {a.split} files -> {a.out}")


if __name__ == "__main__":
    main()
