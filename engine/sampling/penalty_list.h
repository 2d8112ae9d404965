// SPDX-License-Identifier: Apache-2.0
// PenaltyList: a row's history summarised for the penalty ops, kept up to
// date as the history grows. It holds the history's distinct tokens in
// first-occurrence order, each with its count past the prompt, so that a
// speculative round adds only the tokens emitted since the last one instead
// of walking the whole history. The token -> entry map is an open-addressing
// table sized once for the row's longest history (reserve), so steady-state
// rounds allocate nothing. Host-only; owned by the row it describes.
#pragma once

#include <cstddef>
#include <cstdint>
#include <span>
#include <vector>

namespace specula {

class PenaltyList {
 public:
  // Room for histories of up to `max_history` tokens; forgets what it held.
  void reserve(size_t max_history);
  // Takes in history[absorbed ..]; the history only grows (drafts never enter
  // it) and its first num_prompt tokens are the prompt.
  void update(std::span<const int32_t> history, size_t num_prompt);
  std::span<const int32_t> tokens() const { return tokens_; }
  std::span<const int32_t> counts() const { return counts_; }

 private:
  std::vector<int32_t> keys_;     // token ids, -1 = empty slot
  std::vector<int32_t> entries_;  // each key's index in tokens_ / counts_
  std::vector<int32_t> tokens_, counts_;
  int shift_ = 60;       // 64 - log2(table size)
  size_t absorbed_ = 0;  // history tokens taken in
};

}  // namespace specula
