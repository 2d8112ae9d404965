#!/usr/bin/env bash
# `specula bench-serve` against a fake streaming server (tests/cli/fake_openai.mjs,
# node's built-in http only): every phase completes with zero errors; a 429 and
# an error event in the middle of a stream count as errors; a server that never
# answers gives timeouts, or abandoned requests at --duration-limit, and never a
# hang; a non-loopback --host is refused. Exits 77 (skipped) without node.
# Usage: bench_serve.sh SPECULA_BINARY SOURCE_DIR
set -uo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"
need node
pids=()
cleanup() {
  for pid in "${pids[@]}"; do kill "$pid" 2>/dev/null; done
  rm -rf "$tmp"
}
trap cleanup EXIT
passed=0
ok() { passed=$((passed + 1)); }
bad() {
  failed=$((failed + 1))
  echo "FAIL $*"
}

# start_server MODE: starts a fake server; sets $port and $log (its request bodies).
start_server() {
  local mode=$1
  log=$tmp/$mode.bodies
  node "$src/tests/cli/fake_openai.mjs" "$mode" "$log" >"$tmp/$mode.port" 2>"$tmp/$mode.err" &
  pids+=($!)
  for _ in $(seq 100); do
    port=$(head -n1 "$tmp/$mode.port" 2>/dev/null)
    [[ -n $port ]] && return 0
    sleep 0.1
  done
  echo "fake server ($mode) did not start: $(cat "$tmp/$mode.err")"
  exit 1
}

# bench NAME ARGS...: runs bench-serve (60 s at most: a hang fails); sets $out and $status.
bench() {
  local name=$1
  shift
  out=$(timeout 60 "$specula" bench-serve "$@" 2>&1 </dev/null)
  status=$?
  if [[ $status -eq 124 ]]; then bad "$name: bench-serve still running after 60 s"; fi
}

# jcheck NAME FILE EXPR: EXPR (JavaScript, the parsed file in `j`) must be true.
jcheck() {
  local name=$1 file=$2 expr=$3
  if node -e "const j = JSON.parse(require('fs').readFileSync(process.argv[1], 'utf8'));
              process.exit((${expr}) ? 0 : 1)" "$file" 2>"$tmp/jcheck.err"; then
    ok
  else
    bad "$name: expected $expr; $(cat "$tmp/jcheck.err")"
    echo "  output: $out"
  fi
}

start_server ok
bench completions --port "$port" --max-concurrency 1,4 --num-prompts 8 --max-tokens 8 \
  --json "$tmp/ok.json"
[[ $status -eq 0 && $out == *"conc"*"done"*"errors"* ]] && ok || bad "completions: status $status: $out"
jcheck completions "$tmp/ok.json" 'j.phases.length === 2 && j.phases.every(p => p.completed === 8 &&
  p.errors === 0 && p.abandoned === 0 && p.total_output_tokens === 64 && p.ttft_ms.p50 > 0 &&
  p.tpot_ms.p99 > 0 && p.itl_ms.p50 > 0 && Math.abs(p.mean_tau - 1.6) < 1e-9) &&
  j.phases.map(p => p.concurrency).join() === "1,4"'
# The fake server sends 8 tokens as events of 1, 2, 3, 1, 1 tokens: 4 gaps a request.
jcheck itl-per-event "$tmp/ok.json" 'j.phases[0].requests.every(r => r.itl_s.length === 4 &&
  r.content_events === 5 && r.completion_tokens === 8)'
grep -q '"ignore_eos":true' "$log" && ! grep -q '"speculative"' "$log" && ok ||
  bad "request body: $(head -n1 "$log")"

: >"$log"
bench chat --host localhost --port "$port" --endpoint /v1/chat/completions --no-speculation \
  --max-concurrency 3 --num-prompts 5 --max-tokens 4 --model m1 --json "$tmp/chat.json"
[[ $status -eq 0 ]] && ok || bad "chat: status $status: $out"
jcheck chat "$tmp/chat.json" 'j.phases[0].completed === 5 && j.phases[0].errors === 0 &&
  j.phases[0].total_output_tokens === 20'
grep -q '"speculative":{"enabled":false}' "$log" && grep -q '"model":"m1"' "$log" &&
  grep -q '"messages":\[{"content"' "$log" && ok || bad "chat body: $(head -n1 "$log")"

: >"$log"
printf '{"turns": ["first prompt \\u00e9", "second turn"]}\n\n{"turns": ["other prompt"]}\n' \
  >"$tmp/prompts.jsonl"
bench dataset --port "$port" --max-concurrency 1 --num-prompts 3 --max-tokens 2 \
  --dataset-path "$tmp/prompts.jsonl" --json "$tmp/dataset.json"
jcheck dataset "$tmp/dataset.json" 'j.phases[0].completed === 3'
[[ $(grep -c '"prompt":"first prompt é"' "$log") -eq 2 && $(grep -c '"prompt":"other prompt"' "$log") -eq 1 ]] &&
  ok || bad "dataset prompts: $(cat "$log")"
echo '{"prompt": "x"}' >"$tmp/wrong.jsonl"
bench dataset-layout --port "$port" --dataset-path "$tmp/wrong.jsonl"
[[ $status -eq 1 && $out == *"wrong.jsonl:1"*"turns"* ]] && ok || bad "dataset-layout: $status: $out"

for host in 10.1.2.3 0.0.0.0 example.com 192.168.0.1 ::ffff:127.0.0.1; do
  bench "host-$host" --host "$host" --port "$port" --num-prompts 1
  [[ $status -eq 1 && $out == *"--host '$host'"*"127.0.0.0/8, ::1 or localhost"* ]] && ok ||
    bad "host $host: status $status: $out"
done
bench too-many --port "$port" --num-prompts 10001
[[ $status -eq 1 && $out == *"--num-prompts must be in [1, 10000]"* ]] && ok || bad "too-many: $out"
bench zero-conc --port "$port" --max-concurrency 1,0
[[ $status -eq 1 && $out == *"--max-concurrency"* ]] && ok || bad "zero-conc: $out"

start_server 429
bench 429 --port "$port" --max-concurrency 1,4 --num-prompts 8 --max-tokens 8 --json "$tmp/429.json"
[[ $status -eq 0 && $out == *"http 429"*"too many requests"* ]] && ok || bad "429: status $status: $out"
jcheck 429 "$tmp/429.json" 'j.phases.every(p => p.completed === 4 && p.errors === 4 &&
  p.errors_by_kind["http 429"] === 4 && Object.keys(p.errors_by_kind).length === 1)'

start_server error-event
bench error-event --port "$port" --max-concurrency 1,4 --num-prompts 8 --max-tokens 8 \
  --json "$tmp/ee.json"
[[ $status -eq 0 ]] && ok || bad "error-event: status $status: $out"
jcheck error-event "$tmp/ee.json" 'j.phases.every(p => p.completed === 4 && p.errors === 4 &&
  p.errors_by_kind["error event"] === 4 &&
  p.first_error_by_kind["error event"].includes("engine failure"))'

start_server hang
SECONDS=0
bench timeout --port "$port" --max-concurrency 2 --num-prompts 2 --timeout 1 --json "$tmp/to.json"
jcheck timeout "$tmp/to.json" 'j.phases[0].errors_by_kind.timeout === 2 && j.phases[0].completed === 0'
bench duration --port "$port" --max-concurrency 2 --num-prompts 6 --duration-limit 1 \
  --json "$tmp/dl.json"
jcheck duration "$tmp/dl.json" 'j.phases[0].abandoned === 2 && j.phases[0].not_started === 4 &&
  j.phases[0].errors === 0 && j.phases[0].duration_s < 3'
[[ $SECONDS -lt 15 ]] && ok || bad "timeouts took $SECONDS s"

# Nothing listens on port 1: connection refused, counted.
bench refused --port 1 --max-concurrency 1 --num-prompts 2 --json "$tmp/refused.json"
jcheck refused "$tmp/refused.json" 'j.phases[0].errors_by_kind.connect === 2'

echo "bench_serve: $passed passed, $failed failed"
[[ $failed -eq 0 ]]
