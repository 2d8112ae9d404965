#!/usr/bin/env bash
# `specula regen` through the real binary. On the embedded model (text
# prompts): shards, manifest and ledger as docs/dspark.md fixes them; the
# responses are what `generate --no-draft` gives; the hidden rows are what
# `score --layer-hidden` computes for the same sequence (to bf16 rounding);
# resume adds only new prompts and keeps the old shards; leftovers of a killed
# run (a .tmp, a shard the ledger does not name) are removed; a changed
# setting is refused. On dense_kev: taps from a DSpark drafter in either
# layout. Bad inputs exit 1 naming the flag, file or value.
# Usage: regen.sh SPECULA_BINARY SOURCE_DIR
set -uo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"
need jq
need python3

# A safetensors reader on the standard library only: `st.py FILE` prints
# {"meta": ..., "tensors": {name: {"dtype", "shape", "values" (ints/floats)}}}.
cat >"$tmp/st.py" <<'PY'
import json, struct, sys
def load(path):
    with open(path, "rb") as f:
        data = f.read()
    n = struct.unpack("<Q", data[:8])[0]
    header = json.loads(data[8:8 + n])
    base = 8 + n
    out = {"meta": header.pop("__metadata__", {}), "tensors": {}}
    for name, info in header.items():
        b, e = info["data_offsets"]
        raw = data[base + b:base + e]
        dt = info["dtype"]
        if dt == "BF16":
            vals = [struct.unpack("<f", struct.pack("<I", h << 16))[0]
                    for h in struct.unpack("<%dH" % (len(raw) // 2), raw)]
        elif dt == "F32":
            vals = list(struct.unpack("<%df" % (len(raw) // 4), raw))
        elif dt == "I32":
            vals = list(struct.unpack("<%di" % (len(raw) // 4), raw))
        elif dt == "I64":
            vals = list(struct.unpack("<%dq" % (len(raw) // 8), raw))
        out["tensors"][name] = {"dtype": dt, "shape": info["shape"], "values": vals}
    return out
if __name__ == "__main__":
    print(json.dumps(load(sys.argv[1])))
PY
st() { python3 "$tmp/st.py" "$1"; }

cat >"$tmp/prompts.jsonl" <<'P'
{"turns": ["def fibonacci(n):"]}
{"turns": ["class Stack:\n    def __init__(self):"]}
{"turns": ["import os\nfor name in os.listdir('.'):"]}
P
out=$tmp/out
# 2 prompts, 2 rows a batch, 1-token shards: one shard per batch.
log=$("$specula" regen --prompt-file "$tmp/prompts.jsonl" --out "$out" --tap-layers 0,4,8 -n 6 \
  --batch 2 --shard-tokens 1 --max-prompts 2 2>&1) || fail "regen exited $?: $log"
echo "$log"
[[ -f $out/shard_00000.safetensors && ! -e $out/shard_00001.safetensors ]] ||
  fail "expected exactly shard_00000: $(ls "$out")"
[[ $(cat "$out/ledger.txt") == $'0\tshard_00000.safetensors\n1\tshard_00000.safetensors' ]] ||
  fail "ledger: $(cat "$out/ledger.txt")"
jq -e '.tap_layers == [0,4,8] and .sampling.temperature == 0 and .sampling.max_tokens == 6 and
  .prompt_kind == "jsonl" and .prompt_count == 3 and (.shards | length == 1) and
  .shards[0].file == "shard_00000.safetensors" and .shards[0].sequences == 2 and
  .shards[0].tokens == .totals.tokens and (.target_config_hash | length == 64)' "$out/regen.json" \
  >/dev/null || fail "regen.json: $(cat "$out/regen.json")"

shard=$(st "$out/shard_00000.safetensors")
echo "$shard" | jq -e '.meta.format == "specula-dspark-shard-v1" and .meta.tap_layers == "0,4,8" and
  .meta.hidden_size == "256" and .meta.vocab_size != null and .meta.seed == "0" and
  .meta.temperature == "0" and .tensors.hidden.dtype == "BF16" and .tensors.ids.dtype == "I32" and
  .tensors.seq_starts.dtype == "I64" and .tensors.resp_starts.dtype == "I64" and
  .tensors.hidden.shape == [(.tensors.ids.shape[0]), 768] and .tensors.seq_starts.values[0] == 0 and
  (.tensors.seq_starts.values | length == 3) and .tensors.seq_starts.values[2] == .tensors.ids.shape[0] and
  (.tensors.resp_starts.values | length == 2)' >/dev/null ||
  fail "shard layout: $(echo "$shard" | jq -c '.meta, (.tensors | map_values(.shape))')"
hash=$(jq -r .target_config_hash "$out/regen.json")
[[ $(echo "$shard" | jq -r .meta.target_config_hash) == "$hash" ]] || fail "shard hash != manifest hash"

# Sequence 1: its prompt is the tokenizer's, its response what generate gives.
seq1=$(echo "$shard" | jq -c '.tensors as $t | $t.ids.values[$t.seq_starts.values[1]:$t.seq_starts.values[2]]')
r1=$(echo "$shard" | jq '.tensors.resp_starts.values[1] - .tensors.seq_starts.values[1]')
prompt1=$(echo "$seq1" | jq -r ".[:$r1] | join(\",\")")
resp1=$(echo "$seq1" | jq -c ".[$r1:]")
want=$("$specula" generate --prompt-ids "$prompt1" --no-draft -n 6 --json 2>/dev/null | jq -c .tokens)
[[ "$resp1" == "$want" ]] || fail "response of prompt 1: $resp1, generate --no-draft gives $want"
tok=$("$specula" tokenize --text $'class Stack:\n    def __init__(self):' 2>/dev/null | tr -d ' \n')
[[ $tok == *"$(echo "$seq1" | jq -r ".[1:$r1] | join(\",\")")"* ]] ||
  fail "prompt 1 ids $prompt1 do not match tokenize's $tok"

# Its hidden rows against score's hidden_states.{0,4,8} of the same sequence.
"$specula" score --prompt-ids "$(echo "$seq1" | jq -r 'join(",")')" --out "$tmp/score.safetensors" \
  --layer-hidden 2>/dev/null || fail "score exited $?"
cat >"$tmp/cmp.py" <<'PY'
import struct, sys
sys.path.insert(0, sys.argv[1])
from st import load
def bf16(x):  # f32 -> bf16 (round to nearest even), back to a float
    u = struct.unpack("<I", struct.pack("<f", x))[0]
    u = (u + 0x7FFF + ((u >> 16) & 1)) >> 16
    return struct.unpack("<f", struct.pack("<I", u << 16))[0]
shard, score = load(sys.argv[2]), load(sys.argv[3])
t = shard["tensors"]
s0, s1 = t["seq_starts"]["values"][1], t["seq_starts"]["values"][2]
H, taps = 256, [0, 4, 8]
hid = t["hidden"]["values"]
bad = 0
for p in range(s1 - s0):
    for k, tap in enumerate(taps):
        ref = score["tensors"]["hidden_states.%d" % tap]["values"][p * H:(p + 1) * H]
        got = hid[((s0 + p) * len(taps) + k) * H:((s0 + p) * len(taps) + k + 1) * H]
        for h, (a, b) in enumerate(zip(got, ref)):
            # The CPU backend is batch-invariant: the batched tapped forward
            # equals score's single forward bit for bit, then one rounding.
            if not a == bf16(b):
                bad += 1
                if bad <= 3:
                    print("position %d tap %d [%d]: shard %r, bf16(score) %r" % (p, tap, h, a, bf16(b)))
print("%d of %d values differ" % (bad, (s1 - s0) * len(taps) * H))
sys.exit(1 if bad else 0)
PY
python3 "$tmp/cmp.py" "$tmp" "$out/shard_00000.safetensors" "$tmp/score.safetensors" ||
  fail "hidden rows differ from score --layer-hidden"

# Resume: one more prompt -> one more shard; shard 0 untouched. A stale .tmp
# and an orphan shard (renamed, never in the ledger) are removed first.
sum0=$(sha256sum <"$out/shard_00000.safetensors")
echo junk >"$out/shard_00001.safetensors.tmp"
cp "$out/shard_00000.safetensors" "$out/shard_00004.safetensors"
log=$("$specula" regen --prompt-file "$tmp/prompts.jsonl" --out "$out" --tap-layers 0,4,8 -n 6 \
  --batch 2 --shard-tokens 1 2>&1) || fail "resumed regen exited $?: $log"
echo "$log"
[[ $log == *"1 of 3 prompts to do"* ]] || fail "resume did not skip the ledger's prompts: $log"
[[ ! -e $out/shard_00001.safetensors.tmp && ! -e $out/shard_00004.safetensors ]] ||
  fail "leftovers not removed: $(ls "$out")"
[[ $(sha256sum <"$out/shard_00000.safetensors") == "$sum0" ]] || fail "shard 0 changed on resume"
[[ -f $out/shard_00001.safetensors && $(wc -l <"$out/ledger.txt") -eq 3 ]] ||
  fail "resume: $(ls "$out"), ledger $(cat "$out/ledger.txt")"
[[ $(tail -1 "$out/ledger.txt") == $'2\tshard_00001.safetensors' ]] || fail "ledger: $(cat "$out/ledger.txt")"
jq -e '(.shards | length == 2) and .totals.sequences == 3 and .finished_prompts == 3' \
  "$out/regen.json" >/dev/null || fail "manifest after resume: $(cat "$out/regen.json")"
# Nothing left: a rerun adds nothing. A torn ledger line (a run killed
# mid-append: no newline) is dropped.
printf '9' >>"$out/ledger.txt"
log=$("$specula" regen --prompt-file "$tmp/prompts.jsonl" --out "$out" --tap-layers 0,4,8 -n 6 2>&1) ||
  fail "third run exited $?: $log"
[[ $log == *"0 of 3 prompts to do"* && ! -e $out/shard_00002.safetensors ]] || fail "third run: $log"
[[ $(wc -l <"$out/ledger.txt") -eq 3 && $(tail -c 1 "$out/ledger.txt" | od -An -c | tr -d ' ') == '\n' ]] ||
  fail "torn ledger line kept: $(cat "$out/ledger.txt")"

# A changed setting is refused, naming it.
expect_error() {  # expect_error PATTERN ARGS...: exit 1 and PATTERN in the message
  local pattern=$1
  shift
  local o
  o=$("$specula" regen "$@" 2>&1)
  local status=$?
  [[ $status -eq 1 && $o == *"$pattern"* ]] || fail "regen $*: status $status, wanted '$pattern': $o"
}
expect_error "tap_layers" --prompt-file "$tmp/prompts.jsonl" --out "$out" --tap-layers 0,4 -n 6
expect_error "temperature" --prompt-file "$tmp/prompts.jsonl" --out "$out" --tap-layers 0,4,8 -n 6 --temp 0.5
expect_error "max_tokens" --prompt-file "$tmp/prompts.jsonl" --out "$out" --tap-layers 0,4,8 -n 7

# Seeded sampling is reproducible, whatever the batching.
for b in 1 3; do
  "$specula" regen --prompt-file "$tmp/prompts.jsonl" --out "$tmp/s$b" --tap-layers 8 -n 6 --temp 0.9 \
    --seed 5 --batch $b -q >/dev/null 2>&1 || fail "sampled regen --batch $b exited $?"
done
[[ "$(st "$tmp/s1/shard_00000.safetensors" | jq -c .tensors.ids.values)" == \
  "$(st "$tmp/s3/shard_00000.safetensors" | jq -c .tensors.ids.values)" ]] ||
  fail "sampled ids depend on the batching"
[[ $(st "$tmp/s1/shard_00000.safetensors" | jq -r .meta.temperature) == 0.9 ]] || fail "meta temperature"

# Text and folder sources.
printf 'first paragraph\nstill first\n\n\nsecond one\n' >"$tmp/prompts.txt"
"$specula" regen --prompt-file "$tmp/prompts.txt" --out "$tmp/txt" --tap-layers 8 -n 2 -q >/dev/null 2>&1 ||
  fail "text source exited $?"
jq -e '.prompt_kind == "text" and .prompt_count == 2 and .totals.sequences == 2' "$tmp/txt/regen.json" \
  >/dev/null || fail "text source: $(cat "$tmp/txt/regen.json")"
mkdir -p "$tmp/code/sub" "$tmp/code/.git"
seq 1 5 >"$tmp/code/a.py"
seq 1 3 >"$tmp/code/sub/b.py"
echo hidden >"$tmp/code/.git/c"
"$specula" regen --prompt-file "$tmp/code" --chunk-lines 2 --out "$tmp/folder" --tap-layers 8 -n 2 -q \
  >/dev/null 2>&1 || fail "folder source exited $?"
jq -e '.prompt_kind == "folder" and .prompt_count == 5 and .identity.chunk_lines == 2' \
  "$tmp/folder/regen.json" >/dev/null || fail "folder source: $(cat "$tmp/folder/regen.json")"

# Taps from DSpark drafters (dense_kev has no tokenizer: id prompts).
dense=$src/tests/golden/dense_kev
printf '{"ids": [2, 5, 9, 14]}\n{"ids": [2, 7, 7]}\n' >"$tmp/ids.jsonl"
"$specula" regen --model "$dense" --draft "$src/tests/golden/dspark" --prompt-file "$tmp/ids.jsonl" \
  --out "$tmp/d1" -n 4 -q >/dev/null 2>&1 || fail "--draft dspark exited $?"
want=$(jq -c .config.tap_layers "$src/tests/golden/dspark/dspark.json")
[[ $(jq -c .tap_layers "$tmp/d1/regen.json") == "$want" ]] ||
  fail "--draft dspark taps $(jq -c .tap_layers "$tmp/d1/regen.json"), dspark.json says $want"
"$specula" regen --model "$dense" --draft "$src/tests/golden/dspark_deepspec" --prompt-file "$tmp/ids.jsonl" \
  --out "$tmp/d2" -n 4 -q >/dev/null 2>&1 || fail "--draft DeepSpec exited $?"
want=$(jq -c '[.target_layer_ids[] + 1]' "$src/tests/golden/dspark_deepspec/config.json")
[[ $(jq -c .tap_layers "$tmp/d2/regen.json") == "$want" ]] ||
  fail "--draft DeepSpec taps $(jq -c .tap_layers "$tmp/d2/regen.json"), target_layer_ids + 1 = $want"

# Bad inputs.
expect_error "missing.jsonl: cannot open" --prompt-file "$tmp/missing.jsonl" --out "$tmp/e" --tap-layers 8
printf '\n\n' >"$tmp/blank.txt"
expect_error "no prompts" --prompt-file "$tmp/blank.txt" --out "$tmp/e" --tap-layers 8
echo '{"turns": [""]}' >"$tmp/empty.jsonl"
expect_error "empty.jsonl:1" --prompt-file "$tmp/empty.jsonl" --out "$tmp/e" --tap-layers 8
expect_error "tap 9 is outside [0, 8]" --prompt-file "$tmp/prompts.jsonl" --out "$tmp/e" --tap-layers 4,9
expect_error "exactly one of --draft" --prompt-file "$tmp/prompts.jsonl" --out "$tmp/e"
expect_error "prompts.jsonl:1" --prompt-file "$tmp/prompts.jsonl" --out "$tmp/e" --tap-layers 8 -n 5000
expect_error "dspark" --prompt-file "$tmp/prompts.jsonl" --out "$tmp/e" --draft "$src/tests/golden/dspark"
expect_error "not a DSpark drafter" --prompt-file "$tmp/prompts.jsonl" --out "$tmp/e" \
  --draft "$src/models/gemma4-tiny-py-assistant"
expect_error "/dev/null/x" --prompt-file "$tmp/prompts.jsonl" --out /dev/null/x --tap-layers 8
exit $failed
