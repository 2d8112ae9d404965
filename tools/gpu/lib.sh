# shellcheck shell=bash
# Helpers shared by the GPU run scripts (tools/gpu/*_run.sh, run_gpu.sh,
# sampling_ab.sh): sourced after OUT is set, it starts $OUT/status.txt (one
# line per step, printed or summed up at the end) and defines
#   has_stage NAME        whether NAME is in $STAGES
#   note TEXT...          TEXT to stdout and to $STATUS
#   step NAME LIMIT LOG COMMAND...
#                         COMMAND under `timeout LIMIT`, its output to $OUT/LOG,
#                         one status line (ok, FAILED (exit N), TIMEOUT); returns
#                         the command's exit status. STEP_KILL_AFTER (seconds,
#                         default 30) is the grace after SIGTERM before SIGKILL.
#   machine_header [--print]
#                         date, commit, host, GPUs and nvcc into $OUT/machine.txt
#                         (and to stdout with --print)
#   use_bins DIR          unpack_bins DIR, then SPECULA and TESTS name its binaries
#   run_cuda_tests TESTS LIMIT
#                         the CUDA test binary TESTS (narrowed by $TEST_FILTER) as
#                         step `cuda_tests` into $OUT/cuda_tests.log and .json,
#                         then its last lines and any failed tests printed
#   unpack_bins DIR       decompresses DIR/*.xz, makes specula and
#                         specula_cuda_tests executable, adds DIR/../lib (tools/gpu/
#                         pack_bins.sh) to LD_LIBRARY_PATH and links the binaries'
#                         compiled-in source path to this checkout when it is missing
#                         (binaries built in another checkout find models and
#                         fixtures through it)
# Usage: source "$(dirname "$0")/lib.sh"
: "${OUT:?set OUT to the folder for logs and results}"
mkdir -p "$OUT"
STATUS=$OUT/status.txt
: >"$STATUS"
STEP_KILL_AFTER=${STEP_KILL_AFTER:-30}

has_stage() { [[ " ${STAGES:-} " == *" $1 "* ]]; }

note() { echo "$*" | tee -a "$STATUS"; }

step() {
  local name=$1 limit=$2 log=$3
  shift 3
  local t0=$SECONDS
  echo "== $name: $*" >&2
  timeout --kill-after="$STEP_KILL_AFTER" "$limit" "$@" >"$OUT/$log" 2>&1
  local rc=$?
  local what=ok
  [[ $rc -eq 124 || $rc -eq 137 ]] && what="TIMEOUT after ${limit}s"
  [[ $rc -ne 0 && $what == ok ]] && what="FAILED (exit $rc)"
  note "$name: $what, $((SECONDS - t0)) s, log $log"
  return $rc
}

machine_header() {
  {
    echo "date: $(date -u +%Y-%m-%dT%H:%M:%SZ)"
    echo "commit: $(git rev-parse --short HEAD 2>/dev/null || echo unknown) $(git status --porcelain 2>/dev/null | wc -l) changed files"
    echo "host: $(hostname), $(nproc) cores"
    nvidia-smi --query-gpu=name,uuid,memory.total,clocks.max.sm,clocks.max.mem,driver_version \
      --format=csv 2>&1
    if command -v nvcc >/dev/null; then nvcc --version 2>&1 | tail -1; fi
  } >"$OUT/machine.txt"
  if [[ ${1:-} == --print ]]; then cat "$OUT/machine.txt"; fi
}

unpack_bins() {
  local bin=$1 f src
  for f in "$bin"/*.xz; do [[ -e $f ]] && xz -dkf "$f"; done
  chmod +x "$bin"/specula "$bin"/specula_cuda_tests 2>/dev/null
  if [[ -d $bin/../lib ]]; then
    LD_LIBRARY_PATH="$(cd "$bin/../lib" && pwd)${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
    export LD_LIBRARY_PATH
  fi
  src=$(strings "$bin/specula" | grep -m1 -o '/[^ ]*/models$' | sed 's#/models$##')
  if [[ -n $src && ! -e $src ]]; then
    mkdir -p "$(dirname "$src")" && ln -s "$PWD" "$src" && note "linked $src -> $PWD"
  fi
  return 0
}

run_cuda_tests() {
  local tests=$1 limit=$2
  step cuda_tests "$limit" cuda_tests.log "$tests" --gtest_brief=1 \
    ${TEST_FILTER:+--gtest_filter="$TEST_FILTER"} --gtest_output="json:$OUT/cuda_tests.json"
  local rc=$?
  tail -5 "$OUT/cuda_tests.log"
  grep -E "^\[  FAILED" "$OUT/cuda_tests.log" | head -20
  return $rc
}

use_bins() {
  unpack_bins "$1"
  SPECULA=$1/specula
  TESTS=$1/specula_cuda_tests
}
