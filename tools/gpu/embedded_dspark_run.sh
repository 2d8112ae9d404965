#!/usr/bin/env bash
# Trains the embedded target's DSpark drafter on the GPU machine and measures it live (#32):
#   1. `specula regen` over the prompts that tools/train/make_regen_prompts.py cut from the
#      corpus's training split (.carry/dspark/regen_prompts.jsonl.xz): the target's own greedy
#      continuations and its tapped hidden states, as shards (a run cut short by its time limit
#      keeps the shards it finished: regen writes each one whole);
#   2. tools/train/train_dspark.py on those shards, under a wall-time budget, exported in bf16;
#   3. `specula bench` on HumanEval's code blocks (.carry/prompts/humaneval.jsonl, copied from
#      ../shared/data/prompts) or else held-out text (.carry/corpus/heldout.txt.xz), with the new
#      drafter and with the shipped assistant.
# Optionally first the CUDA tests (STAGES="tests ..."). Results under $OUT: status.txt, the logs,
# dspark.tgz (the exported drafter: model.safetensors, dspark.json, train_log.jsonl).
#
#   OUT=/tmp/out bash tools/gpu/embedded_dspark_run.sh BIN_DIR
# Environment: STAGES (default "regen train bench"), TEST_FILTER, REGEN_SECONDS (150),
# TRAIN_SECONDS (200), TAPS (2,5,8), BLOCK (8), LAYERS (2), MARKOV_RANK (32), DSPARK_ARGS (extra
# train_dspark.py flags, after the defaults, so they override them; e.g. "--init-from
# models/gemma4-tiny-py-dspark" continues the shipped drafter), ASSISTANT_KS (the assistant's
# draft lengths in the bench, "2 4 6 8").
set -uo pipefail

OUT=${OUT:?set OUT to the folder for logs and results}
STEP_KILL_AFTER=20
source "$(dirname "$0")/lib.sh"
STAGES=${STAGES:-"regen train bench"}
BIN=${1:?give the folder holding specula and specula_cuda_tests}
REGEN_SECONDS=${REGEN_SECONDS:-150}
TRAIN_SECONDS=${TRAIN_SECONDS:-200}
TAPS=${TAPS:-2,5,8}
BLOCK=${BLOCK:-8}
WORK=${WORK:-/tmp/embedded_dspark}
TARGET=models/gemma4-tiny-py

machine_header --print
unpack_bins "$BIN"
SPECULA=$BIN/specula
mkdir -p "$WORK"

if has_stage tests; then
  run_cuda_tests "$BIN/specula_cuda_tests" 300
fi

if has_stage regen; then
  xz -dkc .carry/dspark/regen_prompts.jsonl.xz >"$WORK/prompts.jsonl"
  # timeout's exit is expected: the finished shards are what the trainer reads.
  step regen "$REGEN_SECONDS" regen.log "$SPECULA" regen --model "$TARGET" \
    --prompt-file "$WORK/prompts.jsonl" --out "$WORK/shards" --tap-layers "$TAPS" --device cuda \
    --batch 256 --max-tokens 128 --shard-tokens 262144 --quiet
  note "regen: $(ls "$WORK"/shards/shard_*.safetensors 2>/dev/null | wc -l) shards, $(du -sh "$WORK/shards" | cut -f1)"
  tail -3 "$OUT/regen.log"
fi

if has_stage train; then
  # Sized for models/ (<= 32 MB in all): d 256, 2 layers, Markov rank 32, bf16 export (~4 MB).
  step train $((TRAIN_SECONDS + 90)) train.log python3 tools/train/train_dspark.py \
    --shards "$WORK/shards" --target "$TARGET" --out "$WORK/dspark" --block-size "$BLOCK" \
    --layers "${LAYERS:-2}" --hidden 256 --heads 4 --ffn-mult 2 --markov-rank "${MARKOV_RANK:-32}" --steps 1000000 \
    --max-seconds "$TRAIN_SECONDS" --batch 128 --anchors-per-seq 8 --lr 1e-3 --warmup 200 \
    --eval-every 1000 --log-every 200 --export-dtype bf16 ${DSPARK_ARGS:-}
  grep '"eval"' "$OUT/train.log" | tail -2
  tail -2 "$OUT/train.log"
  tar czf "$OUT/dspark.tgz" -C "$WORK" dspark/model.safetensors dspark/dspark.json dspark/train_log.jsonl
fi

if has_stage bench; then
  # Live, greedy, batch 1: HumanEval's code blocks as completion prompts (issue #32's set) when
  # .carry/prompts/humaneval.jsonl is there, else windows of held-out text.
  if [[ -f .carry/prompts/humaneval.jsonl ]]; then
    set_args=(--prompt-file .carry/prompts/humaneval.jsonl --prompt-format code-block)
  else
    xz -dkc .carry/corpus/heldout.txt.xz >"$WORK/heldout.txt"
    set_args=(--prompt-file "$WORK/heldout.txt" --prompt-tokens 128)
  fi
  common=(bench --model "$TARGET" --device cuda "${set_args[@]}" --gen-tokens 128 --batch 1 --json)
  if [[ -f $WORK/dspark/model.safetensors ]]; then
    step "bench dspark" 120 bench_dspark.log "$SPECULA" "${common[@]}" --draft "$WORK/dspark" -k "$BLOCK"
  fi
  step "bench assistant" 150 bench_assistant.log "$SPECULA" "${common[@]}" \
    --draft models/gemma4-tiny-py-assistant -k ${ASSISTANT_KS:-2 4 6 8}
  for f in bench_dspark bench_assistant; do
    [[ -f $OUT/$f.log ]] && grep -o '"mode":"[a-z]*"\|"tau":[0-9.]*\|"draft_tokens":[0-9]*\|"decode_tokens_per_second":[0-9.]*' \
      "$OUT/$f.log" | paste -sd' ' | sed "s/^/$f: /"
  done
fi

echo "== status"
cat "$STATUS"
