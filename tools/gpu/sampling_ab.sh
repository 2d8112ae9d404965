#!/usr/bin/env bash
# Sampled decoding on the GPU machine, device sampling against host sampling
# (bench --host-sampling: logits read back and sampled on the host), in one
# run: the CUDA tests (GTEST_FILTER to narrow them), then `specula bench` end to
# end at temperature > 0 for each preset (random bf16 weights of the released
# shapes, random drafter: tau ~ 1, so the rows measure the cost of sampling)
# and for the embedded family (real tau). A table last; logs and JSON in $OUT.
#
#   OUT=/tmp/out bash tools/gpu/sampling_ab.sh
# Environment:
#   BUILD=build-gpu           build folder holding apps/specula and tests/specula_cuda_tests
#   STAGES="tests bench"      stages to run
#   GTEST_FILTER=*            CUDA tests to run
#   PRESETS="31b e2b"         random-weight presets
#   BATCHES="1 8 32" KS="4"   bench batch sizes and draft lengths (device sampling)
#   HOST_BATCHES="1 8"        batch sizes of the host-sampling rows (slow: logits read back)
#   SAMPLING="--temperature 0.8 --top-p 0.95"
#   GEN=64                    tokens generated per row
set -uo pipefail

OUT=${OUT:?set OUT to the folder for logs and results}
source "$(dirname "$0")/lib.sh"
BUILD=${BUILD:-build-gpu}
STAGES=${STAGES:-"tests bench"}
PRESETS=${PRESETS-"31b e2b"}
BATCHES=${BATCHES:-"1 8 32"}
HOST_BATCHES=${HOST_BATCHES:-"1 8"}
KS=${KS:-4}
SAMPLING=${SAMPLING:-"--temperature 0.8 --top-p 0.95"}
GEN=${GEN:-64}
SPECULA=$BUILD/apps/specula

machine_header

if has_stage tests; then
  t0=$SECONDS
  timeout --kill-after=30 "${TEST_TIMEOUT:-420}" "$BUILD/tests/specula_cuda_tests" \
    --gtest_filter="${GTEST_FILTER:-*}" --gtest_output="json:$OUT/cuda_tests.json" \
    >"$OUT/cuda_tests.log" 2>&1
  rc=$?
  note "cuda tests: exit $rc, $((SECONDS - t0)) s; $(grep -E '^\[  (PASSED|FAILED)' "$OUT/cuda_tests.log" | tr '\n' ' ')"
  grep -E '^\[  FAILED|sampling \]' "$OUT/cuda_tests.log" | head -40 | tee -a "$STATUS"
fi

# bench_row NAME ARGS...: one `specula bench --json` run into $OUT/NAME.json.
bench_row() {
  local name=$1
  shift
  local t0=$SECONDS
  timeout --kill-after=30 "${BENCH_TIMEOUT:-300}" "$SPECULA" bench --device cuda --json "$@" \
    >"$OUT/$name.json" 2>"$OUT/$name.log"
  note "bench $name: exit $?, $((SECONDS - t0)) s"
}

if has_stage bench; then
  for p in $PRESETS; do
    for where in device host; do
      extra=()
      batches=$BATCHES
      [[ $where == host ]] && extra=(--host-sampling) && batches=$HOST_BATCHES
      # shellcheck disable=SC2086
      bench_row "${p}_$where" --random-weights "$p" --draft random --prompt-tokens 64 \
        --gen-tokens "$GEN" --batch $batches -k $KS $SAMPLING "${extra[@]}"
    done
  done
  for where in device host; do
    extra=()
    [[ $where == host ]] && extra=(--host-sampling)
    # shellcheck disable=SC2086
    bench_row "embedded_$where" --prompt-file tools/golden/make_golden.py --prompt-tokens 128 \
      --gen-tokens 128 --batch 1 4 -k 2 4 $SAMPLING "${extra[@]}"
  done
  python3 - "$OUT" <<'EOF'
import json, pathlib, sys
out = pathlib.Path(sys.argv[1])
rows = {}
for f in sorted(out.glob("*_device.json")) + sorted(out.glob("*_host.json")):
    name, where = f.stem.rsplit("_", 1)
    try:
        data = json.loads(f.read_text().strip().splitlines()[-1])
    except Exception:
        continue
    for r in data["results"]:
        rows.setdefault((name, r["batch"], r["mode"], r["draft_tokens"]), {})[where] = r
print(f"{'model':<10} {'batch':>5} {'mode':<12} {'k':>2} {'host t/s':>9} {'device t/s':>10} {'ratio':>6} {'tau':>5}")
for (name, batch, mode, k), v in sorted(rows.items()):
    h = v.get("host", {}).get("decode_tokens_per_second", 0)
    d = v.get("device", {}).get("decode_tokens_per_second", 0)
    tau = v.get("device", v.get("host", {})).get("tau", 0)
    print(f"{name:<10} {batch:>5} {mode:<12} {k:>2} {h:>9.1f} {d:>10.1f} {d / h if h else 0:>5.2f}x {tau:>5.2f}")
EOF
fi
cat "$STATUS"
