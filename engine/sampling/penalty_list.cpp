// SPDX-License-Identifier: Apache-2.0
#include "engine/sampling/penalty_list.h"

#include "engine/core/error.h"

namespace specula {

void PenaltyList::reserve(size_t max_history) {
  size_t cap = 16;
  shift_ = 60;
  while (cap < 2 * max_history) cap *= 2, --shift_;
  keys_.assign(cap, -1);
  entries_.assign(cap, 0);
  tokens_.clear();
  counts_.clear();
  tokens_.reserve(max_history);
  counts_.reserve(max_history);
  absorbed_ = 0;
}

void PenaltyList::update(std::span<const int32_t> history, size_t num_prompt) {
  SPECULA_CHECK(history.size() >= absorbed_, "a penalty list saw {} tokens, the history has {}",
                absorbed_, history.size());
  SPECULA_CHECK(!keys_.empty(), "a penalty list was used before reserve()");
  for (; absorbed_ < history.size(); ++absorbed_) {
    const int32_t t = history[absorbed_];
    const size_t mask = keys_.size() - 1;
    // Fibonacci hashing: the product's top bits pick the slot.
    size_t at = static_cast<size_t>((static_cast<uint64_t>(t) * 0x9E3779B97F4A7C15ull) >> shift_);
    while (keys_[at] != t && keys_[at] != -1) at = (at + 1) & mask;
    if (keys_[at] == -1) {
      SPECULA_CHECK(tokens_.size() < tokens_.capacity(), "penalty list outgrew its {} entries",
                    tokens_.capacity());
      keys_[at] = t;
      entries_[at] = static_cast<int32_t>(tokens_.size());
      tokens_.push_back(t);
      counts_.push_back(0);
    }
    if (absorbed_ >= num_prompt) ++counts_[static_cast<size_t>(entries_[at])];
  }
}

}  // namespace specula
