#!/usr/bin/env bash
# Bad input through the real binary: each case must exit with status 1 (a
# clean error, never a crash or a signal) and name the offending thing.
# Usage: errors.sh SPECULA_BINARY SOURCE_DIR
set -uo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"
passed=0

expect_error() {  # name, expected substring, command...
  local name=$1 want=$2
  shift 2
  local out status
  out=$("$@" 2>&1 </dev/null)
  status=$?
  if [[ $status -eq 1 && $out == *"$want"* ]]; then
    passed=$((passed + 1))
  else
    failed=$((failed + 1))
    echo "FAIL $name: status $status, expected 1 and output containing '$want'; got: $out"
  fi
}

fixture=$src/tests/golden/dense_kev
expect_error missing-model "/nonexistent/model" "$specula" generate --model /nonexistent/model --prompt-ids 1,2
expect_error bad-ids "'abc'" "$specula" generate --model "$fixture" --prompt-ids 1,2,abc
expect_error id-outside-vocab "9999" "$specula" generate --model "$fixture" --prompt-ids 1,9999
expect_error prompt-too-long "context size of 8" "$specula" generate --model "$fixture" --ctx-size 8 \
  --prompt-ids 3,4,5,6,7,8,9,10,11 --max-tokens 1
expect_error bad-device "'tpu'" "$specula" generate --model "$fixture" --device tpu --prompt-ids 1,2
expect_error cuda-profile-on-cpu "--cuda-profile: needs --device cuda" "$specula" generate \
  --model "$fixture" --cuda-profile --prompt-ids 1,2
expect_error bad-kv-dtype "--kv-dtype: 'fp16' is not a KV cache dtype (expected auto, f32, bf16 or fp8)" \
  "$specula" generate --model "$fixture" --kv-dtype fp16 --prompt-ids 1,2
expect_error bad-kv-cache-dtype "--kv-dtype: 'int4' is not a KV cache dtype" "$specula" generate \
  --model "$fixture" --kv-cache-dtype int4 --prompt-ids 1,2
expect_error bad-kv-dtype-score "--kv-dtype: 'e4m3' is not a KV cache dtype" "$specula" score \
  --model "$fixture" --kv-dtype e4m3 --prompt-ids 1,2 --out "$tmp/never.safetensors"
# fp8 is a KV cache dtype every --kv-dtype verb takes (not an error), and the
# capacity line counts its bytes: (1 byte + a 4-byte scale per head_dim values).
fp8_out=$("$specula" generate --model "$fixture" --kv-dtype fp8 --prompt-ids 1,2 --max-tokens 3 --no-draft 2>&1 </dev/null)
if [[ $? -eq 0 && $fp8_out == *"KV cache: f8e4m3"* ]]; then
  passed=$((passed + 1))
else
  failed=$((failed + 1))
  echo "FAIL kv-dtype-fp8: expected success and a 'KV cache: f8e4m3' line; got: $fp8_out"
fi
for verb in generate score bench chat; do
  if "$specula" "$verb" --help 2>&1 | tr -s ' \n' ' ' | grep -q -- "or fp8 (e4m3"; then
    passed=$((passed + 1))
  else
    failed=$((failed + 1))
    echo "FAIL kv-dtype-help-$verb: --help does not describe --kv-dtype fp8"
  fi
done
expect_error bad-device-index "cuda:7" "$specula" generate --model "$fixture" --device cuda:7 --prompt-ids 1,2
expect_error draft-trace-device "CPU only" "$specula" draft-trace --model "$fixture" --device cuda \
  --draft "$src/tests/golden/dense_kev_assistant" --prompt-ids 1,2 --out "$tmp/trace.safetensors"
expect_error dspark-record-not-dspark "not a DSpark drafter folder" "$specula" dspark-record \
  --model "$src/tests/golden/dense_kev" --draft "$src/tests/golden/dense_kev_assistant" --prompt-ids 1,2 \
  --out "$tmp/record.safetensors"
expect_error invalid-utf8 "UTF-8" "$specula" generate --prompt $'def f():\xff\xfe' --max-tokens 4

mkdir -p "$tmp/llama"
echo '{"model_type": "llama", "hidden_size": 64}' >"$tmp/llama/config.json"
expect_error unknown-model-type "llama" "$specula" generate --model "$tmp/llama" --prompt-ids 1,2

mkdir -p "$tmp/truncated"
cp "$fixture/config.json" "$tmp/truncated/"
head -c 2000 "$fixture/model.safetensors" >"$tmp/truncated/model.safetensors"
expect_error truncated-checkpoint "model.safetensors" "$specula" generate --model "$tmp/truncated" --prompt-ids 1,2

printf '{"model": {"type": "BPE", "vocab": ' >"$tmp/tokenizer.json"
expect_error malformed-tokenizer "tokenizer.json" "$specula" tokenize --tokenizer "$tmp/tokenizer.json" --text hi

expect_error wrong-drafter "dense_kev_assistant" "$specula" generate --model "$src/tests/golden/e2b_like" \
  --draft "$src/tests/golden/dense_kev_assistant" --prompt-ids 1,2
mkdir -p "$tmp/bad_drafter"
cp "$src/tests/golden/dense_kev_assistant/"* "$tmp/bad_drafter/"
sed -i 's/"model_type": "gemma4_assistant"/"model_type": true/' "$tmp/bad_drafter/config.json"
expect_error drafter-model-type-bool "bad_drafter/config.json: model_type must be a string, got true" \
  "$specula" generate --model "$fixture" --draft "$tmp/bad_drafter" --prompt-ids 1,2
cp "$src/tests/golden/dense_kev_assistant/config.json" "$tmp/bad_drafter/"
sed -i 's/"num_kv_shared_layers": 2/"num_kv_shared_layers": []/' "$tmp/bad_drafter/config.json"
expect_error drafter-kv-shared-list "num_kv_shared_layers must be an integer, got []" \
  "$specula" generate --model "$fixture" --draft "$tmp/bad_drafter" --prompt-ids 1,2
mkdir -p "$tmp/no_layers"
cp "$fixture/"* "$tmp/no_layers/"
grep -v '"num_hidden_layers"' "$fixture/config.json" >"$tmp/no_layers/config.json"
expect_error config-without-layers "num_hidden_layers is missing" "$specula" generate \
  --model "$tmp/no_layers" --prompt-ids 1,2
expect_error empty-prompt "--prompt: the prompt is empty" "$specula" generate --model "$fixture" --prompt ""
expect_error negative-ctx-size "--ctx-size: -5 is not a context size" "$specula" generate \
  --model "$fixture" --prompt-ids 1,2 --ctx-size -5
# The embedded model's tokenizer has ids up to 8191; dense_kev's vocabulary is 128.
expect_error tokenizer-past-vocab "ids up to 8191 but the model $fixture has a vocabulary of 128" \
  "$specula" generate --model "$fixture" --tokenizer "$src/models/gemma4-tiny-py" --prompt hi
mkdir -p "$tmp/escaping_index"
cp "$fixture/config.json" "$tmp/escaping_index/"
echo '{"weight_map": {"model.embed_tokens.weight": "../../../../etc/passwd"}}' \
  >"$tmp/escaping_index/model.safetensors.index.json"
expect_error shard-outside-checkpoint "names shard '../../../../etc/passwd', outside the checkpoint folder" \
  "$specula" generate --model "$tmp/escaping_index" --prompt-ids 1,2
# A NaN in one weight: refused at load, naming the tensor (it decoded silently into token 0).
mkdir -p "$tmp/nan_weight"
cp "$fixture/config.json" "$fixture/model.safetensors" "$tmp/nan_weight/"
# A NaN in one f32 weight, written in place: the header (8-byte length, JSON)
# gives the tensor's data offset; the NaN goes into its element 3.
nan_file=$tmp/nan_weight/model.safetensors
nan_tensor=model.layers.1.self_attn.o_proj.weight
header_len=$(od -An -t u8 -N8 "$nan_file" | tr -d ' ')
nan_begin=$(dd if="$nan_file" bs=1 skip=8 count="$header_len" 2>/dev/null |
  grep -oE "\"$nan_tensor\":\{[^}]*\}" | grep -oE '"data_offsets":\[[0-9]+' | grep -oE '[0-9]+$')
printf '\x00\x00\xc0\x7f' |
  dd of="$nan_file" bs=1 seek=$((8 + header_len + nan_begin + 4 * 3)) conv=notrunc 2>/dev/null
expect_error nan-weight "weight $nan_tensor (f32 [32, 128]) holds NaN at element 3" \
  "$specula" generate --model "$tmp/nan_weight" --prompt-ids 1,2
expect_error bad-temperature "temperature" "$specula" generate --model "$fixture" --prompt-ids 1,2 --temperature -1
expect_error threads-huge "--threads: 8192 is out of range" "$specula" generate --model "$fixture" \
  --prompt-ids 1,2 --threads 8192
expect_error threads-huger "--threads: 100000 is out of range" "$specula" generate --model "$fixture" \
  --prompt-ids 1,2 --threads 100000
expect_error threads-negative "--threads: -3 is out of range" "$specula" generate --model "$fixture" \
  --prompt-ids 1,2 --threads -3

# chat: a bad line (invalid UTF-8, past the context) costs its turn only; the
# next line is answered with the bad ones forgotten (a 9-token prompt) and the session ends cleanly.
long_line=$(printf 'word %.0s' $(seq 1 100))
printf 'bad \xff\xfe line\n%s\nhi\n' "$long_line" |
  "$specula" chat --ctx-size 64 -n 4 --threads 1 >"$tmp/chat.out" 2>"$tmp/chat.err"
status=$?
chat_err=$(cat "$tmp/chat.err")
if [[ $status -eq 0 && $chat_err == *"invalid UTF-8"*"the chat goes on"* &&
  $chat_err == *"exceeds the context size of 64"*"the chat goes on"* &&
  $chat_err == *"prompt 9 tokens"*"generated 4 tokens"* ]]; then
  passed=$((passed + 1))
else
  failed=$((failed + 1))
  echo "FAIL chat-bad-line: status $status, expected 0, two dropped turns and a third answered; got: $chat_err"
fi

expect_error text-file-missing "--text-file: cannot open /nonexistent/text" "$specula" tokenize \
  --text-file /nonexistent/text

# tokenize --text-file: bytes as they are from a file or standard input (a NUL
# byte is a token of its own), and texts far past the command line's limit.
expect_output() {  # name, expected stdout, command... (stdin from the caller)
  local name=$1 want=$2
  shift 2
  local out status
  out=$("$@" 2>&1)
  status=$?
  if [[ $status -eq 0 && $out == "$want" ]]; then
    passed=$((passed + 1))
  else
    failed=$((failed + 1))
    echo "FAIL $name: status $status, expected 0 and '$want'; got: ${out:0:300}"
  fi
}
printf 'a\0b' >"$tmp/nul.txt"
expect_output text-file-nul "332,11,333" "$specula" tokenize --no-special --text-file "$tmp/nul.txt"
expect_output text-stdin-nul "332,11,333" "$specula" tokenize --no-special --text-file - <"$tmp/nul.txt"
yes 'hello world' | head -c 3000000 >"$tmp/long.txt"  # 3 MB: 1,250,000 tokens
expect_output text-stdin-long "1250000" \
  bash -c '"$1" tokenize --no-special --text-file - <"$2" | tr , "\n" | wc -l' _ "$specula" "$tmp/long.txt"

# serve: absurd flags are refused before anything loads; a busy port names itself.
# bench --micro: the default prefill shrinks to a small model's context (the embedded
# family's is 4096); one given past it is refused, naming both numbers.
expect_error micro-prefill-past-context "--prefill-tokens 4096 exceed the model's maximum context of 4096" \
  "$specula" bench --micro --no-draft --prefill-tokens 4096 --threads 1
expect_error serve-bad-port "--port: 99999" "$specula" serve --port 99999
expect_error serve-bad-max-num-seqs "--max-num-seqs: 0" "$specula" serve --max-num-seqs 0
expect_error serve-bad-timeout "--request-timeout: -1" "$specula" serve --request-timeout -1
expect_error serve-bad-body-size "--max-body-size: 10" "$specula" serve --max-body-size 10
"$specula" serve --threads 1 --port 0 --disable-log-requests 2>"$tmp/serve.log" &
holder=$!
port=""
for _ in $(seq 1 100); do
  port=$(grep -oE 'on http://127\.0\.0\.1:[0-9]+' "$tmp/serve.log" | grep -oE '[0-9]+$' | head -1)
  [[ -n $port ]] && break
  sleep 0.1
done
expect_error serve-port-in-use "127.0.0.1:${port:-unknown}" "$specula" serve --port "${port:-1}"
kill $holder 2>/dev/null
wait $holder 2>/dev/null

# The verify scheduler's flags (bench, serve) and a cached SPS table of another device.
expect_error bad-spec-scheduler "--spec-scheduler must be off, on or auto, got 'sometimes'" \
  "$specula" bench --model "$fixture" --spec-scheduler sometimes
expect_error serve-bad-spec-scheduler "--spec-scheduler must be off, on or auto, got 'yes'" \
  "$specula" serve --spec-scheduler yes
expect_error bad-spec-scheduler-min-rows "--spec-scheduler-min-rows must be >= 1, got 0" \
  "$specula" bench --model "$fixture" --spec-scheduler auto --spec-scheduler-min-rows 0
expect_error bad-sps-reps "--sps-reps must be in [1, 1000], got 0" \
  "$specula" bench --model "$fixture" --spec-scheduler on --sps-reps 0
cat >"$tmp/sps_other.json" <<'JSON'
{"kind": "specula-sps-table", "version": 1, "device": "cuda cuda:0, 139.8 GiB, NVIDIA H200",
 "model": "gemma4 0000000000000000 (1 weight bytes)", "points": [{"tokens": 1, "steps_per_sec": 100}]}
JSON
expect_error sps-cache-other-device "profiled on device \"cuda cuda:0, 139.8 GiB, NVIDIA H200\"" \
  "$specula" bench --model "$fixture" --draft "$src/tests/golden/dspark" --spec-scheduler on \
  --sps-cache "$tmp/sps_other.json" --batch 2 --gen-tokens 2 --prompt-tokens 4
echo '{"kind": "specula-sps-table", "version": 1, "points": [{"tokens": 0, "steps_per_sec": 1}]}' \
  >"$tmp/sps_bad.json"
expect_error sps-cache-malformed "sps_bad.json" \
  "$specula" bench --model "$fixture" --draft "$src/tests/golden/dspark" --spec-scheduler on \
  --sps-cache "$tmp/sps_bad.json" --batch 2 --gen-tokens 2 --prompt-tokens 4

# bench --prompt-file SET.jsonl: the set is read (and its code blocks found)
# before any model loads; a bad line, count or format names the file and line.
printf '%s\n' '{"turns": ["Solve:\n```python\ndef f():\n```"]}' '{"turns": ["no code here"]}' \
  '{"ids": [2, 5, 9]}' >"$tmp/set.jsonl"
expect_error bench-set-no-code-block "set.jsonl:2: --prompt-format code-block: the first turn has no fenced" \
  "$specula" bench --model "$fixture" --prompt-file "$tmp/set.jsonl" --prompt-format code-block
printf '%s\n' '{"turns": ["```\nx = 1\n```"]}' '{"ids": [2, 5, 9]}' >"$tmp/ids.jsonl"
expect_error bench-set-ids-code-block "ids.jsonl:2: an {\"ids\": [...]} prompt has no text" \
  "$specula" bench --model "$fixture" --prompt-file "$tmp/ids.jsonl" --prompt-format code-block
printf '%s\n' '{"ids": [2, 5]}' '{"ids": [2, 5' >"$tmp/broken.jsonl"
expect_error bench-set-malformed "broken.jsonl:2: not a JSON object" \
  "$specula" bench --model "$fixture" --prompt-file "$tmp/broken.jsonl"
expect_error bench-num-prompts-0 "--num-prompts 0: $tmp/set.jsonl holds 3 prompts; give a count in [1, 3]" \
  "$specula" bench --model "$fixture" --prompt-file "$tmp/set.jsonl" --num-prompts 0
expect_error bench-num-prompts-absurd "--num-prompts 1000000: $tmp/set.jsonl holds 3 prompts" \
  "$specula" bench --model "$fixture" --prompt-file "$tmp/set.jsonl" --num-prompts 1000000
expect_error bench-num-prompts-no-set "--num-prompts: takes the first N prompts of a prompt set" \
  "$specula" bench --model "$fixture" --num-prompts 4
expect_error bench-prompt-format-text-file "--prompt-format chat: formats the prompts of a prompt set" \
  "$specula" bench --model "$fixture" --prompt-format chat --prompt-file "$src/README.md"
expect_error bench-prompt-format-unknown "--prompt-format" \
  "$specula" bench --model "$fixture" --prompt-file "$tmp/set.jsonl" --prompt-format markdown
expect_error bench-set-serving "--serving draws its own prompt lengths" \
  "$specula" bench --model "$fixture" --prompt-file "$tmp/set.jsonl" --serving
printf '%s\n' '{"ids": [2, 5, 9, 14, 3, 4, 6, 7, 8]}' >"$tmp/long.jsonl"
expect_error bench-set-prompt-too-long \
  "long.jsonl:1: the prompt is 9 tokens (--prompt-format text); with --gen-tokens 4 that is 13 tokens, past the context of 8 tokens" \
  "$specula" bench --model "$fixture" --ctx-size 8 --prompt-file "$tmp/long.jsonl" --gen-tokens 4


# calibrate and ab read prompt sets as bench does (read_formatted_prompt_set):
# the same errors, before any model loads.
calib=("$specula" calibrate --model "$fixture" --draft "$src/tests/golden/dspark" --dry-run)
ab=("$specula" ab --model "$fixture" --draft-a ngram --draft-b ngram)
for cmd in calib ab; do
  declare -n run=$cmd
  expect_error "$cmd-set-no-code-block" "set.jsonl:2: --prompt-format code-block: the first turn has no fenced" \
    "${run[@]}" --prompt-file "$tmp/set.jsonl" --prompt-format code-block
  expect_error "$cmd-set-ids-code-block" "ids.jsonl:2: an {\"ids\": [...]} prompt has no text" \
    "${run[@]}" --prompt-file "$tmp/ids.jsonl" --prompt-format code-block
  expect_error "$cmd-set-ids-chat" "ids.jsonl:2: an {\"ids\": [...]} prompt has no text to format as chat" \
    "${run[@]}" --prompt-file "$tmp/ids.jsonl" --prompt-format chat
  expect_error "$cmd-num-prompts-0" "--num-prompts 0: $tmp/set.jsonl holds 3 prompts; give a count in [1, 3]" \
    "${run[@]}" --prompt-file "$tmp/set.jsonl" --num-prompts 0
  expect_error "$cmd-num-prompts-past" "--num-prompts 4: $tmp/set.jsonl holds 3 prompts; give a count in [1, 3]" \
    "${run[@]}" --prompt-file "$tmp/set.jsonl" --num-prompts 4
  expect_error "$cmd-prompt-format-unknown" "--prompt-format: 'markdown' is not a prompt format" \
    "${run[@]}" --prompt-file "$tmp/set.jsonl" --prompt-format markdown
  unset -n run
done
# --num-prompts keeps the first N before calibrate's fit/held-out split.
expect_error calib-num-prompts-1 "calibrate needs at least 2 prompts (fit and held-out); --num-prompts 1 keeps 1" \
  "${calib[@]}" --prompt-file "$tmp/set.jsonl" --num-prompts 1
expect_error ab-set-prompt-too-long \
  "long.jsonl:1: the prompt is 9 tokens (--prompt-format text); with --max-tokens 4 that is 13 tokens, past the context of 8 tokens" \
  "${ab[@]}" --ctx-size 8 --prompt-file "$tmp/long.jsonl" --max-tokens 4

echo "cli errors: $passed passed, $failed failed"
[[ $failed -eq 0 ]]
