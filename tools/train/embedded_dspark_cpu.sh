#!/usr/bin/env bash
# Trains the embedded target's DSpark drafter on this machine's CPUs and measures it live (#32).
# The shipped models/gemma4-tiny-py-dspark started as this script's output on the 2-core dev VM,
# with the defaults below, and was then continued on a GPU (models/README.md says how, and what it
# measured). tools/gpu/embedded_dspark_run.sh is the same pipeline on the GPU machine.
#
#   bash scripts/setup.sh --train        # Debian's PyTorch + OpenBLAS, once
#   python3 tools/train/build_corpus.py  # .carry/corpus, once (deterministic for the pinned packages)
#   bash tools/train/embedded_dspark_cpu.sh [--install]
#
# Stages (STAGES, default "prompts regen train calibrate bench"):
#   prompts    make_regen_prompts.py: 6000 completion prompts from the corpus's training split
#              (seed 0), and 400 from its validation split for calibration (seed 1);
#   regen      `specula regen` of the first REGEN_PROMPTS training prompts, greedy, 128 tokens each,
#              taps 2,5,8 (resumable: rerunning continues from the ledger);
#   train      train_dspark.py on the CPU: d 256, 2 layers, 4 heads, Markov rank 32, γ 8, for
#              TRAIN_SECONDS of wall time (the cosine schedule runs over that time, so the weights
#              depend on the machine's speed), exported in bf16;
#   calibrate  `specula calibrate` on the validation prompts (pruning thresholds and STS
#              temperatures into dspark.json);
#   bench      `specula bench` greedy at batch 1 on HumanEval's code blocks: the drafter at γ 8,
#              pruned and unpruned, against the shipped assistant at k 2 4 6 8, and plain decoding.
# --install copies the exported drafter to models/gemma4-tiny-py-dspark.
# Environment: WORK (/tmp/embedded_dspark_cpu), REGEN_PROMPTS (2880), TRAIN_SECONDS (3300),
# THREADS (2), SPECULA (build/apps/specula), PYTHON (a python3 that imports torch), INIT_FROM (an
# exported drafter to continue from, e.g. models/gemma4-tiny-py-dspark: train_dspark.py --init-from).
set -euo pipefail

cd "$(dirname "$0")/../.."
STAGES=${STAGES:-"prompts regen train calibrate bench"}
WORK=${WORK:-/tmp/embedded_dspark_cpu}
REGEN_PROMPTS=${REGEN_PROMPTS:-2880}
TRAIN_SECONDS=${TRAIN_SECONDS:-3300}
THREADS=${THREADS:-2}
SPECULA=${SPECULA:-build/apps/specula}
TARGET=models/gemma4-tiny-py
HUMANEVAL=${HUMANEVAL:-../shared/data/prompts/humaneval.jsonl}
install=0
for arg in "$@"; do
  case $arg in
    --install) install=1 ;;
    -h | --help) sed -n '2,26p' "$0"; exit 0 ;;
    *) echo "embedded_dspark_cpu: unknown option '$arg'" >&2; exit 2 ;;
  esac
done
has_stage() { [[ " $STAGES " == *" $1 "* ]]; }

if [[ -z ${PYTHON:-} ]]; then
  # pyenv or a venv may shadow Debian's python3, which is where python3-torch lives.
  for p in python3 /usr/bin/python3; do
    if "$p" -c "import torch" 2>/dev/null; then PYTHON=$p; break; fi
  done
fi
if has_stage train && [[ -z ${PYTHON:-} ]]; then
  echo "embedded_dspark_cpu: no python3 here imports torch; run: bash scripts/setup.sh --train" >&2
  exit 1
fi
[[ -x $SPECULA ]] || { echo "embedded_dspark_cpu: $SPECULA is missing; build first (bash scripts/demo.sh)" >&2; exit 1; }
mkdir -p "$WORK"

if has_stage prompts; then
  [[ -d .carry/corpus ]] || { echo "embedded_dspark_cpu: .carry/corpus is missing; run tools/train/build_corpus.py" >&2; exit 1; }
  python3 tools/train/make_regen_prompts.py --corpus .carry/corpus --split train --count 6000 --seed 0 \
    --out "$WORK/prompts.jsonl"
  python3 tools/train/make_regen_prompts.py --corpus .carry/corpus --split valid --count 400 --seed 1 \
    --out "$WORK/calibration.jsonl"
fi

if has_stage regen; then
  "$SPECULA" regen --model "$TARGET" --prompt-file "$WORK/prompts.jsonl" --max-prompts "$REGEN_PROMPTS" \
    --out "$WORK/shards" --tap-layers 2,5,8 --batch 32 --max-tokens 128 --shard-tokens 131072 -t "$THREADS"
fi

if has_stage train; then
  "$PYTHON" tools/train/train_dspark.py --threads "$THREADS" --shards "$WORK/shards" --target "$TARGET" \
    --out "$WORK/dspark" --block-size 8 --layers 2 --hidden 256 --heads 4 --ffn-mult 2 --markov-rank 32 \
    --steps 1000000 --max-seconds "$TRAIN_SECONDS" --batch 64 --anchors-per-seq 8 --lr 1e-3 --warmup 100 \
    --eval-every 500 --log-every 50 --export-dtype bf16 --device cpu --seed 0 ${INIT_FROM:+--init-from "$INIT_FROM"}
fi

if has_stage calibrate; then
  "$SPECULA" calibrate --model "$TARGET" --draft "$WORK/dspark" --prompt-file "$WORK/calibration.jsonl" \
    --max-tokens 96 -t "$THREADS" --plot "$WORK/calibration.png"
fi

if has_stage bench; then
  common=(bench --model "$TARGET" --prompt-file "$HUMANEVAL" --prompt-format code-block --gen-tokens 128
    --batch 1 -t "$THREADS")
  "$SPECULA" "${common[@]}" --draft "$WORK/dspark" -k 8 --json >"$WORK/bench_dspark.json"
  "$SPECULA" "${common[@]}" --draft "$WORK/dspark" -k 8 --no-draft-prune --json >"$WORK/bench_dspark_unpruned.json"
  "$SPECULA" "${common[@]}" --draft models/gemma4-tiny-py-assistant -k 2 4 6 8 --json >"$WORK/bench_assistant.json"
  for f in bench_dspark bench_dspark_unpruned bench_assistant; do
    grep -o '"mode":"[a-z]*"\|"draft_tokens":[0-9]*\|"tau":[0-9.]*\|"decode_tokens_per_second":[0-9.]*' \
      "$WORK/$f.json" | paste -sd' ' | sed "s/^/$f: /"
  done
fi

if ((install)); then
  dest=models/gemma4-tiny-py-dspark
  mkdir -p "$dest"
  cp "$WORK/dspark/model.safetensors" "$WORK/dspark/dspark.json" "$dest/"
  echo "installed $dest ($(du -sh "$dest" | cut -f1)); models/ is $(du -sh models | cut -f1)"
fi
