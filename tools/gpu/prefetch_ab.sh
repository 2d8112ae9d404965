#!/usr/bin/env bash
# The L2 prefetch experiment, ready for a session with a GPU: the fused
# attention kernel brings the head of the o_proj weights into L2 while it runs
# (AttentionParams::next_weight, SPECULA_L2_PREFETCH_STEPS; off by default until
# this has been measured). One script: the CUDA tests that cover the fused path
# with the prefetch on, then same-run A/B of decode steps and verify windows,
# prefetch off (A) against on (B), on the 31B and E2B shapes; tables last.
#
#   OUT=/tmp/out bash tools/gpu/prefetch_ab.sh
# Environment:
#   SPECULA=build-gpu/apps/specula  TESTS=build-gpu/tests/specula_cuda_tests
#   STEPS="8 16"    prefetch depths to try against 0
#   PRESETS="31b e2b"  ROUNDS=3
set -uo pipefail

OUT=${OUT:?set OUT to the folder for logs and results}
SPECULA=${SPECULA:-build-gpu/apps/specula}
TESTS=${TESTS:-build-gpu/tests/specula_cuda_tests}
STEPS=${STEPS:-"8 16"}
PRESETS=${PRESETS:-"31b e2b"}
ROUNDS=${ROUNDS:-3}
here=$(cd "$(dirname "$0")" && pwd)
mkdir -p "$OUT"

for steps in $STEPS; do
  SPECULA_L2_PREFETCH_STEPS=$steps timeout 300 "$TESTS" \
    --gtest_filter='*AttentionFused*:*CudaSpeculation*:*CudaGolden*:*CudaSteadyState*' \
    >"$OUT/tests_steps$steps.log" 2>&1
  echo "tests with SPECULA_L2_PREFETCH_STEPS=$steps: exit $? ($(grep -c '^\[       OK' \
    "$OUT/tests_steps$steps.log") ok, $(grep -c '^\[  FAILED  \] [A-Z]' \
    "$OUT/tests_steps$steps.log") failed; log tests_steps$steps.log)"
done

for preset in $PRESETS; do
  for steps in $STEPS; do
    echo "== $preset: prefetch 0 (A) against $steps (B)"
    OUT=$OUT/${preset}_steps$steps PRESET=$preset ROUNDS=$ROUNDS \
      ENV_A="SPECULA_L2_PREFETCH_STEPS=0" ENV_B="SPECULA_L2_PREFETCH_STEPS=$steps" \
      BENCH_ARGS="--batch 1 --reps 7 --prefill-tokens 64 --no-draft" \
      bash "$here/ab.sh" "$SPECULA" "$SPECULA" 2>"$OUT/${preset}_steps$steps.stderr" ||
      echo "ab.sh failed: see $OUT/${preset}_steps$steps.stderr"
  done
done
