// SPDX-License-Identifier: Apache-2.0
#include "engine/sampling/sampling_params.h"

#include <algorithm>
#include <cmath>

#include "engine/core/error.h"

namespace specula {

bool SamplingParams::is_stop_token(int32_t token) const {
  return std::find(stop_token_ids.begin(), stop_token_ids.end(), token) != stop_token_ids.end();
}

void SamplingParams::validate(int64_t vocab_size) const {
  // Written as !(in range) so that NaN fails every check.
  if (!(std::isfinite(temperature) && temperature >= 0.0f)) {
    fail(
        "sampling parameter temperature = {} is out of range: it must be finite and >= 0 "
        "(0 selects greedy decoding)",
        temperature);
  }
  if (top_k < -1) {
    fail("sampling parameter top_k = {} is out of range: it must be >= 1, or 0 / -1 to disable it",
         top_k);
  }
  if (!(top_p > 0.0f && top_p <= 1.0f)) {
    fail("sampling parameter top_p = {} is out of range: it must be in (0, 1]", top_p);
  }
  if (!(min_p >= 0.0f && min_p <= 1.0f)) {
    fail("sampling parameter min_p = {} is out of range: it must be in [0, 1]", min_p);
  }
  if (!(std::isfinite(repetition_penalty) && repetition_penalty > 0.0f)) {
    fail(
        "sampling parameter repetition_penalty = {} is out of range: it must be finite and > 0 "
        "(1 disables it)",
        repetition_penalty);
  }
  if (!(presence_penalty >= -2.0f && presence_penalty <= 2.0f)) {
    fail("sampling parameter presence_penalty = {} is out of range: it must be in [-2, 2]",
         presence_penalty);
  }
  if (!(frequency_penalty >= -2.0f && frequency_penalty <= 2.0f)) {
    fail("sampling parameter frequency_penalty = {} is out of range: it must be in [-2, 2]",
         frequency_penalty);
  }
  if (max_tokens < 1) {
    fail("sampling parameter max_tokens = {} is out of range: it must be >= 1", max_tokens);
  }
  for (size_t i = 0; i < stop.size(); ++i) {
    if (stop[i].empty()) fail("sampling parameter stop[{}] is an empty string", i);
  }
  for (size_t i = 0; i < stop_token_ids.size(); ++i) {
    const int32_t id = stop_token_ids[i];
    if (id < 0 || (vocab_size > 0 && id >= vocab_size)) {
      fail("sampling parameter stop_token_ids[{}] = {} is out of range: it must be in [0, {})", i,
           id, vocab_size > 0 ? vocab_size : INT32_MAX);
    }
  }
}

}  // namespace specula
