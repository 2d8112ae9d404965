# shellcheck shell=bash
# How the DSpark training tests (train_alignment.sh, train_smoke.sh) turn an
# engine run into a training shard; sourced after lib.sh (uses specula, tools,
# target and check):
#   dspark_shard LABEL DIR DRAFT PROMPT_IDS N SHARDS [INDEX]
# `specula dspark-record` runs the drafter DRAFT over $target greedily from
# PROMPT_IDS for N tokens (DIR/record.safetensors: every commit's taps, every
# round's anchor); `specula score --layer-hidden` forwards the recorded
# sequence ONCE (DIR/score.safetensors); check_alignment.py shard-from-score
# writes SHARDS/shard_<INDEX>.safetensors (specula-dspark-shard-v1; INDEX
# default 0) from them. One check line per step, named "LABEL: <step>"; stops
# at the first failing step and returns 1.
dspark_shard() {
  local label=$1 dir=$2 draft=$3 ids=$4 n=$5 shards=$6 index=${7:-0}
  mkdir -p "$dir"
  check "$label: dspark-record" "$specula" dspark-record --model "$target" --draft "$draft" \
    --prompt-ids "$ids" -n "$n" --out "$dir/record.safetensors" || return 1
  local seq
  seq=$(python3 "$tools/check_alignment.py" sequence "$dir/record.safetensors") ||
    { fail "$label: reading the record"; return 1; }
  check "$label: score" "$specula" score --model "$target" --prompt-ids "$seq" --layer-hidden \
    --out "$dir/score.safetensors" || return 1
  check "$label: shard-from-score" python3 "$tools/check_alignment.py" shard-from-score \
    --score "$dir/score.safetensors" --record "$dir/record.safetensors" --target "$target" \
    --out "$shards" --index "$index"
}
