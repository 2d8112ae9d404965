#!/usr/bin/env bash
# `specula bench --micro --json` through the real binary on the embedded
# model (CPU, small device probes): every decode row reports its step limit
# (max of memory and compute time), the fraction of it reached and a verify
# window of --verify-tokens tokens a row; the batched goals appear for the
# batches that ran.
# Usage: bench_micro.sh SPECULA_BINARY SOURCE_DIR
set -uo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"
need jq

out=$("$specula" bench --micro --no-draft --batch 1 8 --reps 1 --prefill-tokens 64 --threads 2 \
  --peak-size 128 --copy-mib 16 --verify-tokens 3 --json 2>"$tmp/err") ||
  fail "bench --micro: exit $?: $(cat "$tmp/err")"
echo "$out" | jq -e '.micro |
  (.decode | length) == 2 and ([.decode[].batch] == [1, 8]) and
  all(.decode[];
    .step_ms > 0 and .flops > 0 and .limit_ms > 0 and
    (.bound == "memory" or .bound == "compute") and
    (.limit_fraction - .limit_ms / .step_ms | fabs) < 1e-9 and
    .limit_fraction >= .roofline_fraction - 1e-12 and
    .verify.tokens == 3 and .verify.step_ms > 0 and
    (.verify.ratio - .verify.step_ms / .step_ms | fabs) < 1e-9 and
    .verify.limit_ms > 0 and .verify.limit_fraction > 0) and
  (.decode[1].flops - 8 * .decode[0].flops | fabs) < 1e-6 * .decode[1].flops and
  ([.goals[].goal] | index("decode batch 8: fraction of limit") != null) and
  ([.goals[].goal] | index("verify window batch 8 / decode step") != null) and
  ([.goals[].goal] | index("decode batch 64: step ms") == null)' >/dev/null ||
  fail "bench --micro json: $out"

# The text table has the limit columns.
"$specula" bench --micro --no-draft --batch 2 --reps 1 --prefill-tokens 64 --threads 2 \
  --peak-size 128 --copy-mib 16 >"$tmp/table" 2>&1 || fail "bench --micro table: $(cat "$tmp/table")"
grep -q "limit ms" "$tmp/table" && grep -q "of limit" "$tmp/table" ||
  fail "bench --micro table lacks the limit columns: $(cat "$tmp/table")"
exit $failed
