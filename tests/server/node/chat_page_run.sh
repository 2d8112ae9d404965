#!/usr/bin/env bash
# ctest's chat-page test: starts `specula serve` (the embedded family) on a free
# loopback port, runs chat_page_test.mjs against it in headless Chromium, and
# stops the server (which must exit cleanly on SIGTERM).
# Exit 77 (skip) when node, the npm packages or Chromium are missing, saying which.
#   chat_page_run.sh SPECULA_BINARY
set -uo pipefail
specula=${1:?usage: chat_page_run.sh SPECULA_BINARY}
here=$(cd "$(dirname "$0")" && pwd)
if ! command -v node >/dev/null 2>&1; then
  echo "SKIP: node is not installed (apt-get install nodejs)"
  exit 77
fi
if [[ ! -d $here/node_modules/playwright-core ]]; then
  echo "SKIP: the test packages are not installed (cd tests/server/node && npm ci)"
  exit 77
fi
log=$(mktemp)
trap 'rm -f "$log"' EXIT
"$specula" serve --port 0 >"$log" 2>&1 &
pid=$!
port=""
for _ in $(seq 1 240); do
  port=$(grep -oE 'on http://127\.0\.0\.1:[0-9]+' "$log" | grep -oE '[0-9]+$' | head -1)
  [[ -n $port ]] && break
  kill -0 $pid 2>/dev/null || break
  sleep 0.25
done
if [[ -z $port ]]; then
  echo "FAIL: the server did not start:"
  cat "$log"
  kill $pid 2>/dev/null
  exit 1
fi
node "$here/chat_page_test.mjs" "http://127.0.0.1:$port"
rc=$?
kill -TERM $pid
wait $pid
server_rc=$?
if [[ $rc -ne 0 && $rc -ne 77 ]]; then
  echo "-- server log:"
  cat "$log"
fi
if [[ $server_rc -ne 0 ]]; then
  echo "FAIL: the server exited with $server_rc after SIGTERM"
  cat "$log"
  exit 1
fi
exit $rc
