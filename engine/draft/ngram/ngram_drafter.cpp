// SPDX-License-Identifier: Apache-2.0
#include "engine/draft/ngram/ngram_drafter.h"

#include <algorithm>

#include "engine/core/error.h"

namespace specula::ngram {

int propose_ngram(std::span<const int32_t> history, const NgramOptions& options,
                  std::span<int32_t> out) {
  const auto full = static_cast<int64_t>(history.size());
  const int64_t from = std::max<int64_t>(0, full - options.max_search);
  const std::span<const int32_t> h = history.subspan(static_cast<size_t>(from));
  const auto L = static_cast<int64_t>(h.size());
  if (out.empty() || L < 2) return 0;
  for (int n = std::min<int64_t>(options.max_n, L - 1); n >= options.min_n; --n) {
    const int32_t* suffix = h.data() + (L - n);
    // Latest earlier occurrence: a start s < L - n whose n tokens equal the
    // suffix and which leaves at least one token after it.
    for (int64_t s = L - n - 1; s >= 0; --s) {
      if (!std::equal(suffix, suffix + n, h.data() + s)) continue;
      const int64_t follow = s + n;  // < L
      const int64_t count = std::min<int64_t>(static_cast<int64_t>(out.size()), L - follow);
      std::copy_n(h.data() + follow, count, out.begin());
      return static_cast<int>(count);
    }
  }
  return 0;
}

NgramDrafter::NgramDrafter(int64_t vocab_size, const NgramOptions& options)
    : vocab_size_(vocab_size), options_(options) {
  if (options.min_n < 1)
    fail("ngram: min_n (--prompt-lookup-min) must be >= 1, got {}", options.min_n);
  if (options.max_n < options.min_n) {
    fail("ngram: max_n (--prompt-lookup-max) {} is below min_n {}", options.max_n, options.min_n);
  }
  if (options.max_search < 2) fail("ngram: max_search must be >= 2, got {}", options.max_search);
}

Tensor NgramDrafter::step(int step_index, std::span<const DraftRow> /*rows*/) {
  fail("draft step {}: the ngram drafter proposes token ids, not scores (use propose())",
       step_index);
}

int NgramDrafter::propose(const DraftRow& row, std::span<int32_t> out) {
  return propose_ngram(row.history, options_, out);
}

}  // namespace specula::ngram
