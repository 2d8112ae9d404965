#!/usr/bin/env bash
# Trains the embedded default family (tools/train/train_family.py) on the GPU machine from the
# corpus that tools/train/build_corpus.py wrote under .carry/corpus/ (carry ".carry/corpus").
# Results under $OUT: status.json, family.tgz.partNN (models/ + tests/golden/embedded/; restore with
# `cat family.tgz.part* | tar xzf -` in the repository root) and train.log. The archive has no
# models/gemma4-tiny-py-dspark: that drafter was trained on the previous target's hidden states, so
# after restoring, `git rm -r models/gemma4-tiny-py-dspark` and retrain it
# (tools/train/embedded_dspark_cpu.sh --install).
#   OUT=/tmp/o bash tools/gpu/family_run.sh [extra train_family.py flags]
set -uo pipefail
: "${OUT:?set OUT}"
mkdir -p "$OUT"
python3 tools/train/train_family.py --corpus .carry/corpus --out . --pack-dir "$OUT" \
  --baseline models/gemma4-tiny-py --batch 128 --tokenizer-max-chars 1e7 \
  --target-minutes 5.5 --drafter-minutes 2.0 --deadline-seconds 560 "$@" 2>&1 | tee "$OUT/train.log" | tail -40
