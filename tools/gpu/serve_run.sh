#!/usr/bin/env bash
# One GPU run for the server (#29): the CUDA tests named by TEST_FILTER, then
# `specula serve` on the 31B shape with random weights, loaded by
# `specula bench-serve` at concurrency 1, 8, 32 and 64, without speculation and
# with the replay drafter (SIMULATED acceptance: random weights accept nothing,
# so the replay stands in for a trained drafter's acceptance profile).
# A summary table last; logs and JSON under $OUT.
#
#   OUT=/tmp/out TOKENIZER=/path/tokenizer.json bash tools/gpu/serve_run.sh [BIN_DIR]
# BIN_DIR holds specula and specula_cuda_tests (or their .xz), built with
# -DSPECULA_CUDA=ON for sm_90a. TOKENIZER: a 262,144-token Gemma tokenizer.json
# (scripts/fetch_test_data.sh caches one) so the random model's ids decode.
# Environment: PROFILE (replay acceptance, default 0.84,0.60,0.39,0.27),
# NUM_PROMPTS (per phase, default 32), MAX_TOKENS (default 64), CONC (default
# 1,8,32,64), TEST_FILTER (gtest filter; empty skips the tests), STAGES
# ("nospec replay", any subset).
set -uo pipefail

OUT=${OUT:?set OUT to the folder for logs and results}
TOKENIZER=${TOKENIZER:?set TOKENIZER to a Gemma tokenizer.json}
source "$(dirname "$0")/lib.sh"
BIN=${1:-build-gpu}
PROFILE=${PROFILE:-0.84,0.60,0.39,0.27}
NUM_PROMPTS=${NUM_PROMPTS:-32}
MAX_TOKENS=${MAX_TOKENS:-64}
CONC=${CONC:-1,8,32,64}
TEST_FILTER=${TEST_FILTER-}

for b in specula specula_cuda_tests; do
  [[ -f $BIN/$b.xz && ! -f $BIN/$b ]] && xz -dkf "$BIN/$b.xz"
done
SPECULA=$BIN/specula
machine_header --print

if [[ -n $TEST_FILTER && -x $BIN/specula_cuda_tests ]]; then
  timeout 300 "$BIN/specula_cuda_tests" --gtest_filter="$TEST_FILTER" >"$OUT/cuda_tests.log" 2>&1
  note "cuda tests ($TEST_FILTER): exit $? ($(grep -E '^\[  (PASSED|FAILED)' "$OUT/cuda_tests.log" | tr '\n' ' '))"
fi

# Starts the server with the given flags, waits for its "on http://" line,
# runs the load, stops the server with SIGTERM (checking a clean exit).
serve_and_load() {
  local name=$1
  shift
  local log=$OUT/serve_$name.log
  "$SPECULA" serve --device cuda --random-weights 31b --tokenizer "$TOKENIZER" --port 0 \
    --max-num-seqs 64 --kv-memory 0.85 -c 2048 --disable-log-requests "$@" >"$log" 2>&1 &
  local pid=$!
  local port=""
  for _ in $(seq 1 600); do
    port=$(grep -oE 'on http://127\.0\.0\.1:[0-9]+' "$log" | grep -oE '[0-9]+$' | head -1)
    [[ -n $port ]] && break
    kill -0 $pid 2>/dev/null || break
    sleep 0.5
  done
  if [[ -z $port ]]; then
    note "$name: the server did not start (log serve_$name.log)"
    tail -5 "$log"
    kill $pid 2>/dev/null
    return 1
  fi
  head -12 "$log" | grep -E "specula serve|note|target|drafter" | sed "s/^/  [$name] /"
  if [[ $name == replay* ]]; then
    # The replay drafter replays the greedy output of prompts it has seen
    # finish: one unmeasured pass over the same prompts teaches it.
    timeout 300 "$SPECULA" bench-serve --port "$port" --max-concurrency 64 \
      --num-prompts "$NUM_PROMPTS" --max-tokens "$MAX_TOKENS" --random-input-len 64 \
      --duration-limit 120 >"$OUT/warmup_$name.txt" 2>&1
    note "$name: warm-up pass exit $?"
  fi
  timeout 400 "$SPECULA" bench-serve --port "$port" --max-concurrency "$CONC" \
    --num-prompts "$NUM_PROMPTS" --max-tokens "$MAX_TOKENS" --random-input-len 64 \
    --duration-limit 120 --json "$OUT/load_$name.json" >"$OUT/load_$name.txt" 2>&1
  note "$name: bench-serve exit $?"
  curl -s "http://127.0.0.1:$port/metrics" >"$OUT/metrics_$name.txt" 2>/dev/null
  kill -TERM $pid
  wait $pid
  note "$name: server exit $? after SIGTERM"
  cat "$OUT/load_$name.txt"
}

STAGES=${STAGES:-"nospec replay"}
[[ " $STAGES " == *" nospec "* ]] && serve_and_load nospec --no-draft
[[ " $STAGES " == *" replay "* ]] && serve_and_load replay --draft "replay:$PROFILE" -k 4

echo "== summary" | tee -a "$STATUS"
for f in "$OUT"/load_*.txt; do
  echo "-- $(basename "$f" .txt)"
  grep -E '^ +conc|^ +[0-9]+ ' "$f"
done | tee -a "$STATUS"
