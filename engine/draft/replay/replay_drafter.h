// SPDX-License-Identifier: Apache-2.0
// ReplayDrafter: an acceptance-controlled drafter, for benchmarks only (a
// SIMULATION of a drafter of a given quality; every report that uses it must
// say so).
//
// It wraps a real drafter (whose steps it runs, so that their cost is paid)
// and replaces what that drafter proposes: at draft step s it proposes the
// target's own greedy continuation (from a plain run of the same requests,
// given with add_reference) at that position, corrupted with the probability
// the acceptance profile implies. The profile a_0, a_1, ... is the fraction of
// drafts accepted at each position (vLLM's per-position acceptance), so
// position s is kept, given that the positions before it were, with
// probability a_s / a_{s-1} (a_{-1} = 1). Greedy rows then accept position s
// with probability a_s. The corruption draws are a hash of (seed, sequence,
// position, step): reproducible, and independent of the batch.
#pragma once

#include <cstdint>
#include <unordered_map>
#include <vector>

#include "engine/core/buffer.h"
#include "engine/draft/drafter.h"
#include "engine/ops/backend.h"

namespace specula::replay {

// Parses "0.84,0.60,0.39,0.27": each value in (0, 1]; an Error names the text.
std::vector<double> parse_acceptance_profile(const std::string& text);

class ReplayDrafter final : public Drafter {
 public:
  // `inner` must outlive this drafter and run on `backend`. Throws an Error
  // for an empty profile or a value outside (0, 1].
  ReplayDrafter(Drafter& inner, Backend& backend, std::vector<double> profile, uint64_t seed);
  // The sequence a greedy plain run produced for one request: its prompt
  // followed by its generated tokens. Requests are told apart by their first
  // (up to) 16 tokens (benchmark prompts are longer).
  void add_reference(std::vector<int32_t> sequence);
  // Forgets every reference.
  void clear_references() { references_.clear(); }

  int64_t vocab_size() const override { return inner_.vocab_size(); }
  Tensor step(int step_index, std::span<const DraftRow> rows) override;
  bool takes_device_inputs() const override { return inner_.takes_device_inputs(); }
  Tensor step_on_device(int step_index, std::span<const DraftRow> rows,
                        const DraftDeviceInputs& inputs) override;
  const std::vector<double>& profile() const { return profile_; }
  // Confidences for the verify scheduler: the profile's conditional keep
  // rates a_s / a_{s-1}, the same for every row (a perfectly calibrated
  // drafter that knows nothing of the row), exact for greedy rows whose
  // reference is known.
  bool has_confidences() const override { return true; }
  void draft_confidences(std::span<const DraftRow> rows, std::span<const int> drafted, int stride,
                         std::span<double> conf) override;
  // a_s / a_{s-1} (past the profile: its last ratio), at most 1.
  double keep_probability(int step_index) const;

 private:
  // The token step `step_index` proposes for `row`.
  int32_t proposal(int step_index, const DraftRow& row) const;
  // Logits f32 [rows, V] whose argmax (and, processed, whose only mass) is
  // each row's proposal, on the backend; valid until the next step.
  Tensor proposals(int step_index, std::span<const DraftRow> rows);

  Drafter& inner_;
  Backend& backend_;
  std::vector<double> profile_;
  uint64_t seed_;
  std::unordered_map<uint64_t, std::vector<int32_t>> references_;  // by key of the first tokens
  DeviceBuffer logits_, scatter_;  // [rows, V] logits; [rows] values then [rows] ids
  int64_t capacity_rows_ = 0;
  std::vector<float> host_values_;
  std::vector<int32_t> host_ids_;
};

}  // namespace specula::replay
