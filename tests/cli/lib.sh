# shellcheck shell=bash
# The common prologue of the CLI tests (tests/cli/*.sh, run by ctest as
# `bash TEST.sh SPECULA_BINARY SOURCE_DIR`), sourced after `set -uo pipefail`:
#   source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"
# It reads the test's arguments and sets
#   specula, src   the binary and the source folder
#   tmp            a fresh folder, removed on exit (a test that traps EXIT
#                  itself removes it there)
#   failed=0       the test's exit status: tests end with `exit $failed`
# and defines
#   fail MESSAGE...        prints "FAIL: MESSAGE" and sets failed=1
#   need TOOL              skips the test (exit 77, ctest's SKIP_RETURN_CODE)
#                          when TOOL is not on PATH
#   check NAME COMMAND...  runs COMMAND with its output to $tmp/log/NAME.log and
#                          prints "NAME: ok", or fails with the log's last lines
#                          (a failure shows in a short captured output);
#                          returns COMMAND's exit status
if [[ $# -lt 2 ]]; then
  echo "usage: $(basename "$0") SPECULA_BINARY SOURCE_DIR" >&2
  exit 2
fi
specula=$1
src=$2
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
failed=0

fail() {
  echo "FAIL: $*"
  failed=1
}

need() {
  command -v "$1" >/dev/null || {
    echo "SKIP: $1 not found"
    exit 77
  }
}

check() {
  local name=$1
  shift
  mkdir -p "$tmp/log"
  local log=$tmp/log/${name//[^A-Za-z0-9_.-]/_}.log
  "$@" >"$log" 2>&1
  local status=$?
  if [[ $status -eq 0 ]]; then
    echo "$name: ok"
  else
    fail "$name (exit $status); last lines of its output:"
    tail -n 25 "$log" | sed 's/^/  | /'
  fi
  return $status
}
