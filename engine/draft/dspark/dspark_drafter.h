// SPDX-License-Identifier: Apache-2.0
// DSparkDrafter: the Drafter interface over a DSparkModel (docs/dspark.md,
// "Inference in the engine"). It keeps one context-KV cache per sequence,
// grown by on_committed() with the target's taps of every committed position,
// so that at a round whose anchor sits at position t the cache holds exactly
// positions 0 .. t − 1. Step 0 runs the block backbone for all rows and keeps
// the base logits on the device; steps k ≥ 1 add the Markov head's bias for
// the token each row extends (read on the device in device rounds: nothing is
// read back between steps). Every step's confidence logits land in a device
// buffer, read back only by last_confidences().
#pragma once

#include <map>
#include <span>
#include <vector>

#include "engine/draft/drafter.h"
#include "engine/draft/dspark/dspark_model.h"
#include "engine/model/gemma4/gemma4.h"

namespace specula::dspark {

class DSparkDrafter : public Drafter {
 public:
  // Both must outlive this object; model runs on target's backend.
  DSparkDrafter(gemma4::Gemma4Model& target, DSparkModel& model);

  int64_t vocab_size() const override { return model_.vocab_size(); }
  std::span<const int> taps() const override { return model_.config().taps; }
  // Appends each row's committed positions to its sequence's context cache
  // (one batched projection); a sequence seen for the first time gets a fresh
  // cache. Throws, changing no cache, when a row's position is not its cache's length.
  void on_committed(std::span<const CommittedRow> rows, const Tensor& taps) override;
  void release(int sequence) override;
  // Step 0: the block for every row (each row's context length must equal its
  // position); steps 1 .. γ−1: rows a subset of step 0's, in the same order.
  // Returns f32 [rows, V] on the device, valid until the next call.
  Tensor step(int step_index, std::span<const DraftRow> rows) override;
  bool takes_device_inputs() const override { return true; }
  Tensor step_on_device(int step_index, std::span<const DraftRow> rows,
                        const DraftDeviceInputs& inputs) override;
  // γ: a round drafts at most one block.
  int max_draft_tokens() const override { return model_.block_size(); }

  // The positions held in `sequence`'s context cache, or -1 when it has none.
  int64_t context_length(int sequence) const;
  // Positions held by all context caches together (the engine's
  // KvPoolInfo::tokens_in_use counts the target's the same way).
  int64_t context_positions() const;
  // Sequences with a context cache.
  int live_sequences() const { return static_cast<int>(contexts_.size()); }
  // The rows (DraftRow::sequence) of the last round's step 0, in order.
  std::span<const int> round_sequences() const { return round_sequences_; }
  // Steps run in the last round (0 before any).
  int round_steps() const { return round_steps_; }
  // The last round's confidences σ(c_k), f32 [B0 · γ] row-major (row b: step 0's
  // row b, column k: draft position k), NaN where a row did not run step k.
  // One readback per round (the pruning hook's only cost; later calls in the
  // same round reuse it); empty when the drafter has no confidence head or no
  // round ran. Valid until the next draft step.
  std::span<const float> last_confidences();

  // Confidence pruning (docs/dspark.md): per-position thresholds, γ values in
  // [0, 1] (position 0's is ignored), or empty for none. Throws on a wrong
  // count, a value outside [0, 1], or a drafter without a confidence head.
  void set_thresholds(std::vector<float> thresholds);
  const std::vector<float>& thresholds() const { return thresholds_; }
  bool prunes() const override;
  // Keeps drafts 0 .. k−1 of each row, k ≥ 1 the first position whose
  // confidence is below its threshold (else all it drafted). One readback.
  void draft_lengths(std::span<const DraftRow> rows, std::span<const int> drafted,
                     std::span<int> keep) override;
  // STS temperatures for draft_confidences (γ values, finite and > 0), or
  // empty for none. Throws on a wrong count or value, or a drafter without a
  // confidence head.
  void set_sts_temperatures(std::vector<float> temperatures);
  const std::vector<float>& sts_temperatures() const { return sts_; }
  // With a confidence head: the round's confidences σ(c_k) for the verify
  // scheduler (the same readback as draft_lengths: one per round), scaled by
  // the STS temperatures when set: σ(logit(c_k) / T_k) (lab::temperature_scale).
  bool has_confidences() const override { return model_.has_confidence_head(); }
  void draft_confidences(std::span<const DraftRow> rows, std::span<const int> drafted, int stride,
                         std::span<double> conf) override;

 private:
  Tensor draft_step(int step_index, std::span<const DraftRow> rows, const Tensor* device_tokens);

  gemma4::Gemma4Model& target_;
  DSparkModel& model_;
  Backend& backend_;
  std::map<int, SequenceKv> contexts_;
  std::vector<ContextPiece> pieces_;  // reused by on_committed
  // The round: step 0's rows, each step's rows as slots of step 0's.
  std::vector<int> round_sequences_;
  std::vector<SequenceKv*> round_ctx_;
  std::vector<std::vector<int32_t>> step_slots_;  // [γ][B_k]
  std::vector<int32_t> u_rows_;
  int round_steps_ = 0;
  // Device buffers [γ, cap_]: host-path tokens (i32) and confidence logits (f32).
  DeviceBuffer tokens_, confidences_;
  int64_t cap_ = 0;
  std::vector<int32_t> host_tokens_;
  std::vector<float> thresholds_;           // empty: no pruning
  std::vector<float> sts_;                  // empty: raw confidences for the scheduler
  std::vector<float> conf_raw_, conf_out_;  // last_confidences() staging, reused
  bool conf_read_ = false;                  // conf_out_ holds this round's confidences
};

}  // namespace specula::dspark
