#!/usr/bin/env bash
# `specula calibrate` through the real binary: a copy of the golden DSpark
# drafter (tests/golden/dspark) over its dense_kev target, on token-id prompts
# (dense_kev has no tokenizer). Checks that dspark.json gains a calibration
# with γ thresholds and γ STS temperatures and keeps every other field, that
# the calibrated drafter loads, that --dry-run writes nothing, that
# --prompt-format code-block and --num-prompts work on text prompts, and the errors
# for a DeepSpec-layout folder and a folder that is not DSpark.
# Usage: calibrate.sh SPECULA_BINARY SOURCE_DIR
set -uo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"
need jq

target=$src/tests/golden/dense_kev
mkdir -p "$tmp/drafter"
cp "$src/tests/golden/dspark/dspark.json" "$src/tests/golden/dspark/model.safetensors" "$tmp/drafter/"
# 12 prompts of 6..13 ids in [3, 128), deterministic.
for i in $(seq 0 11); do
  ids=""
  for j in $(seq 0 $((5 + i % 8))); do ids+="${ids:+, }$(((i * 37 + j * 11 + 5) % 125 + 3))"; done
  echo "{\"ids\": [$ids]}"
done >"$tmp/prompts.jsonl"

before=$(sha256sum "$tmp/drafter/dspark.json")
out=$("$specula" calibrate --model "$target" --draft "$tmp/drafter" --prompt-file "$tmp/prompts.jsonl" \
  -n 24 --min-samples 5 --dry-run 2>&1) || fail "--dry-run exited $?: $out"
[[ $(sha256sum "$tmp/drafter/dspark.json") == "$before" ]] || fail "--dry-run changed dspark.json"
[[ $out == *"better calibrated:"* ]] || fail "no 'better calibrated' line: $out"

out=$("$specula" calibrate --model "$target" --draft "$tmp/drafter" --prompt-file "$tmp/prompts.jsonl" \
  -n 24 --min-samples 5 --plot "$tmp/reliability.png" 2>&1) || fail "calibrate exited $?: $out"
echo "$out"
[[ $out == *"ECE (held-out"* ]] || fail "no held-out ECE line"
[[ $out == *"wrote calibration"* ]] || fail "no 'wrote calibration' line"
[[ $(head -c 8 "$tmp/reliability.png" | od -An -tx1 | tr -d ' \n') == 89504e470d0a1a0a ]] ||
  fail "--plot did not write a PNG"
json=$tmp/drafter/dspark.json
jq -e '.calibration.thresholds | length == 5 and all(.[]; . >= 0 and . <= 1) and .[0] == 0' "$json" \
  >/dev/null || fail "calibration.thresholds: $(jq -c .calibration "$json")"
jq -e '.calibration.sts_temperatures | length == 5 and all(.[]; . > 0)' "$json" >/dev/null ||
  fail "calibration.sts_temperatures: $(jq -c .calibration "$json")"
jq -e '.calibration.samples > 0 and .calibration.target == 0.5' "$json" >/dev/null ||
  fail "calibration.samples/target: $(jq -c .calibration "$json")"
# Everything but the calibration is what it was, in the same order.
[[ $(jq -c 'del(.calibration)' "$json") == "$(jq -c 'del(.calibration)' "$src/tests/golden/dspark/dspark.json")" ]] ||
  fail "fields other than calibration changed"
[[ $(jq -r 'keys_unsorted | join(",")' "$json") == "$(jq -r 'keys_unsorted | join(",")' "$src/tests/golden/dspark/dspark.json")" ]] ||
  fail "top-level field order changed"
# The calibrated drafter loads and prunes at its thresholds.
out=$("$specula" generate --model "$target" --draft "$tmp/drafter" --prompt-ids 3,4,5,6 -n 8 2>&1) ||
  fail "generate with the calibrated drafter exited $?: $out"
[[ $out == *"calibrated thresholds"* ]] || fail "the calibrated drafter did not load its thresholds: $out"

# --prompt-format code-block and --num-prompts on text prompts: dense_kev with
# the byte-level test tokenizer cut to its 128 ids (no merges), so that the
# code blocks' ASCII characters are ids in [0, 128); the first 4 of 5 prompts
# (the fifth has no code block), split 3 fit / 1 held-out.
mkdir -p "$tmp/text_target"
cp "$target/config.json" "$target/model.safetensors" "$tmp/text_target/"
jq '.model.vocab |= with_entries(select(.value < 128)) | .model.merges = [] |
  .added_tokens |= map(select(.id < 128))' "$src/tests/golden/tokenizer/bytelevel/tokenizer.json" \
  >"$tmp/text_target/tokenizer.json"
cat >"$tmp/code.jsonl" <<'P'
{"turns": ["Complete the function:\n```python\nx=a+b*2\n```\n"]}
{"turns": ["Complete this:\n```\nf(x)\n```"]}
{"turns": ["```py\ny=(x+1)*2\n```"]}
{"turns": ["Finish:\n```python\nf(a,b)\n```"]}
{"turns": ["no code block here"]}
P
out=$("$specula" calibrate --model "$tmp/text_target" --draft "$tmp/drafter" --prompt-file "$tmp/code.jsonl" \
  --prompt-format code-block --num-prompts 4 -n 24 --min-samples 5 --dry-run 2>&1) ||
  fail "calibrate --prompt-format code-block exited $?: $out"
[[ $out == *"fit on 3 prompts"*"evaluated on 1 held-out prompts"* ]] ||
  fail "code-block --num-prompts 4: not a 3/1 split: $out"

# Errors: a DeepSpec-layout folder without --dry-run, and a folder that is not DSpark.
out=$("$specula" calibrate --model "$target" --draft "$src/tests/golden/dspark_deepspec" \
  --prompt-file "$tmp/prompts.jsonl" 2>&1)
status=$?
[[ $status -eq 1 && $out == *"--dry-run"* ]] || fail "DeepSpec folder: status $status: $out"
out=$("$specula" calibrate --model "$target" --draft "$src/tests/golden/dense_kev_assistant" \
  --prompt-file "$tmp/prompts.jsonl" 2>&1)
status=$?
[[ $status -eq 1 && $out == *"not a DSpark drafter"* ]] || fail "assistant folder: status $status: $out"
echo '{"text": "x"}' >"$tmp/bad.jsonl"
out=$("$specula" calibrate --model "$target" --draft "$tmp/drafter" --prompt-file "$tmp/bad.jsonl" 2>&1)
status=$?
[[ $status -eq 1 && $out == *"bad.jsonl:1"* ]] || fail "bad prompt file: status $status: $out"
exit $failed
