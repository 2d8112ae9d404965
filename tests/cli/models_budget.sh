#!/usr/bin/env bash
# The embedded models (models/) stay small enough for the working tree to travel to the GPU
# machine (64 MiB in all): at most 32 MB together, no file over 16 MB (issue #32). Every
# folder there is a checkpoint the engine loads: config.json, or a DSpark drafter's dspark.json.
# Usage: models_budget.sh SPECULA_BINARY SOURCE_DIR
set -uo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"
models=$src/models
[[ -d $models ]] || { echo "SKIP: no models/"; exit 77; }
total=0
while IFS= read -r -d '' f; do
  size=$(stat -c %s "$f")
  total=$((total + size))
  ((size <= 16000000)) || fail "${f#"$src"/} is $size bytes, over 16 MB"
done < <(find "$models" -type f -print0)
if ((total <= 32000000)); then
  echo "models/ holds $total bytes (budget 32 MB): ok"
else
  fail "models/ holds $total bytes, over the 32 MB budget"
fi
for d in "$models"/*/; do
  [[ -f $d/config.json || -f $d/dspark.json ]] ||
    fail "${d#"$src"/} has neither config.json nor dspark.json"
done
exit $failed
