#!/usr/bin/env bash
# `specula quantize` through the real binary: the embedded family's assistant
# to int8 and fp8 (sizes and --verbose per-class errors reported; tokenizer
# copied; config marked), then `specula ab` of the original against each on 2
# text prompts (skipped without jq); the golden DSpark drafter to int8 and
# greedy generation with it equals generation without a drafter; bad input
# (an already quantized folder, an --out that is not empty, --dtype int4) is
# refused with a clear error.
# Usage: quantize.sh SPECULA_BINARY SOURCE_DIR
set -uo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"

assistant=$src/models/gemma4-tiny-py-assistant
for dtype in int8 fp8; do
  out=$("$specula" quantize --draft "$assistant" --out "$tmp/a_$dtype" --dtype "$dtype" --verbose 2>&1) ||
    fail "quantize --dtype $dtype exited $?: $out"
  echo "$out"
  [[ $out == *"to $dtype"* && $out == *"MiB"* ]] || fail "no size line for $dtype"
  [[ $out == *"mlp.gate_proj.weight"* && $out == *"max |err|"* ]] || fail "no per-class table for $dtype"
  [[ -f $tmp/a_$dtype/tokenizer.json && -f $tmp/a_$dtype/model.safetensors ]] ||
    fail "$dtype folder lacks the tokenizer or the weights"
  grep -q "\"specula_weight_dtype\": \"$dtype\"" "$tmp/a_$dtype/config.json" ||
    fail "config.json of $dtype not marked"
  orig=$(stat -c %s "$assistant/model.safetensors")
  new=$(stat -c %s "$tmp/a_$dtype/model.safetensors")
  ((new < orig)) || fail "$dtype weights ($new bytes) not smaller than the original ($orig)"
done

# Greedy generation with the quantized assistant equals generation without a drafter.
plain=$("$specula" generate --no-draft --prompt "def fibonacci(n):" -n 24 --json 2>/dev/null)
for dtype in int8 fp8; do
  got=$("$specula" generate --draft "$tmp/a_$dtype" --prompt "def fibonacci(n):" -n 24 --json 2>/dev/null) ||
    fail "generate with the $dtype assistant exited $?"
  if command -v jq >/dev/null; then
    [[ "$(echo "$got" | jq -c .tokens)" == "$(echo "$plain" | jq -c .tokens)" ]] ||
      fail "$dtype assistant changed greedy output: $got vs $plain"
  fi
done

# The golden DSpark drafter (specula layout) of the dense_kev target.
out=$("$specula" quantize --draft "$src/tests/golden/dspark" --out "$tmp/dspark_i8" 2>&1) ||
  fail "quantize dspark exited $?: $out"
grep -q '"weight_dtype": "int8"' "$tmp/dspark_i8/dspark.json" || fail "dspark.json not marked"
plain=$("$specula" generate --model "$src/tests/golden/dense_kev" --no-draft --prompt-ids 2,5,9,14 -n 12 --json 2>/dev/null)
got=$("$specula" generate --model "$src/tests/golden/dense_kev" --draft "$tmp/dspark_i8" --prompt-ids 2,5,9,14 \
  -n 12 --json 2>/dev/null) || fail "generate with the int8 DSpark drafter exited $?"
if command -v jq >/dev/null; then
  [[ "$(echo "$got" | jq -c .tokens)" == "$(echo "$plain" | jq -c .tokens)" ]] ||
    fail "int8 DSpark changed greedy output: $got vs $plain"
fi

# Bad input: clean errors (exit 1, a message), never a crash.
out=$("$specula" quantize --draft "$tmp/a_int8" --out "$tmp/again" 2>&1)
status=$?
[[ $status -eq 1 && $out == *"already"* ]] || fail "re-quantizing: status $status: $out"
out=$("$specula" quantize --draft "$assistant" --out "$tmp/a_int8" 2>&1)
status=$?
[[ $status -eq 1 && $out == *"not an empty folder"* ]] || fail "non-empty --out: status $status: $out"
out=$("$specula" quantize --draft "$assistant" --out "$tmp/x" --dtype int4 2>&1)
status=$?
[[ $status -eq 1 && $out == *"--dtype"* && $out == *"int4"* ]] || fail "--dtype int4: status $status: $out"

# The gate: the original against each quantized assistant.
if command -v jq >/dev/null; then
  cat >"$tmp/prompts.jsonl" <<'P'
{"turns": ["def fibonacci(n):"]}
{"turns": ["class Stack:\n    def __init__(self):"]}
P
  for dtype in int8 fp8; do
    out=$("$specula" ab --draft-a "$assistant" --draft-b "$tmp/a_$dtype" --prompt-file "$tmp/prompts.jsonl" \
      -n 24 --json 2>/dev/null) || fail "ab original vs $dtype exited $?"
    echo "$out" | jq -e '.arms.a.prompts == 2 and .arms.b.prompts == 2 and .arms.b.drafted > 0 and
      (.verdict == "PASS" or .verdict == "FAIL")' >/dev/null || fail "ab vs $dtype: $out"
    echo "ab original vs $dtype: $(echo "$out" | jq -c '{a: .arms.a.acceptance, b: .arms.b.acceptance, verdict}')"
  done
else
  echo "SKIP (part): jq not found, no ab run"
fi
exit $failed
