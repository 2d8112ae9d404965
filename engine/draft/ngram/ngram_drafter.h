// SPDX-License-Identifier: Apache-2.0
// NgramDrafter: a model-free drafter (prompt lookup decoding). For a row whose
// history ends with the n tokens t[L-n..L), it finds the latest earlier place
// where those n tokens occur, for the largest n in [min_n, max_n] that has one,
// and proposes the tokens that followed there (up to k). It pays where the
// output repeats its context: code edits, retrieval, summaries, repetition.
// vLLM's ngram proposer and llama.cpp's lookup decoding do the same.
#pragma once

#include <cstdint>

#include "engine/draft/drafter.h"

namespace specula::ngram {

struct NgramOptions {
  int min_n = 1;  // shortest suffix matched (vLLM's prompt_lookup_min)
  int max_n = 4;  // longest suffix matched (vLLM's prompt_lookup_max)
  // Histories longer than this are searched in their last `max_search` tokens
  // only, which bounds a round's host time.
  int64_t max_search = 1 << 16;
};

class NgramDrafter final : public Drafter {
 public:
  // Throws an Error naming the field for min_n < 1, max_n < min_n or
  // max_search < 2.
  NgramDrafter(int64_t vocab_size, const NgramOptions& options);
  int64_t vocab_size() const override { return vocab_size_; }
  // Not a scoring drafter: throws (the engine calls propose()).
  Tensor step(int step_index, std::span<const DraftRow> rows) override;
  bool proposes_tokens() const override { return true; }
  int propose(const DraftRow& row, std::span<int32_t> out) override;

 private:
  int64_t vocab_size_;
  NgramOptions options_;
};

// The proposal itself, on a plain token sequence (for tests and the drafter).
int propose_ngram(std::span<const int32_t> history, const NgramOptions& options,
                  std::span<int32_t> out);

}  // namespace specula::ngram
