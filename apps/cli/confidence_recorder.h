// SPDX-License-Identifier: Apache-2.0
// ConfidenceRecorder: a Drafter that forwards every call to a DSparkDrafter
// and records, per verify round and row, the drafter's confidences and how
// many drafts the target accepted (lab::DraftRound), for `specula calibrate`.
// The engine runs it as it runs the drafter itself; it only reads what the
// drafter already exposes (last_confidences(), round_sequences()) and what
// on_committed says. Run the drafter unpruned for calibration samples: a
// pruned round verifies fewer drafts than it made, and the record would
// count the cut ones as drafted (so this throws when the drafter prunes).
#pragma once

#include <span>
#include <vector>

#include "engine/draft/drafter.h"
#include "engine/draft/dspark/dspark_drafter.h"
#include "engine/lab/calibration.h"

namespace specula::cli {

class ConfidenceRecorder : public Drafter {
 public:
  // `inner` must outlive this object and have no thresholds set.
  explicit ConfidenceRecorder(dspark::DSparkDrafter& inner);

  int64_t vocab_size() const override { return inner_.vocab_size(); }
  // Step 0 starts a round (its rows are the inner drafter's round_sequences()).
  Tensor step(int step_index, std::span<const DraftRow> rows) override;
  Tensor step_on_device(int step_index, std::span<const DraftRow> rows,
                        const DraftDeviceInputs& inputs) override;
  bool proposes_tokens() const override { return inner_.proposes_tokens(); }
  int propose(const DraftRow& row, std::span<int32_t> out) override;
  std::span<const int> taps() const override { return inner_.taps(); }
  // A verify commit of a row drafted this round records its round (count − 1
  // drafts accepted) before forwarding; other commits (prefill pieces, rows
  // that did not draft) only forward.
  void on_committed(std::span<const CommittedRow> rows, const Tensor& taps) override;
  void release(int sequence) override { inner_.release(sequence); }
  int max_draft_tokens() const override { return inner_.max_draft_tokens(); }
  bool takes_device_inputs() const override { return inner_.takes_device_inputs(); }
  bool prunes() const override { return inner_.prunes(); }
  void draft_lengths(std::span<const DraftRow> rows, std::span<const int> drafted,
                     std::span<int> keep) override;

  // The rounds recorded since the last take_rounds(), in commit order.
  const std::vector<lab::DraftRound>& rounds() const { return rounds_; }
  // The rounds recorded since the last take_rounds(), in commit order; clears them.
  std::vector<lab::DraftRound> take_rounds();

 private:
  void start_round(int step_index);

  dspark::DSparkDrafter& inner_;
  bool round_open_ = false;  // a round drafted and its verify commit is still to come
  std::vector<lab::DraftRound> rounds_;
};

}  // namespace specula::cli
