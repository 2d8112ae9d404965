#!/usr/bin/env bash
# DSpark training/inference alignment (docs/dspark.md, "Training"): the
# examples tools/train/dspark_data.py builds must give the drafter exactly the
# context the engine gives it. `specula dspark-record` runs the golden DSpark
# drafter over dense_kev greedily and records every commit's tap rows and every
# round's anchor; `specula score --layer-hidden` forwards the resulting
# sequence ONCE (independent of the engine's incremental commits) and its taps
# become a specula-dspark-shard-v1 shard; check_alignment.py then requires, for
# every round with anchor position t: the drafter held positions 0 .. t-1
# (never the anchor's own tap), the example's context is those positions with
# bf16 bits equal to the engine's committed f32 taps rounded to bf16, the
# anchor and block ids match the sequence, and the target-hidden rows are the
# post-norm hiddens the verify judged the drafts with. The seed's off-by-ones
# (context including the anchor's tap; target hidden one position late) must be
# reported as mismatches. Run twice: with the golden drafter (anchor-only
# commits) and with an oracle copy that gets drafts accepted. Also: dspark_data's selftest and train_dspark.py
# --dump-examples (no torch needed).
# Usage: train_alignment.sh SPECULA_BINARY SOURCE_DIR
set -uo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"
source "$(dirname "${BASH_SOURCE[0]}")/lib_shards.sh"
need python3

tools=$src/tools/train
target=$src/tests/golden/dense_kev
gamma=5  # tests/golden/dspark's block size
python3 "$tools/check_alignment.py" selftest || fail "check_alignment.py selftest"

# One drafter/record: record, score the sequence once, build the shard (lib_shards.sh), check.
# $1 name, $2 drafter folder, $3 extra check flags.
align() {
  local d=$tmp/$1
  dspark_shard "$1" "$d" "$2" 3,17,33,2,90,41,7 40 "$d/shards" || return 1
  python3 "$tools/dspark_data.py" --shards "$d/shards" --block-size $gamma || fail "$1: dspark_data.py summary"
  python3 "$tools/train_dspark.py" --dump-examples 16 --shards "$d/shards" --block-size $gamma --seed 3 \
    --out "$d/examples.json" || fail "$1: train_dspark.py --dump-examples"
  python3 "$tools/check_alignment.py" check --record "$d/record.safetensors" --shards "$d/shards" \
    --block-size $gamma --examples "$d/examples.json" $3 ||
    fail "$1: the trainer's examples are not the engine's context"
  # The off-by-ones must be caught.
  local mode out status
  for mode in context+1 target+1 engine+1; do
    out=$(python3 "$tools/check_alignment.py" check --record "$d/record.safetensors" --shards "$d/shards" \
      --block-size $gamma --corrupt $mode 2>&1)
    status=$?
    [[ $status -eq 1 && $out == *MISMATCH* ]] || fail "$1: --corrupt $mode was not detected (status $status): $out"
  done
}

# The golden drafter (random weights) rejects nearly everything: each verify
# commits the anchor alone. The oracle copy's Markov head follows the golden
# sequence's bigrams, so its verifies commit accepted drafts too (rows from
# inside a verify window).
align golden "$src/tests/golden/dspark" ""
python3 "$tools/check_alignment.py" oracle-drafter --draft "$src/tests/golden/dspark" \
  --record "$tmp/golden/record.safetensors" --out "$tmp/oracle_drafter" || fail "oracle-drafter"
align oracle "$tmp/oracle_drafter" --expect-accepts
exit $failed
