// SPDX-License-Identifier: Apache-2.0
// Drafter: what the speculative decoder asks of any draft model. A round of
// speculation calls step(0, rows) .. step(k-1, rows); each call proposes one
// more token per row and returns the proposal scores the verifier needs
// (greedy takes their argmax; sampling processes them into q exactly as the
// target's logits are processed into p).
#pragma once

#include <cstdint>
#include <span>

#include "engine/core/tensor.h"
#include "engine/kv/kv_cache.h"

namespace specula {

struct DraftRow {
  int request = 0;       // stable id of the sequence (index into the decoder's requests)
  int32_t token = 0;     // the token to extend: the pending token at step 0, then the last draft
  int32_t position = 0;  // position of the pending token (constant within a round)
  SequenceKv* target_kv = nullptr;  // the target's cache of this sequence (positions < position)
  // Step 0 only: the target's post-final-norm hidden that produced the pending token, f32
  // [H_target].
  const float* target_hidden = nullptr;
};

class Drafter {
 public:
  virtual ~Drafter() = default;
  virtual int64_t vocab_size() const = 0;
  // One draft step for `rows` (a subset of the rows of step 0, in the same order).
  // Returns proposal logits f32 [rows.size(), V], valid until the next call.
  virtual Tensor step(int step_index, std::span<const DraftRow> rows) = 0;
};

}  // namespace specula
