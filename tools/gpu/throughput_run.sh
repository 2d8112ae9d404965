#!/usr/bin/env bash
# One GPU run for batched throughput (#30): the CUDA tests, then `bench --micro`
# on the 31B shape at batch 1 8 16 32 64 with a bf16 and an fp8 KV cache (each
# step against its limit max(bytes / copy, flops / peak), with a verify window of
# every batch), the same with each CUDA kernel choice under measurement (A/B
# switches: tiled products, raw bf16 attention staging), kernel traces of the
# batch-8 and batch-64 steps, and the smaller presets
# (E2B, E4B, 26B-A4B) at batch 1 and 8 with their cache capacity. A summary
# table last; logs and JSON under $OUT in throughput_logs.tgz (the device tool brings
# back 8 files at most).
#
#   OUT=/tmp/out bash tools/gpu/throughput_run.sh BIN_DIR
# BIN_DIR holds specula and specula_cuda_tests (or their .xz; tools/gpu/pack_bins.sh).
# Environment: STAGES="tests micro choices trace presets" (any subset), TEST_FILTER
# (gtest filter), BATCHES (31B batches, default "1 8 16 32 64"; a batch whose caches
# cannot fit the card is skipped and named in the JSON), TRACE_BATCHES (31B batches
# traced kernel by kernel, default "8 64"), CHOICES (the choices stage's A/B switches
# of backends.h CudaKernelChoices: "tiled raw both"), CHOICE_KVS (their cache dtypes,
# "bf16"), TRACE_FLAGS (extra bench flags of the traced runs, e.g. a choice).
set -uo pipefail

OUT=${OUT:?set OUT to the folder for logs and results}
STEP_KILL_AFTER=20
source "$(dirname "$0")/lib.sh"
STAGES=${STAGES:-"tests micro choices trace presets"}
BATCHES=${BATCHES:-"1 8 16 32 64"}
TRACE_BATCHES=${TRACE_BATCHES:-"8 64"}
CHOICES=${CHOICES:-"tiled raw both"}
CHOICE_KVS=${CHOICE_KVS:-"bf16"}
BIN=${1:?usage: throughput_run.sh BIN_DIR}

machine_header --print
use_bins "$BIN"

if has_stage tests; then
  run_cuda_tests "$TESTS" 330
fi

if has_stage micro; then
  for kv in bf16 fp8; do
    # shellcheck disable=SC2086
    step "micro 31b $kv" 300 "micro_31b_$kv.log" bash -c "'$SPECULA' bench --device cuda \
      --random-weights 31b --micro --no-draft --batch $BATCHES --reps 5 --kv-dtype $kv \
      --json >'$OUT/micro_31b_$kv.json'"
  done
fi

if has_stage choices; then
  # The CUDA kernel choices under measurement (backends.h), each against the
  # micro stage's default kernels: micro_31b_<kv>_<choice>.json.
  for kv in $CHOICE_KVS; do
    for c in $CHOICES; do
      case $c in
        tiled) flags="--cuda-tiled-products" ;;
        raw) flags="--cuda-raw-kv-staging" ;;
        both) flags="--cuda-tiled-products --cuda-raw-kv-staging" ;;
        *) note "unknown choice $c (tiled, raw, both)"; continue ;;
      esac
      # shellcheck disable=SC2086
      step "micro 31b $kv $c" 300 "micro_31b_${kv}_$c.log" bash -c "'$SPECULA' bench --device cuda \
        --random-weights 31b --micro --no-draft --batch $BATCHES --reps 5 --kv-dtype $kv $flags \
        --json >'$OUT/micro_31b_${kv}_$c.json'"
    done
  done
fi

if has_stage trace; then
  for b in $TRACE_BATCHES; do
    step "trace 31b batch $b" 200 "trace_31b_b$b.log" env TRACE_OUT="$OUT/trace_31b_b$b.csv" \
      bash "$(dirname "$0")/kernel_trace.sh" "$SPECULA" bench --device cuda --random-weights 31b \
      --micro --no-draft --batch "$b" --reps 3 --prefill-tokens 64 ${TRACE_FLAGS:-}
  done
fi

if has_stage presets; then
  for p in e2b e4b 26b-a4b; do
    step "micro $p" 200 "micro_$p.log" bash -c "'$SPECULA' bench --device cuda --random-weights $p \
      --micro --draft random --batch 1 8 --reps 5 --json >'$OUT/micro_$p.json'"
  done
fi

echo
echo "== summary (step ms, fraction of the step limit, verify window / step)"
for f in "$OUT"/micro_*.json; do
  [[ -s $f ]] || continue
  jq -r --arg name "$(basename "$f" .json)" '.micro as $m |
    ($m.kv_cache.tokens_that_fit | tostring) as $fit |
    $m.decode[] | [$name, .batch, (.step_ms * 1000 | round / 1000),
      ((.limit_fraction * 1000 | round) / 10 | tostring + "%"), .bound,
      ((.verify.ratio * 1000 | round) / 1000), $fit] | @tsv' "$f" 2>/dev/null
done | { if command -v column >/dev/null; then
  column -t -N "run,batch,step_ms,of_limit,bound,verify/step,kv_tokens_fit"
else  # the GPU machine has no column(1)
  echo "run batch step_ms of_limit bound verify/step kv_tokens_fit"; cat
fi; }
for f in "$OUT"/micro_*.json; do
  [[ -s $f ]] || continue
  jq -r --arg name "$(basename "$f" .json)" \
    '.micro.skipped_batches[]? | "-- \($name) batch \(.batch) skipped: \(.reason)"' "$f"
done
for f in "$OUT"/micro_*.json; do
  [[ -s $f ]] || continue
  echo "-- $(basename "$f" .json) goals"
  jq -r '.micro.goals[] | "  \(.goal): \(.value * 1000 | round / 1000) (\(.target)) \(if .met then "met" else "NOT met" end)"' "$f"
done
cat "$STATUS"
# The device tool brings back at most 8 files: one archive of the logs and
# JSON (the kernel CSVs are large; their breakdowns are in the trace logs).
tar czf "$OUT/throughput_logs.tgz" -C "$OUT" --exclude='*.csv' --exclude=throughput_logs.tgz .
find "$OUT" -maxdepth 1 -type f ! -name throughput_logs.tgz -delete
