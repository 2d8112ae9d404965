#!/usr/bin/env bash
# tools/train/train_dspark.py end to end on tiny data, CPU (skipped, exit 77,
# without python3 or torch; CI here has no torch, the GPU machine has).
# Shards: 8 greedy sequences of dense_kev (specula dspark-record + score
# --layer-hidden, lib_shards.sh as in train_alignment.sh). Checks: --check-reference (the
# batched module against tests/golden/dspark; skipped without transformers),
# 30 steps of training with a held-out evaluation, the log and export files,
# --resume to 40 steps, and that `specula generate` loads the export (names,
# shapes and the target's config hash as the engine checks them).
# Usage: train_smoke.sh SPECULA_BINARY SOURCE_DIR
set -uo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"
source "$(dirname "${BASH_SOURCE[0]}")/lib_shards.sh"
need python3
python3 -c "import torch" 2>/dev/null || { echo "SKIP: torch not installed"; exit 77; }
tools=$src/tools/train
target=$src/tests/golden/dense_kev

if python3 -c "import transformers, safetensors" 2>/dev/null; then
  check check-reference python3 "$tools/train_dspark.py" --check-reference
else
  echo "note: transformers/safetensors missing, --check-reference not run"
fi

for i in $(seq 0 7); do
  ids=""
  for j in $(seq 0 $((4 + i % 5))); do ids+="${ids:+,}$(((i * 37 + j * 11 + 5) % 125 + 3))"; done
  dspark_shard "sequence $i" "$tmp/seq$i" "$src/tests/golden/dspark" "$ids" 32 "$tmp/shards" "$i" || break
done
# Everything below trains on these shards and then on the first run's output:
# stop at the first failure there instead of reporting its consequences.
[[ $failed -eq 0 ]] || exit 1

args=(--shards "$tmp/shards" --target "$target" --out "$tmp/out" --device cpu --block-size 5 --layers 2
  --hidden 32 --heads 4 --markov-rank 16 --batch 8 --anchors-per-seq 4 --held-out-fraction 0.25
  --eval-every 10 --eval-anchors 16 --log-every 5 --seed 1)
check "training 30 steps" python3 "$tools/train_dspark.py" "${args[@]}" --steps 30 || exit 1
for f in model.safetensors dspark.json checkpoint.pt train_log.jsonl; do
  [[ -s $tmp/out/$f ]] && echo "export has $f: ok" || fail "export has $f: no $f in $tmp/out"
done
check "log and export content" python3 - "$tmp/out" <<'PY' && tail -n 1 "$tmp/log/log_and_export_content.log"
import json, math, sys
out = sys.argv[1]
log = [json.loads(l) for l in open(f"{out}/train_log.jsonl")]
evals = [r["eval"] for r in log if "eval" in r]
assert len(evals) == 3, evals
assert all(1 <= e["tau"] <= 6 and math.isfinite(e["loss"]) for e in evals), evals
# Training records only: the "start" record carries "loss" too, the loss formula as text.
steps = [r for r in log if "loss" in r and "event" not in r]
assert steps and all(math.isfinite(r["loss"]) for r in steps), steps
d = json.load(open(f"{out}/dspark.json"))
assert d["kind"] == "dspark-drafter" and d["variant"] == "dspark" and d["version"] == 1, d
assert d["config"]["tap_layers"] == [1, 2, 4] and d["config"]["block_size"] == 5, d["config"]
assert d["training"]["seed"] == 1 and "torch" in d["training"]["versions"], d["training"]
print("train log and export: ok; held-out tau", [round(e["tau"], 3) for e in evals])
PY
check "--resume to 40 steps" python3 "$tools/train_dspark.py" "${args[@]}" --steps 40 --resume || exit 1
evals=$(grep -c '"eval"' "$tmp/out/train_log.jsonl")
if [[ $evals -eq 4 ]]; then
  echo "--resume continued to step 40: ok"
else
  fail "--resume continued to step 40: $evals evaluations in train_log.jsonl, expected 4; the log's steps:"
  python3 -c 'import json, sys
for l in open(sys.argv[1]):
    r = json.loads(l)
    print("  |", r.get("event") or ("eval" if "eval" in r else "train"), "step", r.get("step"))' \
    "$tmp/out/train_log.jsonl"
fi
# --init-from with no steps re-exports the same weights (f32 both ways, so the same file), and it
# refuses an export of another shape, naming the field.
check "--init-from re-exports the weights" python3 "$tools/train_dspark.py" "${args[@]/$tmp\/out/$tmp/init}" \
  --steps 0 --init-from "$tmp/out" &&
  check "--init-from gives the same model.safetensors" cmp "$tmp/out/model.safetensors" "$tmp/init/model.safetensors"
layers3=("${args[@]/$tmp\/out/$tmp/init3}")
if python3 "$tools/train_dspark.py" "${layers3[@]}" --layers 3 --steps 1 --init-from "$tmp/out" >"$tmp/init3.log" 2>&1; then
  fail "--init-from accepted an export of 2 layers for a 3-layer run"
elif grep -q "config.num_layers is 2, this run has 3" "$tmp/init3.log"; then
  echo "--init-from refuses another shape: ok"
else
  fail "--init-from refuses another shape: $(tail -1 "$tmp/init3.log")"
fi
check "the engine loads the export" "$specula" generate --model "$target" --draft "$tmp/out" \
  --prompt-ids 3,17,33 -n 12
[[ $failed -eq 0 ]] && echo "train_smoke: all checks passed"
exit $failed
