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
  int sequence =
      0;  // id of the sequence while it runs (the engine's row slot; reused after release)
  int32_t token = 0;     // the token to extend: the pending token at step 0, then the last draft
  int32_t position = 0;  // position of the pending token (constant within a round)
  SequenceKv* target_kv = nullptr;  // the target's cache of this sequence (positions < position)
  // Step 0 only: the target's post-final-norm hidden that produced the pending token, f32
  // [H_target].
  const float* target_hidden = nullptr;
  // The sequence so far: prompt, generated tokens, and last the pending token.
  std::span<const int32_t> history;
};

// A step's inputs that are already on the drafter's device, so that a greedy
// round need not read its drafts back between steps.
struct DraftDeviceInputs {
  Tensor tokens;  // i32 [rows]: the token each row extends (replaces DraftRow::token)
  // Step 0: f32 [rows, H_target], the target hiddens (replace DraftRow::target_hidden);
  // empty at later steps.
  Tensor hidden;
};

// What one target forward committed to a sequence's cache: `count` tokens
// from `position` on (a verify window's pending token and accepted drafts, or
// a prefill piece), whose tapped hiddens are rows [tap_row, tap_row + count)
// of each tap of the forward.
struct CommittedRow {
  int sequence = 0;  // DraftRow::sequence of the sequence
  int64_t position = 0;
  int count = 0;
  int64_t tap_row = 0;
};

class Drafter {
 public:
  virtual ~Drafter() = default;
  virtual int64_t vocab_size() const = 0;
  // One draft step for `rows` (a subset of the rows of step 0, in the same order).
  // Returns proposal logits f32 [rows.size(), V], valid until the next call.
  virtual Tensor step(int step_index, std::span<const DraftRow> rows) = 0;
  // Whether this drafter proposes token ids (propose()) rather than scores
  // (step()): model-free drafters. The verifier treats a proposed token as a
  // draft drawn from a point mass (q = 1 at the token), which keeps
  // speculative sampling exact.
  virtual bool proposes_tokens() const { return false; }
  // Up to out.size() draft tokens for `row` (row.history ends with its pending
  // token), written to out; returns how many (0: nothing to propose). Depends
  // only on the row's own history, so a request's drafts never depend on the
  // other rows.
  virtual int propose(const DraftRow& row, std::span<int32_t> out);
  // The target hidden states this drafter reads (indices of transformers'
  // hidden_states: 0 = embeddings, l = after layer l, L = after the final
  // norm). The engine taps them in every target forward of the drafter's
  // rows and passes them to on_committed(). Default: none.
  virtual std::span<const int> taps() const { return {}; }
  // After every target forward: what each of its rows committed, and the
  // forward's taps, f32 [taps().size(), M, H] on the target's device (M = the
  // forward's tokens; empty without taps), valid until the next forward. A
  // drafter that keeps its own context grows or trims it here. Default:
  // nothing.
  virtual void on_committed(std::span<const CommittedRow> rows, const Tensor& taps) {}
  // The sequence `sequence` ended (finished or cancelled); its id may be
  // reused. Default: nothing.
  virtual void release(int sequence) {}
  // The most draft tokens one round may ask of this drafter (a block drafter:
  // its block size); 0 = no limit. The engine refuses a schedule past it.
  virtual int max_draft_tokens() const { return 0; }
  // Whether step_on_device() is implemented.
  virtual bool takes_device_inputs() const { return false; }
  // As step(step_index, rows), reading each row's token (and, at step 0, its
  // target hidden) from `inputs` rather than from `rows`, whose other fields
  // still hold. Queues device work without waiting for it where it can.
  virtual Tensor step_on_device(int step_index, std::span<const DraftRow> rows,
                                const DraftDeviceInputs& inputs);
  // Whether draft_lengths() may cut drafts (confidence pruning). Default: no.
  virtual bool prunes() const { return false; }
  // Called when prunes(), once per round that drafted, after its last draft
  // step (never for token proposers): `rows` are the round's step-0 rows, in
  // order, as step 0 got them; drafted[i] is how many drafts row i made. The
  // drafter writes keep[i] in [min(1, drafted[i]), drafted[i]]: the engine
  // verifies drafts 0 .. keep[i]-1 of row i and drops the rest (they are
  // never redrawn, so the verified window is a prefix of the drafted one);
  // a value outside the range is an Error. It may read back from its device
  // once (e.g. its confidences). keep[i] must depend only on row i's own data
  // and drafts, so that a request's output never depends on its neighbours;
  // and, for sampled rows to stay exact, whether draft j is kept may depend on
  // the drafts before j but not on draft j or later ones (a stopping rule:
  // keeping d_j because of its value would bias the accept test that judges
  // it against q). Greedy rows are exact whatever is kept. Default: keeps
  // all.
  virtual void draft_lengths(std::span<const DraftRow> rows, std::span<const int> drafted,
                             std::span<int> keep);
  // Whether draft_confidences() is implemented (DSpark's confidence head):
  // what the engine's verify scheduler (EngineOptions::scheduler) needs.
  // Drafters without it are never scheduled. Default: no.
  virtual bool has_confidences() const { return false; }
  // Called when has_confidences() and the engine schedules the round, after
  // its last draft step (and after draft_lengths when prunes()): `rows` and
  // `drafted` as for draft_lengths (drafted[i] may be the pruned count). The
  // drafter writes conf[i * stride + j] for j < drafted[i]: c_{i,j} in [0, 1],
  // its estimate that draft j of row i survives verification given that
  // drafts 0 .. j-1 do; it may depend on drafts before j but not on draft j
  // or later ones (DSpark: c_j reads draft j-1), which with the scheduler's
  // early break keeps sampled rows exact. conf holds rows.size() * stride
  // values, stride >= every drafted[i]. It may read back from its device once
  // per round (shared with draft_lengths). Default: an Error.
  virtual void draft_confidences(std::span<const DraftRow> rows, std::span<const int> drafted,
                                 int stride, std::span<double> conf);
};

}  // namespace specula
