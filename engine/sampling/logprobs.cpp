// SPDX-License-Identifier: Apache-2.0
#include "engine/sampling/logprobs.h"

#include <cmath>
#include <limits>

#include "engine/core/error.h"

namespace specula {

RowLogSoftmax row_log_softmax(std::span<const float> logits) {
  float mx = -std::numeric_limits<float>::infinity();
  for (float v : logits) mx = std::fmax(mx, v);  // fmax skips NaN
  SPECULA_CHECK(std::isfinite(mx), "log_softmax of a row whose max is {}", mx);
  double sum = 0.0;  // double: a whole vocabulary loses nothing to the order of the sum
  for (float v : logits) sum += std::exp(v - mx);
  return RowLogSoftmax{.max = mx, .log_sum = static_cast<float>(std::log(sum))};
}

void top_logit_ids(std::span<const float> logits, std::span<int32_t> ids) {
  const size_t n = ids.size();
  SPECULA_CHECK(n <= logits.size(), "top {} of a row of {}", n, logits.size());
  if (n == 0) return;
  // Whether entry a comes before entry b (a strict weak order).
  auto before = [&](int32_t a, int32_t b) {
    const float va = logits[static_cast<size_t>(a)], vb = logits[static_cast<size_t>(b)];
    const bool na = std::isnan(va), nb = std::isnan(vb);
    if (na != nb) return na;
    if (!na && va != vb) return va > vb;
    return a < b;
  };
  // ids[0, filled) stays sorted; a later entry enters when it comes before the last.
  size_t filled = 0;
  for (size_t j = 0; j < logits.size(); ++j) {
    const auto id = static_cast<int32_t>(j);
    if (filled == n && !before(id, ids[n - 1])) continue;
    size_t at = filled < n ? filled++ : n - 1;
    for (; at > 0 && before(id, ids[at - 1]); --at) ids[at] = ids[at - 1];
    ids[at] = id;
  }
}

}  // namespace specula
