#!/usr/bin/env bash
# One GPU run for DSpark (#31) and the CUDA hardening items (#34): the CUDA
# test suite (DSpark parity and lossless tests, f32 golden generation), the
# cost of a DSpark round against a 31B decode step for both layouts, and the
# compute-sanitizer stage of run_gpu.sh. A summary table last; logs and JSON
# under $OUT.
#
#   OUT=/tmp/out bash tools/gpu/dspark_run.sh BIN_DIR
# BIN_DIR holds specula and specula_cuda_tests (or their .xz; tools/gpu/pack_bins.sh), built with
# -DSPECULA_CUDA=ON for sm_90a (here or elsewhere: binaries built in another
# checkout find models and fixtures through their compiled-in source path,
# which is linked to this checkout when missing).
# Environment: STAGES="tests cost smoke sanitizer" (any subset), TEST_FILTER (gtest
# filter), DRAFTS (the --draft values of the cost stage), SANITIZER_TOOLS.
set -uo pipefail

OUT=${OUT:?set OUT to the folder for logs and results}
STEP_KILL_AFTER=20
source "$(dirname "$0")/lib.sh"
STAGES=${STAGES:-"tests cost"}
DRAFTS=${DRAFTS:-"random-dspark:5 random-dspark:8 random-dspark-deepspec:5 random-dspark-deepspec:8"}
BIN=${1:?give the folder holding specula and specula_cuda_tests}

machine_header --print

use_bins "$BIN"

if has_stage tests; then
  run_cuda_tests "$TESTS" 420
fi

if has_stage cost; then
  # A DSpark round (backbone + γ head steps, batch 1, device chain) against a
  # 31B decode step at context 512, random bf16 weights.
  # DRAFT@DTYPE (e.g. random-dspark:8@int8): the drafter quantized to DTYPE (--draft-dtype).
  for d in $DRAFTS; do
    name=${d//[:@]/_}
    draft=${d%%@*}
    dtype_arg=""
    [[ $d == *@* ]] && dtype_arg="--draft-dtype ${d##*@}"
    step "cost $d" 240 "cost_$name.log" bash -c "'$SPECULA' bench --device cuda \
      --random-weights 31b --micro --batch 1 --prefill-tokens 256 --reps 20 --gen-tokens 32 \
      --draft $draft $dtype_arg --json >'$OUT/cost_$name.json'"
  done
fi

if has_stage smoke; then
  # The PyTorch DSpark trainer end to end on tiny shards (tests/cli/train_smoke.sh).
  step "train smoke" 240 train_smoke.log bash tests/cli/train_smoke.sh "$SPECULA" "$PWD"
  cat "$OUT/train_smoke.log"  # one line per check; a failure with its output's last lines
fi

if has_stage sanitizer; then
  # run_gpu.sh's stage, on these binaries.
  mkdir -p build-gpu/apps build-gpu/tests
  ln -sf "$PWD/$SPECULA" build-gpu/apps/specula
  ln -sf "$PWD/$TESTS" build-gpu/tests/specula_cuda_tests
  SKIP_BUILD=1 STAGES=sanitizer OUT=$OUT bash tools/gpu/run_gpu.sh >"$OUT/sanitizer_run.log" 2>&1
  note "sanitizer stage: exit $?"
fi

echo
echo "== summary"
cat "$STATUS"
if has_stage tests && [[ -s $OUT/cuda_tests.json ]]; then
  python3 - "$OUT/cuda_tests.json" <<'PY'
import json, sys
j = json.load(open(sys.argv[1]))
failed = [f"{s['name']}.{t['name']}" for s in j["testsuites"] for t in s["testsuite"]
          if t.get("failures")]
print(f"cuda tests: {j['tests']} run, {j['failures']} failed, {j.get('disabled', 0)} disabled")
for f in failed[:30]:
    print("  FAILED", f)
PY
fi
if has_stage cost; then
  python3 - "$OUT" $DRAFTS <<'PY'
import json, os, sys
out = sys.argv[1]
print(f"{'drafter':<28} {'GB':>6} {'round ms':>9} {'step0 ms':>9} {'head ms':>8} {'decode ms':>10} {'ratio':>7}  e2e tau / speedup")
for d in sys.argv[2:]:
    p = os.path.join(out, "cost_" + d.replace(":", "_").replace("@", "_") + ".json")
    try:
        j = json.load(open(p))
    except Exception as e:  # noqa: BLE001
        print(f"{d:<28} (no result: {type(e).__name__})")
        continue
    r = j["micro"].get("drafter") or {}
    e2e = [x for x in j.get("results", []) if x.get("mode") == "speculative"]
    e = e2e[0] if e2e else {}
    print(f"{d:<28} {r.get('weight_bytes', 0) / 1e9:>6.2f} {r.get('round_ms', 0):>9.3f} "
          f"{r.get('backbone_ms', 0):>9.3f} {r.get('head_step_ms', 0):>8.3f} "
          f"{r.get('target_step_ms', 0):>10.3f} {100 * r.get('ratio', 0):>6.2f}%  "
          f"{e.get('tau', '-')} / {e.get('speedup', '-')}")
PY
fi
if [[ -s $OUT/sanitizer_summary.txt ]]; then
  echo "compute-sanitizer:"
  cat "$OUT/sanitizer_summary.txt"
fi
