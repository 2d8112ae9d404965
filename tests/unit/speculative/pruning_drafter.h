// SPDX-License-Identifier: Apache-2.0
// PruningDrafter: a test drafter that wraps another (whose steps it runs and
// returns unchanged) and prunes its drafts by a deterministic per-row rule
// (Drafter::draft_lengths), recording what each round drafted and kept so
// that tests can compare it with what the engine verified.
#pragma once

#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>
#include <map>
#include <span>
#include <vector>

#include "engine/draft/drafter.h"
#include "engine/ops/backend.h"

namespace specula::testing {

class PruningDrafter final : public Drafter {
 public:
  enum class Rule {
    kNone,      // prunes() is false: the inner drafter as it is (recording still)
    kHistory,   // keep = 1 + hash(history) % drafted
    kStopping,  // keep draft j >= 1 unless hash(history, d_0..d_{j-1}) % 3 == 0: a stopping rule
    kTooMany,   // keep = drafted + 1 (invalid)
    kZero,      // keep = 0 (invalid: a row that drafted keeps at least one)
  };
  // What one round drafted for a row (greedy drafts: the argmax of each step's logits).
  struct Round {
    std::vector<int32_t> drafts;
    int drafted = 0;
    int keep = 0;
  };

  // `inner` must outlive this drafter and run on `backend`.
  PruningDrafter(Drafter& inner, Backend& backend, Rule rule)
      : inner_(inner), be_(backend), rule_(rule) {}

  int64_t vocab_size() const override { return inner_.vocab_size(); }
  bool prunes() const override { return rule_ != Rule::kNone; }
  std::span<const int> taps() const override { return inner_.taps(); }
  void on_committed(std::span<const CommittedRow> rows, const Tensor& taps) override {
    inner_.on_committed(rows, taps);
  }
  void release(int sequence) override {
    inner_.release(sequence);
    live_.erase(sequence);
  }
  bool takes_device_inputs() const override { return inner_.takes_device_inputs(); }

  Tensor step(int step_index, std::span<const DraftRow> rows) override {
    std::vector<int32_t> tokens;
    for (const DraftRow& r : rows) tokens.push_back(r.token);
    const Tensor logits = inner_.step(step_index, rows);
    record(step_index, rows, tokens, logits);
    return logits;
  }
  Tensor step_on_device(int step_index, std::span<const DraftRow> rows,
                        const DraftDeviceInputs& inputs) override {
    std::vector<int32_t> tokens(rows.size());
    be_.download(inputs.tokens, tokens.data());
    const Tensor logits = inner_.step_on_device(step_index, rows, inputs);
    record(step_index, rows, tokens, logits);
    return logits;
  }

  void draft_lengths(std::span<const DraftRow> rows, std::span<const int> drafted,
                     std::span<int> keep) override {
    ++calls;
    EXPECT_EQ(rows.size(), drafted.size());
    EXPECT_EQ(rows.size(), keep.size());
    for (size_t i = 0; i < rows.size(); ++i) {
      const int n = drafted[i];
      const Live& live = live_.at(rows[i].sequence);
      EXPECT_TRUE(std::equal(rows[i].history.begin(), rows[i].history.end(), live.history.begin(),
                             live.history.end()))
          << "draft_lengths row " << i << " is not the row step 0 drafted for";
      EXPECT_EQ(static_cast<int>(live.drafts.size()), n) << "row " << i;
      int k = n;
      switch (rule_) {
        case Rule::kNone:
          break;
        case Rule::kHistory:
          k = 1 + static_cast<int>(hash(live.history, {}) % static_cast<uint64_t>(n));
          break;
        case Rule::kStopping:
          // Whether draft j is kept depends on the drafts before it (the
          // tokens steps 1..j extended), never on draft j itself.
          for (k = 1; k < n; ++k) {
            if (hash(live.history, std::span(live.seen).first(static_cast<size_t>(k))) % 3 == 0)
              break;
          }
          break;
        case Rule::kTooMany:
          k = n + 1;
          break;
        case Rule::kZero:
          k = 0;
          break;
      }
      keep[i] = k;
      total_drafted += n;
      total_kept += std::min(k, n);
      rounds[live.history] = Round{.drafts = live.drafts, .drafted = n, .keep = k};
    }
  }

  // Every pruned round, by its row's history at step 0 (prompt, tokens, pending).
  std::map<std::vector<int32_t>, Round> rounds;
  int64_t total_drafted = 0, total_kept = 0, calls = 0;
  // Greedy rows only: each step's token must be the argmax of the step before.
  bool check_greedy = true;

 private:
  struct Live {
    std::vector<int32_t> history;  // at step 0
    std::vector<int32_t> drafts;   // argmax of each step's logits
    std::vector<int32_t> seen;     // the token step s >= 1 extended (draft s-1)
  };
  static uint64_t hash(std::span<const int32_t> a, std::span<const int32_t> b) {
    uint64_t h = 1469598103934665603ull;
    auto mix = [&](int32_t t) {
      h ^= static_cast<uint32_t>(t);
      h *= 1099511628211ull;
    };
    for (int32_t t : a) mix(t);
    mix(-1);
    for (int32_t t : b) mix(t);
    return h ^ (h >> 29);
  }
  void record(int step_index, std::span<const DraftRow> rows, std::span<const int32_t> tokens,
              const Tensor& logits) {
    const int64_t V = logits.dim(1);
    std::vector<float> host(static_cast<size_t>(logits.numel()));
    be_.download(logits, host.data());
    for (size_t b = 0; b < rows.size(); ++b) {
      Live& live = live_[rows[b].sequence];
      if (step_index == 0) {
        live.history.assign(rows[b].history.begin(), rows[b].history.end());
        live.drafts.clear();
        live.seen.clear();
      } else {
        if (check_greedy) {
          EXPECT_EQ(tokens[b], live.drafts.back()) << "step " << step_index << " row " << b;
        }
        live.seen.push_back(tokens[b]);
      }
      const float* row = host.data() + static_cast<int64_t>(b) * V;
      live.drafts.push_back(static_cast<int32_t>(std::max_element(row, row + V) - row));
    }
  }

  Drafter& inner_;
  Backend& be_;
  Rule rule_;
  std::map<int, Live> live_;
};

}  // namespace specula::testing
