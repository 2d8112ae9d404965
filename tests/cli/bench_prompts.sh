#!/usr/bin/env bash
# `specula bench --prompt-file SET.jsonl` through the real binary on the
# embedded model and its assistant: each prompt of the set decoded as it is
# (text, code-block and chat formats; --num-prompts; more prompts than
# --batch rows), with tau >= 1, acceptance by draft position of length k, and
# counts that match the prompts; the table has the by-position column.
# Usage: bench_prompts.sh SPECULA_BINARY SOURCE_DIR
set -uo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"
need jq

# DeepSpec's HumanEval layout: an instruction, then the task in a fence.
cat >"$tmp/set.jsonl" <<'P'
{"turns": ["Write a solution to the following problem and make sure that it passes the tests:\n```python\ndef add(a, b):\n    \"\"\"Return the sum of a and b.\"\"\"\n\n```"]}

{"turns": ["Write a solution to the following problem and make sure that it passes the tests:\n```python\nclass Stack:\n    def __init__(self):\n\n```"]}
{"turns": ["Write a solution to the following problem and make sure that it passes the tests:\n```python\nimport os\n\n\ndef list_python_files(root):\n\n```"]}
P
gen=12
common=(--threads 1 --gen-tokens "$gen" --draft-tokens 2 3 --json)

# Every spec row: tau >= 1, by-position arrays of length k whose counts add up,
# and the prompts and tokens of all N prompts.
rows_ok='def rows_ok($n; $gen): .results | length > 0 and all(.[];
  .prompts == $n and .generated_tokens == $n * $gen and
  (if .mode == "plain" then .tau >= 1 else
    .tau >= 1 and (.acceptance_by_position | length) == .draft_tokens and
    (.drafted_at | length) == .draft_tokens and (.drafted_at | add) == .drafted and
    (.accepted_at | add) == .accepted and .drafted > 0 and
    all(.acceptance_by_position[]; . >= 0 and . <= 1) end));'

out=$("$specula" bench --prompt-file "$tmp/set.jsonl" --batch 1 2 "${common[@]}" 2>"$tmp/text.err") ||
  fail "text: exit $?: $(cat "$tmp/text.err")"
echo "$out" | jq -e --argjson gen "$gen" "$rows_ok"'
  .prompts.source == "prompt-set" and .prompts.format == "text" and .prompts.count == 3 and
  (.results | map(select(.mode == "speculative")) | length) == 4 and rows_ok(3; $gen)' >/dev/null ||
  fail "text: $out"
text_mean=$(echo "$out" | jq '.prompts.prompt_tokens.mean')

out=$("$specula" bench --prompt-file "$tmp/set.jsonl" --prompt-format code-block --num-prompts 2 \
  "${common[@]}" 2>"$tmp/code.err") || fail "code-block: exit $?: $(cat "$tmp/code.err")"
echo "$out" | jq -e --argjson gen "$gen" --argjson text_mean "$text_mean" "$rows_ok"'
  .prompts.format == "code-block" and .prompts.count == 2 and rows_ok(2; $gen) and
  .prompts.prompt_tokens.mean < $text_mean' >/dev/null || fail "code-block: $out"

out=$("$specula" bench --prompt-file "$tmp/set.jsonl" --prompt-format chat --num-prompts 1 \
  "${common[@]}" 2>"$tmp/chat.err") || fail "chat: exit $?: $(cat "$tmp/chat.err")"
echo "$out" | jq -e --argjson gen "$gen" "$rows_ok"'
  .prompts.format == "chat" and .prompts.count == 1 and rows_ok(1; $gen)' >/dev/null ||
  fail "chat: $out"

# The table: a by-position column with k rates on each speculative row.
out=$("$specula" bench --prompt-file "$tmp/set.jsonl" --prompt-format code-block --threads 1 \
  --gen-tokens "$gen" --draft-tokens 2 2>&1) || fail "table: exit $?: $out"
echo "$out"
[[ $out == *"accept by position"* ]] || fail "table: no by-position column: $out"
echo "$out" | grep -qE '^speculative +1 +2 .* [01]\.[0-9]{2} [01]\.[0-9]{2}$' ||
  fail "table: the k = 2 row has no two by-position rates: $out"
exit $failed
