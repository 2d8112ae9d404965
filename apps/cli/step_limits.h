// SPDX-License-Identifier: Apache-2.0
// What a forward of a Gemma 4 target must at least cost on a device, for
// `specula bench --micro` (apps/cli/bench_micro.cpp): the bytes it reads
// (weights, KV cache) and the flops it multiplies, and the limit
// max(bytes / copy bandwidth, flops / matrix peak) that a step is measured
// against. Counts are per forward, from the config alone.
#pragma once

#include <cstdint>
#include <string_view>

#include "engine/core/dtype.h"
#include "engine/model/gemma4/config.h"

namespace specula::cli {

// Matrix-product parameters one token multiplies by (the lm head excluded):
// q/k/v/o, the dense MLP, PLE gate/projection and the PLE model projection,
// the MoE router and top_k of the experts.
double linear_params_per_token(const gemma4::Gemma4Config& c);

// K/V bytes one query at sequence length `len` (itself included) reads, per
// row: every layer reads its cache (a KV-shared layer re-reads its donor's),
// sliding layers min(window, len) rows, full layers len rows; K and V in the
// cache's dtype (fp8 with its scales).
int64_t kv_bytes_read(const gemma4::Gemma4Config& c, int64_t len, DType dtype);

// Attention flops (QKᵀ and PV: 4·Nh·D a visible key and layer) of `tokens`
// queries at positions first .. first + tokens - 1 of one row, each seeing
// the keys up to its own position (at most the window's on sliding layers).
double attention_flops(const gemma4::Gemma4Config& c, int64_t first, int64_t tokens);

// Flops of one forward of `tokens` new tokens in each of `rows` rows whose
// caches hold `len` positions before it, with logits for `logits` tokens a
// row: 2·linear_params a token, 2·V·H a logit row, and attention.
double forward_flops(const gemma4::Gemma4Config& c, int64_t rows, int64_t len, int64_t tokens,
                     int64_t logits);

// Prefill of n tokens from position 0 with logits for the last:
// forward_flops(c, 1, 0, n, 1).
double prefill_flops(const gemma4::Gemma4Config& c, int64_t n);

// The least time a step of `bytes` read and `flops` multiplied can take on a
// device of copy bandwidth `bytes_per_second` (read + write counted, as bench
// measures it) and matrix peak `flops_per_second`: the larger of the two
// times, and which it is.
struct StepLimit {
  double memory_seconds = 0;
  double compute_seconds = 0;
  double seconds = 0;      // max of the two
  std::string_view bound;  // "memory" or "compute"
  double fraction(double measured_seconds) const { return seconds / measured_seconds; }
};
StepLimit step_limit(double bytes, double flops, double bytes_per_second, double flops_per_second);

}  // namespace specula::cli
