// SPDX-License-Identifier: Apache-2.0
// Drafter: what the speculative decoder asks of any draft model. A round of
// speculation calls step(0, rows) .. step(k-1, rows); each call proposes one
// more token per row and returns the proposal scores the verifier needs
// (greedy takes their argmax; sampling processes them into q exactly as the
// target's logits are processed into p).
#pragma once

#include <cstdint>
#include <span>
#include <vector>

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

// A step's inputs that are already on the drafter's device, so that a greedy
// round need not read its drafts back between steps.
struct DraftDeviceInputs {
  Tensor tokens;  // i32 [rows]: the token each row extends (replaces DraftRow::token)
  // Step 0: f32 [rows, H_target], the target hiddens (replace DraftRow::target_hidden);
  // empty at later steps.
  Tensor hidden;
};

class Drafter {
 public:
  virtual ~Drafter() = default;
  virtual int64_t vocab_size() const = 0;
  // One draft step for `rows` (a subset of the rows of step 0, in the same order).
  // Returns proposal logits f32 [rows.size(), V], valid until the next call.
  virtual Tensor step(int step_index, std::span<const DraftRow> rows) = 0;
  // Whether step_on_device() is implemented.
  virtual bool takes_device_inputs() const { return false; }
  // As step(step_index, rows), reading each row's token (and, at step 0, its
  // target hidden) from `inputs` rather than from `rows`, whose other fields
  // still hold. Queues device work without waiting for it where it can.
  virtual Tensor step_on_device(int step_index, std::span<const DraftRow> rows,
                                const DraftDeviceInputs& inputs);

  // step_on_device() in two halves, so that a round's steps can be recorded
  // as one (with the verify window). stage_step() is the host half (checks,
  // plans, uploads; no device work), run_staged_step() queues the device half
  // directly (recorded by the caller, never by the drafter) and returns the
  // logits (valid until the next step runs). Steps 0..k-1 of a round may all
  // be staged before the first runs; each runs once, in order, after its
  // staging and before the next round's step 0 is staged. append_step_key()
  // appends what a staged step's device half depends on besides device memory
  // (shapes, buffers, caches, positions bounds). Whether implemented:
  // stages_steps().
  virtual bool stages_steps() const { return false; }
  virtual void stage_step(int step_index, std::span<const DraftRow> rows,
                          const DraftDeviceInputs& inputs);
  virtual void append_step_key(int step_index, std::vector<int64_t>& key) const;
  virtual Tensor run_staged_step(int step_index);
};

}  // namespace specula
