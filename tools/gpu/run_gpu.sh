#!/usr/bin/env bash
# One run of the CUDA backend on the GPU machine: build, cross-backend tests,
# `specula bench --micro` on random-weight models of released shapes, and the
# PyTorch/transformers baseline of the same shapes; a summary table last.
#
# Run from the repository root with $OUT set (logs and JSON land there):
#   OUT=/tmp/out bash tools/gpu/run_gpu.sh
# Environment:
#   STAGES="tests bench torch"  stages to run (any subset of tests sanitizer bench torch, in this
#                               order; "none" only builds)
#   PRESETS="31b"               presets for bench and torch (e2b e4b 31b 26b-a4b)
#   SKIP_BUILD=1                reuse an existing build-gpu/ (else configure + build)
#   DRAFT=random                drafter for bench (empty: none)
#   DEVICE=cuda                 device for bench
#   BENCH_ARGS="..."            extra `specula bench` arguments (e.g. "--reps 20 --batch 1 8")
#   TORCH_ARGS="..."            extra tools/gpu/torch_bench.py arguments
#   BUILD_TIMEOUT=1500 TEST_TIMEOUT=300 BENCH_TIMEOUT=300 TORCH_TIMEOUT=400   seconds per step
# Where one command may run at most 10 minutes, build first (STAGES=none), then run the
# stages in separate calls with SKIP_BUILD=1.
#
# The sanitizer stage runs the CUDA test binary under compute-sanitizer, once per tool, each
# on its own gtest filter (what the tool is for, sized to stay within a few minutes on an
# H200; the tools slow kernels 10-100x):
#   memcheck   out-of-bounds and misaligned accesses, API errors: every test but the
#              statistical sampling runs and the engine-under-load schedules
#   racecheck  shared-memory hazards: the kernel tests (ops against the CPU)
#   synccheck  invalid barriers / warp-synchronous primitives: the kernel tests
#   initcheck  reads of uninitialised device memory: the model tests (forwards, graphs,
#              speculation, device sampling)
# Each tool's output (sanitizer and gtest) goes to $OUT/sanitizer_<tool>.log, its gtest
# report to $OUT/sanitizer_<tool>.json, and one line per tool to $OUT/sanitizer_summary.txt
# (printed at the end): the sanitizer's error count, tests run and failed, exit status
# (99: the sanitizer reported errors). Environment:
#   SANITIZER_TOOLS="memcheck racecheck synccheck initcheck"   tools to run (a subset; one
#                               per call where a command may run at most 10 minutes)
#   SANITIZER_FILTER_<TOOL>="..."  a gtest filter replacing the tool's default
#                               (e.g. SANITIZER_FILTER_MEMCHECK='*' for the whole suite)
#   SANITIZER_ARGS="..."        extra compute-sanitizer arguments for every tool
#   SANITIZER_TIMEOUT=540       seconds per tool (per shard)
#   SANITIZER_SHARDS=1          gtest shards run in parallel, one sanitizer process each
#   COMPUTE_SANITIZER=...       the binary (default: on PATH, else /usr/local/cuda/bin)
# e.g. SKIP_BUILD=1 STAGES=sanitizer SANITIZER_TOOLS=memcheck OUT=/tmp/out bash tools/gpu/run_gpu.sh
set -uo pipefail

OUT=${OUT:?set OUT to the folder for logs and results}
source "$(dirname "$0")/lib.sh"
STAGES=${STAGES:-"tests bench torch"}
PRESETS=${PRESETS:-31b}
DRAFT=${DRAFT-random}
DEVICE=${DEVICE:-cuda}
BENCH_ARGS=${BENCH_ARGS:-}
TORCH_ARGS=${TORCH_ARGS:-}
BUILD=build-gpu
SPECULA=$BUILD/apps/specula

machine_header

if [[ ${SKIP_BUILD:-0} == 1 && -x $SPECULA ]]; then
  note "build: skipped (SKIP_BUILD=1, $BUILD exists)"
else
  step configure 600 configure.log cmake -S . -B "$BUILD" -G Ninja -DCMAKE_BUILD_TYPE=Release \
    -DSPECULA_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES=90a &&
    step build "${BUILD_TIMEOUT:-1500}" build.log \
      cmake --build "$BUILD" -j "$(nproc)" --target specula specula_cuda_tests
  if [[ ! -x $SPECULA ]]; then
    tail -40 "$OUT/build.log" "$OUT/configure.log" 2>/dev/null
    note "no $SPECULA: stopping"
    exit 1
  fi
fi

if has_stage tests; then
  step cuda_tests "${TEST_TIMEOUT:-300}" cuda_tests.log "$BUILD/tests/specula_cuda_tests" \
    --gtest_output="json:$OUT/cuda_tests.json"
fi

if has_stage sanitizer; then
  # Default filters (see the top of the file); a leading * also matches parameterised
  # tests ("Shapes/CudaLinear.MatchesCpu/3"). Kernel tests: every op against the CPU.
  kernel_tests='*CudaLinear*:*CudaEmbedding*:*CudaAttention*:*CudaElementwise.*:*CudaFused.*'
  kernel_tests+=':*CudaMoe.*:*CudaSampling.*:*CudaLogprobs.*:*CudaPdlOrder.*'
  model_tests='*CudaGolden*:*CudaSpeculation*:*CudaGraphs.*:*CudaDraftGraphs.*:*CudaSteadyState.*'
  model_tests+=':*CudaTaps.*:*CudaEmbedded.*:*CudaDeviceSampling.*:*CudaDeviceSamplingPenalties.*'
  model_tests+=':*CudaDSpark*:*CudaGoldenGeneration*'
  declare -A filter=(
    [memcheck]='*-*CudaDeviceSamplingDistribution.*:*CudaEngineUnderLoad.*'
    [racecheck]=$kernel_tests
    [synccheck]=$kernel_tests
    [initcheck]=$model_tests
  )
  # memcheck: no kernel calls malloc, so there is no device heap to check; leaks are not
  # checked (the backends keep their pools until the process ends).
  declare -A tool_args=(
    [memcheck]='--check-device-heap no'
    [racecheck]='--racecheck-report hazard'
    [synccheck]=''
    [initcheck]=''
  )
  sanitizer=${COMPUTE_SANITIZER:-$(command -v compute-sanitizer ||
    echo /usr/local/cuda/bin/compute-sanitizer)}
  summary=$OUT/sanitizer_summary.txt
  : >"$summary"
  [[ -x $sanitizer ]] || note "sanitizer: no compute-sanitizer ($sanitizer): stage skipped"
  for tool in ${SANITIZER_TOOLS:-memcheck racecheck synccheck initcheck}; do
    [[ -x $sanitizer ]] || break
    if [[ -z ${filter[$tool]+x} ]]; then
      note "sanitizer: unknown tool '$tool' (memcheck racecheck synccheck initcheck)"
      continue
    fi
    override=SANITIZER_FILTER_${tool^^}
    tool_filter=${!override:-${filter[$tool]}}
    shards=${SANITIZER_SHARDS:-1}
    t0=$SECONDS
    # SANITIZER_SHARDS > 1: gtest's own sharding, one sanitizer process per shard, all at
    # once (the tools are slow mostly on the host side, which has cores to spare).
    for ((i = 0; i < shards; ++i)); do
      sfx=$tool
      ((shards > 1)) && sfx=${tool}_$i
      rm -f "$OUT/sanitizer_$sfx.json"
      # shellcheck disable=SC2086  # tool_args and SANITIZER_ARGS are lists of arguments
      GTEST_TOTAL_SHARDS=$shards GTEST_SHARD_INDEX=$i \
        step "sanitizer $sfx" "${SANITIZER_TIMEOUT:-540}" "sanitizer_$sfx.log" \
        "$sanitizer" --tool "$tool" --error-exitcode 99 --print-limit 50 ${tool_args[$tool]} \
        ${SANITIZER_ARGS:-} "$BUILD/tests/specula_cuda_tests" --gtest_filter="$tool_filter" \
        --gtest_output="json:$OUT/sanitizer_$sfx.json" &
    done
    wait
    for ((i = 0; i < shards; ++i)); do
      sfx=$tool
      ((shards > 1)) && sfx=${tool}_$i
      log=$OUT/sanitizer_$sfx.log
      # memcheck, synccheck, initcheck end with "ERROR SUMMARY: N errors"; racecheck with
      # "RACECHECK SUMMARY: N hazards displayed (E errors, W warnings)".
      found=$(grep -hoE '(ERROR SUMMARY: [0-9]+ errors?|RACECHECK SUMMARY: .*)' "$log" | tail -1)
      # The gtest report is written at the end only; a shard stopped at its limit still
      # counts the tests it finished from the log.
      tests=$(python3 - "$OUT/sanitizer_$sfx.json" "$log" <<'PY'
import json, sys
try:
    t = json.load(open(sys.argv[1]))
    print(f"{t['tests']} tests, {t.get('failures', 0)} failed")
except (OSError, ValueError, KeyError):
    text = open(sys.argv[2], errors="replace").read() if sys.argv[2] else ""
    ok, bad = text.count("[       OK ]"), text.count("[  FAILED  ]")
    print(f"no gtest report (unfinished): {ok} tests passed, {bad} failed lines in the log")
PY
      )
      echo "sanitizer $sfx: ${found:-no sanitizer summary (see the log)}; $tests;" \
        "$((SECONDS - t0)) s; filter '$tool_filter'" >>"$summary"
    done
  done
fi

if has_stage bench; then
  for p in $PRESETS; do
    # The inner script expands its own positional parameters.
    # shellcheck disable=SC2016
    step "bench $p" "${BENCH_TIMEOUT:-300}" "bench_$p.log" bash -c \
      '"$0" bench --device "$6" --random-weights "$1" --micro ${2:+--draft "$2"} --json $3 \
         >"$4" 2>"$5"; rc=$?; cat "$5"; exit $rc' \
      "$SPECULA" "$p" "$DRAFT" "$BENCH_ARGS" "$OUT/bench_$p.json" "$OUT/bench_$p.stderr" "$DEVICE"
  done
fi

if has_stage torch; then
  for p in $PRESETS; do
    specula_json=()
    [[ -s $OUT/bench_$p.json ]] && specula_json=(--specula-json "$OUT/bench_$p.json")
    # shellcheck disable=SC2086  # TORCH_ARGS is a list of arguments
    step "torch $p" "${TORCH_TIMEOUT:-400}" "torch_$p.log" python3 tools/gpu/torch_bench.py \
      --preset "$p" --specula "$SPECULA" "${specula_json[@]}" --out "$OUT/torch_$p.json" $TORCH_ARGS
  done
fi

# ---------------------------------------------------------------------------- summary
python3 - "$OUT" "$PRESETS" <<'EOF'
import json, os, sys

out, presets = sys.argv[1], sys.argv[2].split()


def load(name):
    path = os.path.join(out, name)
    try:
        with open(path) as f:
            text = f.read().strip().splitlines()
        return json.loads(text[-1]) if text else None
    except (OSError, ValueError) as e:
        return {"_error": f"{name}: {e}"} if os.path.exists(path) else None


def f(x, spec=".2f"):
    return format(x, spec) if isinstance(x, (int, float)) else "-"


print("\n================ summary ================")
t = load("cuda_tests.json")
if t and "tests" in t:
    print(f"cuda tests: {t['tests']} run, {t.get('failures', 0)} failed, {t.get('disabled', 0)} disabled")
    for suite in t.get("testsuites", []):
        for case in suite.get("testsuite", []):
            if case.get("failures"):
                print(f"  FAILED {suite['name']}.{case['name']}")
elif os.path.exists(os.path.join(out, "cuda_tests.log")):
    print("cuda tests: no JSON report; see cuda_tests.log")

for p in presets:
    b, tb = load(f"bench_{p}.json"), load(f"torch_{p}.json")
    print(f"\n--- {p} ---")
    if b and "micro" in b:
        m = b["micro"]
        print(f"copy bandwidth {f(m['copy']['gb_per_second'], '.0f')} GB/s, "
              f"bf16 matrix peak {f(m['matrix_peak']['tflops'], '.0f')} TFLOP/s, "
              f"weights {f(m['weight_bytes'] / 1e9)} GB, context {m['context']}")
        print(f"{'batch':>5} {'step ms':>9} {'tok/s':>10} {'roofline':>9}")
        for d in m["decode"]:
            print(f"{d['batch']:>5} {f(d['step_ms'], '.3f'):>9} {f(d['tokens_per_second'], '.1f'):>10} "
                  f"{f(100 * d['roofline_fraction'], '.1f'):>8}%")
        v = m["verify"]
        print(f"verify {v['tokens']} tokens / decode step: {f(v['ratio'], '.3f')}x")
        if m.get("drafter"):
            print(f"drafter step / target step: {f(100 * m['drafter']['ratio'], '.2f')}%")
        pf = m["prefill"]
        print(f"prefill {pf['tokens']}: {f(pf['tokens_per_second'], '.0f')} tok/s, "
              f"{f(pf['tflops'], '.0f')} TFLOP/s = {f(100 * pf['peak_fraction'], '.1f')}% of peak")
        for g in m.get("goals", []):
            print(f"  goal {g['goal']:<40} {f(g['value'], '.3f'):>8} {g['target']:<8} "
                  f"{'met' if g['met'] else 'NOT MET'}")
        for r in b.get("results", []):
            print(f"  e2e {r['mode']:<12} k={r['draft_tokens']} {f(r['decode_tokens_per_second'], '.1f')} tok/s "
                  f"tau {f(r['tau'])}")
    else:
        print(f"specula bench: {b.get('_error') if b else 'no result'}")
    if tb:
        pre = tb.get("prefill", {})
        print(f"torch {tb.get('versions', {}).get('torch')} / transformers "
              f"{tb.get('versions', {}).get('transformers')}: prefill {f(pre.get('tokens_per_second'), '.0f')} tok/s"
              + (f" (error: {pre['error']})" if "error" in pre else ""))
        for d in tb.get("decode", []):
            print(f"  torch decode batch {d.get('batch')}: {f(d.get('step_ms'), '.3f')} ms/step, "
                  f"{f(d.get('tokens_per_second'), '.1f')} tok/s" + (f" error: {d['error']}" if "error" in d else ""))
        a = tb.get("assisted", {})
        if "error" in a:
            print(f"  torch assisted: error: {a['error']}")
        elif a:
            print(f"  torch assisted k={a['draft_tokens']}: {f(a['decode_tokens_per_second'], '.1f')} tok/s, "
                  f"tau {f(a['tau'])}")
        r = tb.get("specula_over_torch")
        if r:
            print("  specula / torch: " + ", ".join(f"{k} {f(v)}" for k, v in r.items()))
print()
EOF
if [[ -s $OUT/sanitizer_summary.txt ]]; then
  echo "compute-sanitizer:"
  cat "$OUT/sanitizer_summary.txt"
  echo
fi
echo "status:"
cat "$STATUS"
