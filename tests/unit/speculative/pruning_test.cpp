// SPDX-License-Identifier: Apache-2.0
// Confidence pruning in the engine (Drafter::prunes / draft_lengths), with a
// test drafter that wraps the embedded assistant and cuts each row's drafts
// by a hash of its history: greedy output is that of no drafter at every k,
// batch and round mode; the verified windows are prefixes of what was
// drafted, and the stats count what was verified and what was cut; sampled
// and penalised rows get the same tokens alone, under load and in every round
// mode; a drafter's out-of-range answer is an Error naming it. (That sampled
// rows still follow the target's distribution: chain_sampling_test.cpp.)
#include <gtest/gtest.h>

#include <filesystem>
#include <string>
#include <vector>

#include "engine/draft/assistant/assistant_drafter.h"
#include "engine/speculative/decoder.h"
#include "engine/speculative/engine.h"
#include "tests/unit/speculative/engine_test_util.h"
#include "tests/unit/speculative/pruning_drafter.h"

namespace specula {
namespace {

using speculative::DecodeRequest;
using speculative::DecodeResult;
using speculative::Engine;
using speculative::RoundModes;
using testing::PruningDrafter;
using Rule = testing::PruningDrafter::Rule;

std::string models_dir() {
  return std::string(SPECULA_SOURCE_DIR) + "/models";
}

class PruningTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    if (!std::filesystem::exists(models_dir() + "/gemma4-tiny-py-assistant")) return;
    target_ = gemma4::Gemma4Model::load(models_dir() + "/gemma4-tiny-py").release();
    model_ = assistant::AssistantModel::load(models_dir() + "/gemma4-tiny-py-assistant",
                                             target_->config(), target_->backend())
                 .release();
    assistant_ = new assistant::AssistantDrafter(*target_, *model_);
  }
  static void TearDownTestSuite() {
    delete assistant_;
    delete model_;
    delete target_;
  }
  void SetUp() override {
    if (target_ == nullptr) GTEST_SKIP() << "embedded family not present";
  }
  // Greedy requests without penalties (so that each draft is its step's
  // argmax), some prompts repeating themselves so that drafts are accepted.
  static std::vector<DecodeRequest> greedy_requests(int n) {
    const int vocab = static_cast<int>(target_->config().vocab_size);
    std::vector<DecodeRequest> reqs = testing::mixed_requests(n, vocab, 41);
    for (DecodeRequest& r : reqs) {
      r.params = {};
      r.params.temperature = 0.0f;
      r.params.max_tokens = 14;
      r.draft_tokens = -1;
    }
    return reqs;
  }
  static inline gemma4::Gemma4Model* target_ = nullptr;
  static inline assistant::AssistantModel* model_ = nullptr;
  static inline assistant::AssistantDrafter* assistant_ = nullptr;
};

// Walks `res`'s rounds: each verified window is what the drafter kept of the
// round it drafted for that history (round_drafted = keep), and every
// accepted draft is the drafted token at its position.
void expect_windows_are_kept_prefixes(const DecodeRequest& req, const DecodeResult& res,
                                      const PruningDrafter& p, const std::string& what) {
  std::vector<int32_t> history = req.prompt;
  ASSERT_FALSE(res.tokens.empty()) << what;
  history.push_back(res.tokens[0]);  // the prefill's token
  size_t pos = 1;
  ASSERT_EQ(res.stats.round_drafted.size(), res.stats.round_accepted.size()) << what;
  for (size_t i = 0; i < res.stats.round_drafted.size(); ++i) {
    const int d = res.stats.round_drafted[i], a = res.stats.round_accepted[i];
    ASSERT_LE(a, d) << what << " round " << i;
    if (d > 0) {
      const auto it = p.rounds.find(history);
      ASSERT_NE(it, p.rounds.end()) << what << " round " << i << ": verified drafts never pruned";
      const PruningDrafter::Round& r = it->second;
      EXPECT_EQ(d, r.keep) << what << " round " << i << ": the window is not what was kept";
      ASSERT_LE(d, r.drafted) << what << " round " << i;
      for (int j = 0; j < a; ++j) {
        ASSERT_LT(pos + static_cast<size_t>(j), res.tokens.size()) << what;
        EXPECT_EQ(res.tokens[pos + static_cast<size_t>(j)], r.drafts[static_cast<size_t>(j)])
            << what << " round " << i << " draft " << j;
      }
    }
    for (int j = 0; j <= a && pos < res.tokens.size(); ++j) history.push_back(res.tokens[pos++]);
  }
  EXPECT_EQ(pos, res.tokens.size()) << what;
}

// (a) and (b): greedy output with pruning equals that without pruning and
// without a drafter, at k = 1..8, batches of 1, 3 and 8, device and host
// rounds; the windows are kept prefixes of the drafts, and drafted + pruned
// is every draft made.
TEST_F(PruningTest, GreedyOutputIsUnchangedAndWindowsArePrefixesOfTheDrafts) {
  const std::vector<DecodeRequest> reqs = greedy_requests(8);
  const std::vector<DecodeResult> plain = speculative::decode(*target_, nullptr, reqs, {});
  int64_t all_pruned = 0, all_accepted = 0;
  for (const RoundModes modes : {RoundModes{}, RoundModes{.host_rounds = true}}) {
    for (int k = 1; k <= 8; ++k) {
      // Batches: request 0 alone, requests 0..2, all 8; and unpruned, all 8.
      for (const int batch : {1, 3, 8, 0}) {
        const size_t n = batch == 0 ? reqs.size() : static_cast<size_t>(batch);
        PruningDrafter p(*assistant_, target_->backend(),
                         batch == 0 ? Rule::kNone : Rule::kHistory);
        const std::span<const DecodeRequest> some(reqs.data(), n);
        const auto got = speculative::decode(*target_, &p, some, {.draft_tokens = k}, {}, modes);
        const std::string what = std::string(modes.host_rounds ? "host" : "device") +
                                 " rounds, k " + std::to_string(k) + ", batch " +
                                 std::to_string(batch);
        speculative::DecodeStats total;
        for (size_t i = 0; i < n; ++i) {
          ASSERT_EQ(got[i].tokens, plain[i].tokens) << what << ", request " << i;
          total.merge(got[i].stats);
          if (batch != 0) {
            expect_windows_are_kept_prefixes(reqs[i], got[i], p,
                                             what + ", request " + std::to_string(i));
          }
        }
        if (batch == 0) {
          EXPECT_EQ(p.calls, 0) << what << ": draft_lengths without prunes()";
          EXPECT_EQ(total.pruned, 0) << what;
          continue;
        }
        EXPECT_EQ(total.drafted + total.pruned, p.total_drafted) << what;
        EXPECT_EQ(total.drafted, p.total_kept) << what;
        int64_t at = 0;
        for (int64_t x : total.drafted_at) at += x;
        EXPECT_EQ(at, total.drafted) << what << ": drafted_at counts verified drafts";
        if (k == 1) EXPECT_EQ(total.pruned, 0) << what << ": one draft is never cut";
        all_pruned += total.pruned;
        all_accepted += total.accepted;
      }
    }
  }
  EXPECT_GT(all_pruned, 0);
  EXPECT_GT(all_accepted, 0);
}

// Sampled and penalised rows: with a pruning drafter each request gets the
// tokens it gets alone under load, and the same in every round mode (the
// device rounds' split plan draws each row's uniforms as the host does).
TEST_F(PruningTest, SampledRowsGetTheSameTokensAloneUnderLoadAndInEveryRoundMode) {
  const int vocab = static_cast<int>(target_->config().vocab_size);
  const auto reqs = testing::mixed_requests(10, vocab, 7);
  std::vector<std::vector<DecodeResult>> runs;
  int64_t pruned = 0;
  for (const RoundModes modes :
       {RoundModes{}, RoundModes{.host_rounds = true}, RoundModes{.host_sampling = true}}) {
    PruningDrafter p(*assistant_, target_->backend(), Rule::kHistory);
    p.check_greedy = false;
    Engine engine(
        *target_, &p,
        {.schedule = {.draft_tokens = 4}, .max_rows = 3, .max_batch_tokens = 24, .modes = modes});
    runs.push_back(speculative::decode(engine, reqs));
    for (const DecodeResult& r : runs.back()) pruned += r.stats.pruned;
  }
  EXPECT_GT(pruned, 0);
  for (size_t m = 1; m < runs.size(); ++m) {
    for (size_t i = 0; i < reqs.size(); ++i) {
      EXPECT_EQ(runs[m][i].tokens, runs[0][i].tokens) << "mode " << m << " request " << i;
    }
  }
  // Alone vs under load with arrivals and cancellations.
  PruningDrafter p(*assistant_, target_->backend(), Rule::kHistory);
  p.check_greedy = false;
  const speculative::DraftSchedule schedule{.draft_tokens = 4};
  std::vector<DecodeResult> alone;
  for (const DecodeRequest& r : reqs) {
    alone.push_back(speculative::decode(*target_, &p, std::span(&r, 1), schedule).front());
  }
  Engine engine(*target_, &p, {.schedule = schedule, .max_rows = 4, .max_batch_tokens = 32});
  testing::expect_alone_tokens_under_load(engine, reqs, alone, 4);
}

// (c) A length outside [min(1, drafted), drafted] is an Error naming the
// drafter's value and the bound, on either kind of round.
TEST_F(PruningTest, OutOfRangeLengthsAreErrors) {
  std::vector<DecodeRequest> reqs = greedy_requests(2);
  for (const RoundModes modes : {RoundModes{}, RoundModes{.host_rounds = true}}) {
    for (const Rule rule : {Rule::kTooMany, Rule::kZero}) {
      PruningDrafter p(*assistant_, target_->backend(), rule);
      try {
        speculative::decode(*target_, &p, reqs, {.draft_tokens = 4}, {}, modes);
        ADD_FAILURE() << "no error for an out-of-range length";
      } catch (const Error& e) {
        const std::string msg = e.what();
        const std::string value = rule == Rule::kTooMany ? "kept 5 drafts" : "kept 0 drafts";
        EXPECT_NE(msg.find("draft_lengths"), std::string::npos) << msg;
        EXPECT_NE(msg.find(value), std::string::npos) << msg;
        EXPECT_NE(msg.find("outside [1, 4]"), std::string::npos) << msg;
      }
    }
  }
}

}  // namespace
}  // namespace specula
