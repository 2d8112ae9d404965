#!/usr/bin/env bash
# CPU benchmark of plain vs speculative decoding with `specula bench`, on the
# embedded family (prompts cut from held-out Python files) and on the golden
# fixtures (random weights: acceptance is low there by construction).
# Usage: bench/run_cpu.sh [BUILD_DIR]   Run it on a quiet machine.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
build=${1:-$root/build}
specula=$build/apps/specula
[[ -x $specula ]] || { echo "build first: scripts/build.sh" >&2; exit 1; }
echo "# $(date -u +%Y-%m-%dT%H:%MZ) $(git -C "$root" rev-parse --short HEAD) $(nproc) cores: $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2 | xargs)"
if [[ -d $root/models/gemma4-tiny-py ]]; then
  # The held-out split of the training corpus (files the models never saw),
  # rebuilt by the same deterministic script that made the training data.
  corpus=$(mktemp -d)
  python3 "$root/tools/train/build_corpus.py" --out "$corpus" >/dev/null
  heldout=$corpus/heldout.txt
  echo "## embedded family (gemma4-tiny-py + assistant), greedy, 128-token prompts, 128 new tokens"
  "$specula" bench --prompt-file "$heldout" --prompt-tokens 128 --gen-tokens 128 --batch 1 4 -k 1 2 3 4 6 2>/dev/null
  rm -rf "$corpus"
fi
for pair in "e2b_like e2b_like_assistant" "dense_kev dense_kev_assistant"; do
  set -- $pair
  echo "## fixture $1 + $2 (random weights), greedy, 32-token prompts, 64 new tokens"
  "$specula" bench --model "$root/tests/golden/$1" --draft "$root/tests/golden/$2" --prompt-tokens 32 --gen-tokens 64 \
    --batch 1 8 -k 1 4 2>/dev/null
done
