// SPDX-License-Identifier: Apache-2.0
#include "apps/cli/confidence_recorder.h"

#include <algorithm>
#include <cmath>

#include "engine/core/error.h"

namespace specula::cli {

ConfidenceRecorder::ConfidenceRecorder(dspark::DSparkDrafter& inner) : inner_(inner) {
  if (inner_.prunes()) {
    fail(
        "calibration needs the DSpark drafter unpruned (its thresholds are set): a pruned round "
        "verifies fewer drafts than it made");
  }
}

void ConfidenceRecorder::start_round(int step_index) {
  // The previous round's verify commit always comes before the next step 0
  // (Engine::run_round), so an open round here would be a lost record.
  if (step_index == 0) {
    SPECULA_CHECK(!round_open_, "a DSpark round started before the last one was committed");
    round_open_ = true;
  }
}

Tensor ConfidenceRecorder::step(int step_index, std::span<const DraftRow> rows) {
  start_round(step_index);
  return inner_.step(step_index, rows);
}

Tensor ConfidenceRecorder::step_on_device(int step_index, std::span<const DraftRow> rows,
                                          const DraftDeviceInputs& inputs) {
  start_round(step_index);
  return inner_.step_on_device(step_index, rows, inputs);
}

int ConfidenceRecorder::propose(const DraftRow& row, std::span<int32_t> out) {
  return inner_.propose(row, out);
}

void ConfidenceRecorder::draft_lengths(std::span<const DraftRow> rows, std::span<const int> drafted,
                                       std::span<int> keep) {
  inner_.draft_lengths(rows, drafted, keep);
}

void ConfidenceRecorder::on_committed(std::span<const CommittedRow> rows, const Tensor& taps) {
  if (round_open_) {
    // The verify forward of the open round: read its confidences before the
    // inner drafter sees the commit (nothing has overwritten them since).
    round_open_ = false;
    const std::span<const int> seqs = inner_.round_sequences();
    const std::span<const float> conf = inner_.last_confidences();
    const size_t gamma = static_cast<size_t>(inner_.max_draft_tokens());
    SPECULA_CHECK(conf.size() == seqs.size() * gamma,
                  "the DSpark drafter returned {} confidences for {} rows of block {}", conf.size(),
                  seqs.size(), gamma);
    for (const CommittedRow& c : rows) {
      const auto it = std::find(seqs.begin(), seqs.end(), c.sequence);
      if (it == seqs.end()) continue;  // a row that did not draft this round
      const size_t b = static_cast<size_t>(it - seqs.begin());
      lab::DraftRound round;
      // Steps a row did not run read NaN; a row runs steps 0 .. n−1.
      for (size_t k = 0; k < gamma && std::isfinite(conf[b * gamma + k]); ++k)
        round.confidences.push_back(conf[b * gamma + k]);
      round.accepted = c.count - 1;
      SPECULA_CHECK(
          round.accepted >= 0 && round.accepted <= static_cast<int>(round.confidences.size()),
          "sequence {} committed {} tokens after drafting {}", c.sequence, c.count,
          round.confidences.size());
      rounds_.push_back(std::move(round));
    }
  }
  inner_.on_committed(rows, taps);
}

std::vector<lab::DraftRound> ConfidenceRecorder::take_rounds() {
  std::vector<lab::DraftRound> out;
  out.swap(rounds_);
  return out;
}

}  // namespace specula::cli
