#!/usr/bin/env bash
# Same-run A/B of two `specula` binaries (say the main branch's and a change's):
# runs `specula bench --micro --json` with each, alternating ROUNDS times on the
# same machine, and prints, per measurement, every round's value and the median.
# Why: H200s of the same kind differ by up to ~4% in step time from machine to
# machine, so only runs on one machine, interleaved, compare two binaries.
#
#   OUT=/tmp/ab bash tools/gpu/ab.sh BIN_A BIN_B
# Environment:
#   PRESET=31b        --random-weights preset (or a config.json)
#   ROUNDS=3          alternations (A, B, A, B, ...)
#   DEVICE=cuda       bench device
#   BENCH_ARGS="--batch 1 8 --reps 7 --prefill-tokens 64 --no-draft"   the rest of
#                     the bench command (after `bench --micro --json --device ...
#                     --random-weights ...`)
#   BENCH_TIMEOUT=300 seconds per bench run
#   ARGS_A, ARGS_B    bench flags added for that side only (say, the same
#                     binary twice with ARGS_B="--no-graphs")
#   ENV_A, ENV_B      VAR=value words set for that side only (say,
#                     ENV_B="CUDA_LAUNCH_BLOCKING=1")
# JSON results land in $OUT (a-1.json, b-1.json, ...).
set -euo pipefail

if [[ $# -ne 2 ]]; then
  sed -n '2,21p' "$0" >&2
  exit 2
fi
BIN_A=$1
BIN_B=$2
OUT=${OUT:?set OUT to the folder for the JSON results}
PRESET=${PRESET:-31b}
ROUNDS=${ROUNDS:-3}
DEVICE=${DEVICE:-cuda}
BENCH_TIMEOUT=${BENCH_TIMEOUT:-300}
BENCH_ARGS=${BENCH_ARGS:-"--batch 1 8 --reps 7 --prefill-tokens 64 --no-draft"}
ARGS_A=${ARGS_A:-}
ARGS_B=${ARGS_B:-}
ENV_A=${ENV_A:-}
ENV_B=${ENV_B:-}
mkdir -p "$OUT"
for bin in "$BIN_A" "$BIN_B"; do
  [[ -x $bin ]] || { echo "ab.sh: $bin is not an executable" >&2; exit 2; }
done

for ((round = 1; round <= ROUNDS; ++round)); do
  for side in a b; do
    bin=$BIN_A
    side_env=$ENV_A
    side_args=$ARGS_A
    [[ $side == b ]] && bin=$BIN_B && side_env=$ENV_B && side_args=$ARGS_B
    json=$OUT/$side-$round.json
    echo "round $round/$ROUNDS: $side ($bin)" >&2
    # shellcheck disable=SC2086  # BENCH_ARGS, side_args and side_env are lists of words
    env $side_env timeout "$BENCH_TIMEOUT" "$bin" bench --micro --json --device "$DEVICE" \
      --random-weights "$PRESET" $BENCH_ARGS $side_args >"$json" 2>"$OUT/$side-$round.stderr" ||
      { echo "ab.sh: $side round $round failed, see $OUT/$side-$round.stderr" >&2; exit 1; }
  done
done

python3 - "$OUT" "$ROUNDS" "$ENV_A $BIN_A $ARGS_A" "$ENV_B $BIN_B $ARGS_B" <<'EOF'
import json
import statistics
import sys

out, rounds, bin_a, bin_b = sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4]


def measures(path):
    micro = json.load(open(path))["micro"]
    rows = {}
    for d in micro.get("decode") or []:
        rows[f"decode step, batch {d['batch']} (ms)"] = d["step_ms"]
    if micro.get("verify"):
        rows[f"verify window of {micro['verify']['tokens']} (ms)"] = micro["verify"]["verify_ms"]
        rows["verify / decode step"] = micro["verify"]["ratio"]
    if micro.get("drafter"):
        rows["drafter / target step"] = micro["drafter"]["ratio"]
    if micro.get("prefill"):
        rows[f"prefill of {micro['prefill']['tokens']} (ms)"] = micro["prefill"]["ms"]
    return rows


sides = {s: [measures(f"{out}/{s}-{r}.json") for r in range(1, rounds + 1)] for s in "ab"}
print(f"A = {bin_a}\nB = {bin_b}\n")
print(f"{'measure':<30} {'A rounds':<28} {'B rounds':<28} {'A median':>9} {'B median':>9} {'B/A':>6}")
for name in sides["a"][0]:
    a = [r[name] for r in sides["a"] if name in r]
    b = [r[name] for r in sides["b"] if name in r]
    if not a or not b:
        continue
    ma, mb = statistics.median(a), statistics.median(b)
    fmt = lambda v: " ".join(f"{x:.3f}" for x in v)
    print(f"{name:<30} {fmt(a):<28} {fmt(b):<28} {ma:9.3f} {mb:9.3f} {mb / ma:6.3f}")
EOF
