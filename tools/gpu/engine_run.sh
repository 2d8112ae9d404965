#!/usr/bin/env bash
# One GPU run for the engine core: CUDA tests, the 31B step costs (bench
# --micro, with the fixed-piece prefill against one forward), the 31B batch-1
# end-to-end speedup at a replayed acceptance profile, and the continuous-
# arrival serving workload on the embedded family and on the 31B shape.
# A summary table last; logs and JSON under $OUT.
#
#   OUT=/tmp/out bash tools/gpu/engine_run.sh [BIN_DIR]
# BIN_DIR holds specula and specula_cuda_tests (or their .xz), built here or
# elsewhere with -DSPECULA_CUDA=ON for sm_90a; default: build-gpu (built now).
# Binaries built in another checkout find the models and fixtures through
# their compiled-in source path: the script links that path to this checkout
# when it is missing (root on the GPU machine).
# Environment: STAGES="tests micro e2e serving" (any subset), PROFILE (replay
# acceptance, default 0.84,0.60,0.39,0.27), TEST_FILTER (gtest filter).
set -uo pipefail

OUT=${OUT:?set OUT to the folder for logs and results}
STEP_KILL_AFTER=20
source "$(dirname "$0")/lib.sh"
STAGES=${STAGES:-"tests micro e2e serving"}
PROFILE=${PROFILE:-0.84,0.60,0.39,0.27}
BIN=${1:-}

machine_header --print

if [[ -z $BIN ]]; then
  BIN=build-gpu
  step build 900 build.log bash -c "cmake -S . -B $BIN -G Ninja -DCMAKE_BUILD_TYPE=Release \
    -DSPECULA_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES=90a >/dev/null &&
    cmake --build $BIN -j $(nproc) --target specula specula_cuda_tests" || exit 1
  SPECULA=$BIN/apps/specula
  TESTS=$BIN/tests/specula_cuda_tests
else
  use_bins "$BIN"
fi

if has_stage tests; then
  run_cuda_tests "$TESTS" 330
fi

if has_stage micro; then
  step "micro 31b" 200 micro_31b.log bash -c "'$SPECULA' bench --device cuda --random-weights 31b \
    --micro --batch 1 8 --draft random --gen-tokens 64 --json >'$OUT/micro_31b.json'"
fi

if has_stage e2e; then
  # Batch 1, 31B shape: plain against the replayed profile (SIMULATED acceptance).
  step "e2e 31b" 200 e2e_31b.log bash -c "'$SPECULA' bench --device cuda --random-weights 31b \
    --draft replay:$PROFILE --draft-tokens 4 --batch 1 --prompt-tokens 128 --gen-tokens 256 \
    -c 1024 --json >'$OUT/e2e_31b.json'"
fi

if has_stage serving; then
  step "serving embedded" 120 serving_embedded.log bash -c "'$SPECULA' bench --device cuda \
    --model models/gemma4-tiny-py --draft models/gemma4-tiny-py-assistant --serving \
    --num-prompts 64 --request-rate 40 --prompt-tokens 128 --gen-tokens 128 --max-num-seqs 16 \
    --max-batch-tokens 1024 --draft-tokens 3 -c 1024 --json >'$OUT/serving_embedded.json'"
  step "serving 31b" 240 serving_31b.log bash -c "'$SPECULA' bench --device cuda \
    --random-weights 31b --draft replay:$PROFILE --serving --num-prompts 48 --request-rate 4 \
    --prompt-tokens 256 --gen-tokens 128 --max-num-seqs 16 --max-batch-tokens 2048 \
    --draft-tokens 4 -c 1024 --json >'$OUT/serving_31b.json'"
fi

python3 - "$OUT" <<'EOF'
import json, os, sys
out = sys.argv[1]
def load(name):
    try:
        with open(os.path.join(out, name)) as f:
            lines = f.read().strip().splitlines()
        return json.loads(lines[-1]) if lines else None
    except (OSError, ValueError):
        return None
print("\n================ summary ================")
m = load("micro_31b.json")
if m:
    mi = m["micro"]
    for s in mi.get("decode", []):
        print(f"31b decode batch {s.get('batch')}: {s.get('step_ms', 0):.3f} ms, roofline {100*s.get('roofline_fraction', 0):.1f}%")
    v = mi.get("verify") or {}
    print(f"31b verify window of {v.get('tokens')}: {v.get('verify_ms', 0):.3f} ms ({v.get('ratio', 0):.3f} x step)")
    d = mi.get("drafter") or {}
    print(f"31b drafter step: {d.get('step_ms', 0):.3f} ms ({100*d.get('ratio', 0):.2f}% of step)")
    p = mi.get("prefill", {})
    print(f"31b prefill {p.get('tokens')} tokens: {p.get('ms', 0):.1f} ms")
    for q in p.get("fixed_pieces", []):
        print(f"  in pieces of {q['chunk']}: {q['ms']:.1f} ms = {q['vs_one_forward']:.3f}x")
    for g in mi.get("goals", []):
        print(f"goal {g['goal']}: {g['value']:.3f} ({g['target']}) {'met' if g['met'] else 'NOT met'}")
e = load("e2e_31b.json")
if e:
    for r in e["results"]:
        print(f"31b e2e batch 1 {r['mode']} k={r['draft_tokens']}: {r['decode_tokens_per_second']:.1f} tok/s, tau {r['tau']:.2f}, speedup {r['speedup']:.2f}x, by position {[round(x, 3) for x in r.get('acceptance_by_position', [])]}")
for name in ("serving_embedded.json", "serving_31b.json"):
    s = load(name)
    if not s:
        continue
    for r in s["serving"]:
        print(f"{name[:-5]} {r['mode']:<12} k={r['draft_tokens']}: {r['output_tokens_per_second']:.1f} tok/s, "
              f"ttft p50/p99 {r['ttft_p50_ms']:.1f}/{r['ttft_p99_ms']:.1f} ms, itl p50/p99 "
              f"{r['itl_p50_ms']:.1f}/{r['itl_p99_ms']:.1f} ms, tpot {r['tpot_mean_ms']:.2f} ms, "
              f"tau {r['tau']:.2f}, speedup {r['speedup']:.2f}x, differ {r.get('requests_differing_from_plain', '-')}")
EOF
cat "$STATUS"
