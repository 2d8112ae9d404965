// SPDX-License-Identifier: Apache-2.0
// Log-probabilities of one row of raw logits, for the API's logprobs and
// top_logprobs (the target's log_softmax before temperature, penalties and
// truncation: vLLM's default "raw" logprobs). The one host definition: the
// CPU backend's logprob_rows runs it row by row, and the engine's host paths
// call it on logits they already hold.
#pragma once

#include <cstdint>
#include <span>

namespace specula {

// log_softmax(x)[t] = (x[t] - max) - log_sum, with max = max(x) (f32) and
// log_sum = log Σ exp(x - max) (the sum in double, rounded to f32).
struct RowLogSoftmax {
  float max = 0.0f;
  float log_sum = 0.0f;
  float at(float x) const { return (x - max) - log_sum; }
};
// The row must have a finite max (NaNs are skipped by the max).
RowLogSoftmax row_log_softmax(std::span<const float> logits);

// The ids of the row's ids.size() largest entries in torch.topk order (larger
// first, equal values lower id first, a NaN above any number), in one pass.
// ids.size() <= logits.size().
void top_logit_ids(std::span<const float> logits, std::span<int32_t> ids);

}  // namespace specula
