#!/usr/bin/env bash
# Installs what is missing, builds, and runs every test:
#   1. the Release build's full test suite (unit, golden parity, end-to-end);
#   2. the same suite under AddressSanitizer + UndefinedBehaviorSanitizer;
#   3. a bounded fuzz run of the safetensors-header and config parsers (ASan build).
# Usage: scripts/test.sh [--quick]   (--quick: step 1 only)
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"
bash scripts/setup.sh
if [[ -f scripts/fetch_test_data.sh ]]; then bash scripts/fetch_test_data.sh >/dev/null; fi
jobs=${SPECULA_JOBS:-$(nproc)}
# The server's node tests (tests/server/node) need the openai client: install
# the locked packages; without them (no npm, offline) those tests skip, saying so.
if command -v npm >/dev/null 2>&1 &&
   (cd tests/server/node && npm ci --silent --no-audit --no-fund >/dev/null 2>&1); then
  :
else
  echo "== note: npm ci in tests/server/node failed or npm is missing: the server's node tests will skip"
fi

# The CUDA backend is compiled wherever nvcc exists (its cross-backend tests
# skip themselves without a GPU; tools/gpu/run_gpu.sh runs them on one).
cuda_args=()
if command -v nvcc >/dev/null 2>&1 || [[ -x /usr/local/cuda/bin/nvcc ]]; then
  export PATH="$PATH:/usr/local/cuda/bin"
  cuda_args=(-DSPECULA_CUDA=ON)
  echo "== nvcc found: building the CUDA backend too"
fi

echo "== build (Release)"
bash scripts/build.sh build "${cuda_args[@]}"
echo "== tests (Release)"
ctest --test-dir build --output-on-failure -j "$jobs" -LE fuzz

if [[ "${1:-}" == "--quick" ]]; then exit 0; fi

echo "== build (AddressSanitizer + UndefinedBehaviorSanitizer)"
bash scripts/build.sh build-asan -DCMAKE_BUILD_TYPE=RelWithDebInfo "-DSPECULA_SANITIZE=address;undefined"
echo "== tests (ASan + UBSan)"
ASAN_OPTIONS=detect_leaks=1:abort_on_error=1 LSAN_OPTIONS="suppressions=$root/scripts/lsan.supp:print_suppressions=0" UBSAN_OPTIONS=print_stacktrace=1:halt_on_error=1 \
  ctest --test-dir build-asan --output-on-failure -j "$jobs" -LE fuzz
echo "== fuzz (bounded)"
ctest --test-dir build-asan --output-on-failure -L fuzz
