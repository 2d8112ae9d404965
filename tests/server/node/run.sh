#!/usr/bin/env bash
# Runs one of the server's node tests against a specula binary:
#   tests/server/node/run.sh <specula binary> <test file>
# Exits 77 (ctest: skipped) with a plain message when node (>= 20) or the npm
# packages (npm ci in tests/server/node; scripts/test.sh runs it) are missing.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
if [[ $# -ne 2 ]]; then
  echo "usage: $0 <specula binary> <test file>" >&2
  exit 2
fi
bin=$(cd "$(dirname "$1")" && pwd)/$(basename "$1")
test_file=$2
[[ "$test_file" = /* ]] || test_file="$here/$test_file"

if ! command -v node >/dev/null 2>&1; then
  echo "SKIP: node is not installed (the server's end-to-end tests need node >= 20)"
  exit 77
fi
major=$(node -p 'process.versions.node.split(".")[0]')
if (( major < 20 )); then
  echo "SKIP: node $(node --version) is too old (the server's end-to-end tests need node >= 20)"
  exit 77
fi
if [[ ! -d "$here/node_modules/openai" ]]; then
  echo "SKIP: the npm packages are not installed (run 'npm ci' in tests/server/node; scripts/test.sh does)"
  exit 77
fi
if [[ ! -x "$bin" ]]; then
  echo "FAIL: $1 is not an executable" >&2
  exit 1
fi
cd "$here"
SPECULA_BIN="$bin" exec node --test --test-reporter=spec "$test_file"
