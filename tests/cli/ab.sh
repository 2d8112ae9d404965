#!/usr/bin/env bash
# `specula ab` through the real binary on the embedded model: its assistant
# against ngram on 3 text prompts prints a report with a verdict line; --json
# has both arms; --plot writes a PNG; a drafter made for another target is
# refused naming the arm, the drafter and the target.
# Usage: ab.sh SPECULA_BINARY SOURCE_DIR
set -uo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"
need jq

cat >"$tmp/prompts.jsonl" <<'P'
{"turns": ["def fibonacci(n):"]}
{"turns": ["class Stack:\n    def __init__(self):"]}
{"turns": ["import os\nfor name in os.listdir('.'):"]}
P
assistant=$src/models/gemma4-tiny-py-assistant
out=$("$specula" ab --draft-a "$assistant" --draft-b ngram --prompt-file "$tmp/prompts.jsonl" -n 24 \
  --plot "$tmp/deltas.png" 2>&1) || fail "ab exited $?: $out"
echo "$out"
[[ $out == *"verdict: PASS"* || $out == *"verdict: FAIL"* ]] || fail "no verdict line"
[[ $(head -c 8 "$tmp/deltas.png" | od -An -tx1 | tr -d ' \n') == 89504e470d0a1a0a ]] ||
  fail "--plot did not write a PNG"

out=$("$specula" ab --draft-a "$assistant" --draft-b ngram --prompt-file "$tmp/prompts.jsonl" -n 24 \
  --json 2>/dev/null) || fail "ab --json exited $?"
echo "$out" | jq -e '.arms.a.draft == "'"$assistant"'" and .arms.b.draft == "ngram" and
  .arms.a.prompts == 3 and .arms.b.prompts == 3 and (.verdict == "PASS" or .verdict == "FAIL") and
  (.per_prompt | length == 3) and .arms.a.drafted > 0' >/dev/null || fail "--json: $out"

# --prompt-format code-block and --num-prompts: HumanEval-style turns, the
# first 2 of 3 (the third has no code block, so reading it would fail).
cat >"$tmp/code.jsonl" <<'P'
{"turns": ["Complete the function:\n```python\ndef add(a, b):\n```\n"]}
{"turns": ["```py\nclass Stack:\n    def __init__(self):\n```"]}
{"turns": ["no code block here"]}
P
out=$("$specula" ab --draft-a "$assistant" --draft-b ngram --prompt-file "$tmp/code.jsonl" \
  --prompt-format code-block --num-prompts 2 -n 8 --json 2>/dev/null) ||
  fail "ab --prompt-format code-block exited $?"
echo "$out" | jq -e '.arms.a.prompts == 2 and .arms.b.prompts == 2 and (.per_prompt | length == 2)' \
  >/dev/null || fail "code-block --json: $out"

# Drafters made for another target (assistant and DSpark), on id prompts.
echo '{"ids": [2, 5, 9, 14]}' >"$tmp/ids.jsonl"
out=$("$specula" ab --model "$src/tests/golden/e2b_like" --draft-a "$src/tests/golden/dense_kev_assistant" \
  --draft-b ngram --prompt-file "$tmp/ids.jsonl" -n 4 2>&1)
status=$?
[[ $status -eq 1 && $out == *"arm A"* && $out == *"dense_kev_assistant"* && $out == *"e2b_like"* ]] ||
  fail "wrong-target assistant: status $status: $out"
out=$("$specula" ab --model "$src/tests/golden/e2b_like" --draft-a ngram --draft-b "$src/tests/golden/dspark" \
  --prompt-file "$tmp/ids.jsonl" -n 4 2>&1)
status=$?
[[ $status -eq 1 && $out == *"arm B"* && $out == *"golden/dspark"* && $out == *"e2b_like"* ]] ||
  fail "wrong-target DSpark: status $status: $out"
exit $failed
