// SPDX-License-Identifier: Apache-2.0
// The engine under load: requests that arrive and leave at random steps, some
// cancelled, with chunked prefill under several token budgets, get exactly the
// tokens they get alone (greedy, seeded sampling, penalties; no drafter, the
// assistant, the ngram drafter). The KV pool admits no more rows than it
// holds and gets every row back. Requests are refused as values.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <map>
#include <random>

#include "engine/draft/assistant/assistant_drafter.h"
#include "engine/draft/ngram/ngram_drafter.h"
#include "engine/draft/replay/replay_drafter.h"
#include "engine/speculative/decoder.h"
#include "engine/speculative/engine.h"
#include "tests/unit/model/golden_util.h"
#include "tests/unit/speculative/engine_test_util.h"

namespace specula {
namespace {

using speculative::DecodeRequest;
using speculative::DecodeResult;
using speculative::Engine;
using speculative::EngineOptions;

std::string models_dir() {
  return std::string(SPECULA_SOURCE_DIR) + "/models";
}

// The embedded family: a trained target (its output varies with the prompt)
// and its assistant, shared by every test here.
class EngineTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    if (!std::filesystem::exists(models_dir() + "/gemma4-tiny-py-assistant")) return;
    target_ = gemma4::Gemma4Model::load(models_dir() + "/gemma4-tiny-py").release();
    drafter_ = assistant::AssistantModel::load(models_dir() + "/gemma4-tiny-py-assistant",
                                                 target_->config(), target_->backend())
                   .release();
    assistant_ = new assistant::AssistantDrafter(*target_, *drafter_);
    ngram_ = new ngram::NgramDrafter(target_->config().vocab_size, {});
  }
  static void TearDownTestSuite() {
    delete ngram_;
    delete assistant_;
    delete drafter_;
    delete target_;
  }
  void SetUp() override {
    if (target_ == nullptr) GTEST_SKIP() << "embedded family not present";
  }
  static Drafter* drafter_named(const std::string& name) {
    if (name == "assistant") return assistant_;
    if (name == "ngram") return ngram_;
    return nullptr;
  }
  static inline gemma4::Gemma4Model* target_ = nullptr;
  static inline assistant::AssistantModel* drafter_ = nullptr;
  static inline assistant::AssistantDrafter* assistant_ = nullptr;
  static inline ngram::NgramDrafter* ngram_ = nullptr;
};

struct LoadCase {
  const char* drafter;  // "none", "assistant", "ngram"
  int64_t budget;       // max_batch_tokens
  bool adaptive;
};

class EngineUnderLoad : public EngineTest, public ::testing::WithParamInterface<LoadCase> {};

// Requests arrive at random steps into an engine of 4 rows (so some wait),
// two are cancelled at random steps after they arrive; each request's tokens
// equal what it gets alone (a cancelled one: a prefix of them).
TEST_P(EngineUnderLoad, EveryRequestGetsItsTokensAlone) {
  const LoadCase c = GetParam();
  Drafter* drafter = drafter_named(c.drafter);
  const speculative::DraftSchedule schedule{
      .draft_tokens = 3, .adaptive = c.adaptive, .max_draft_tokens = 6};
  const int vocab = static_cast<int>(target_->config().vocab_size);
  const int n = 10;
  const auto reqs = testing::mixed_requests(n, vocab, 7);
  std::vector<DecodeResult> alone;
  for (const DecodeRequest& r : reqs) {
    alone.push_back(speculative::decode(*target_, drafter, std::span(&r, 1), schedule).front());
  }

  Engine engine(*target_, drafter,
                {.schedule = schedule, .max_rows = 4, .max_batch_tokens = c.budget});
  testing::expect_alone_tokens_under_load(engine, reqs, alone, 4);
}

INSTANTIATE_TEST_SUITE_P(
    Schedules, EngineUnderLoad,
    ::testing::Values(LoadCase{"none", 16, false}, LoadCase{"none", 64, false},
                      LoadCase{"none", 4096, false}, LoadCase{"assistant", 16, false},
                      LoadCase{"assistant", 64, true}, LoadCase{"assistant", 4096, false},
                      LoadCase{"ngram", 16, false}, LoadCase{"ngram", 64, false},
                      LoadCase{"ngram", 4096, true}),
    [](const auto& info) {
      return std::string(info.param.drafter) + "_budget" + std::to_string(info.param.budget) +
             (info.param.adaptive ? "_adaptive" : "");
    });

// Host rounds and host sampling (the A/B modes) give the same tokens under
// load as the default device rounds.
TEST_F(EngineTest, RoundModesGiveTheSameTokensUnderLoad) {
  const int vocab = static_cast<int>(target_->config().vocab_size);
  const auto reqs = testing::mixed_requests(8, vocab, 23);
  std::vector<std::vector<DecodeResult>> runs;
  for (const speculative::RoundModes modes :
       {speculative::RoundModes{}, speculative::RoundModes{.host_rounds = true},
        speculative::RoundModes{.host_sampling = true}}) {
    Engine engine(
        *target_, assistant_,
        {.schedule = {.draft_tokens = 4}, .max_rows = 3, .max_batch_tokens = 24, .modes = modes});
    runs.push_back(speculative::decode(engine, reqs));
  }
  for (size_t m = 1; m < runs.size(); ++m) {
    for (size_t i = 0; i < reqs.size(); ++i) {
      EXPECT_EQ(runs[m][i].tokens, runs[0][i].tokens) << "mode " << m << " request " << i;
    }
  }
}

// The pool: sized from a byte budget, it admits no more rows than it holds;
// the rest wait, and a cancel gives the row back at once.
TEST_F(EngineTest, PoolAdmitsWhatFitsAndCancelFreesAtOnce) {
  Engine probe(*target_, nullptr, {.max_rows = 1});
  const int64_t row_bytes = probe.kv_pool().bytes_per_row;
  ASSERT_GT(row_bytes, 0);
  Engine engine(*target_, nullptr,
                {.max_rows = 8, .kv_memory = 2.5 * static_cast<double>(row_bytes)});
  EXPECT_EQ(engine.kv_pool().max_rows, 2);
  EXPECT_EQ(engine.kv_pool().capacity_bytes, 2 * row_bytes);
  const int vocab = static_cast<int>(target_->config().vocab_size);
  std::vector<int64_t> ids;
  for (DecodeRequest r : testing::mixed_requests(5, vocab, 3)) {
    r.params.max_tokens = 20;
    ids.push_back(engine.submit(r).id);
  }
  EXPECT_EQ(engine.kv_pool().waiting, 5);
  engine.step();
  speculative::KvPoolInfo pool = engine.kv_pool();
  EXPECT_EQ(pool.rows_in_use, 2);
  EXPECT_EQ(pool.waiting, 3);
  EXPECT_EQ(pool.bytes_in_use(), 2 * row_bytes);
  EXPECT_GT(pool.tokens_in_use, 0);
  ASSERT_TRUE(engine.cancel(ids[0]));
  EXPECT_EQ(engine.kv_pool().rows_in_use, 1) << "a cancelled row's cache goes back at once";
  ASSERT_TRUE(engine.cancel(ids[3]));  // still waiting
  EXPECT_EQ(engine.kv_pool().waiting, 2);
  EXPECT_FALSE(engine.cancel(12345));
  bool saw_cancelled = false;
  while (engine.has_work()) {
    for (const auto& u : engine.step())
      saw_cancelled |= u.finished && u.finish_reason == "cancelled";
    EXPECT_LE(engine.kv_pool().rows_in_use, 2);
  }
  EXPECT_TRUE(saw_cancelled);
  EXPECT_EQ(engine.kv_pool().rows_in_use, 0);
  EXPECT_EQ(engine.kv_pool().tokens_in_use, 0);
}

TEST_F(EngineTest, BadRequestsAreRefusedAsValues) {
  Engine engine(*target_, assistant_, {.schedule = {.draft_tokens = 3}, .max_waiting = 1});
  const int vocab = static_cast<int>(target_->config().vocab_size);
  auto refused = [&](DecodeRequest r, const std::string& part) {
    const speculative::Submission s = engine.submit(std::move(r));
    EXPECT_FALSE(s.accepted());
    EXPECT_NE(s.error.find(part), std::string::npos) << s.error;
  };
  refused(DecodeRequest{}, "the prompt is empty");
  refused(DecodeRequest{.prompt = {1, vocab}}, "outside the vocabulary");
  DecodeRequest too_long{.prompt = {1, 2, 3}};
  too_long.params.max_tokens = static_cast<int32_t>(target_->max_context());
  refused(too_long, "exceeds the context size");
  refused(DecodeRequest{.prompt = {1, 2}, .params = {}, .draft_tokens = 9}, "draft_tokens 9");
  DecodeRequest bad_params{.prompt = {1, 2}};
  bad_params.params.top_p = 2.0f;
  refused(bad_params, "top_p");
  EXPECT_TRUE(engine.submit(DecodeRequest{.prompt = {1, 2}}).accepted());
  refused(DecodeRequest{.prompt = {1, 2}}, "the queue is full");
  EXPECT_THROW(Engine(*target_, nullptr, {.max_rows = 0}), Error);
  EXPECT_THROW(Engine(*target_, nullptr, {.max_batch_tokens = -1}), Error);
}

// Prompt lookup pays on repetition: a prompt that repeats a loop, whose
// continuation the target repeats too. Exact either way.
TEST_F(EngineTest, NgramDraftsAreExactAndPayOnRepetition) {
  // "for i in range(10):\n    print(i)\n" three times (the last cut short).
  const std::vector<int32_t> prompt = {2,    577, 4483, 1197, 487, 428, 3252, 342,  461,  577, 4483,
                                       1197, 487, 428,  3252, 342, 461, 577,  4483, 1197, 278, 295};
  DecodeRequest r{.prompt = prompt};
  r.params.temperature = 0.0f;
  r.params.max_tokens = 64;
  const auto plain = speculative::decode(*target_, nullptr, std::span(&r, 1), {}).front();
  const auto drafted =
      speculative::decode(*target_, ngram_, std::span(&r, 1), {.draft_tokens = 4}).front();
  EXPECT_EQ(drafted.tokens, plain.tokens);
  EXPECT_GT(drafted.stats.mean_accepted_length(), 1.5);
  // Sampled, the drafts are point masses: still exact in distribution, and
  // for a fixed seed independent of the batch (covered under load above).
  std::printf("[ ngram ] tau %.2f, acceptance %.3f\n", drafted.stats.mean_accepted_length(),
              drafted.stats.acceptance_rate());
}

// The replay simulation: drafts accepted at each position with the profile's
// probability (within 4 standard errors), and the output still exact.
TEST_F(EngineTest, ReplayAcceptanceFollowsItsProfile) {
  const std::vector<double> profile = replay::parse_acceptance_profile("0.84,0.6,0.39,0.27");
  replay::ReplayDrafter replay(*assistant_, target_->backend(), profile, 5);
  const int vocab = static_cast<int>(target_->config().vocab_size);
  std::vector<DecodeRequest> reqs;
  for (int i = 0; i < 12; ++i) {
    DecodeRequest r;
    for (int j = 0; j < 20; ++j) r.prompt.push_back(3 + (i * 131 + j * 37) % (vocab - 3));
    r.params.temperature = 0.0f;
    r.params.max_tokens = 100;
    reqs.push_back(std::move(r));
  }
  const auto plain = speculative::decode(*target_, nullptr, reqs, {});
  for (size_t i = 0; i < reqs.size(); ++i) {
    std::vector<int32_t> seq = reqs[i].prompt;
    seq.insert(seq.end(), plain[i].tokens.begin(), plain[i].tokens.end());
    replay.add_reference(std::move(seq));
  }
  Engine engine(*target_, &replay, {.schedule = {.draft_tokens = 4}, .max_rows = 6});
  const auto got = speculative::decode(engine, reqs);
  speculative::DecodeStats total;
  for (size_t i = 0; i < reqs.size(); ++i) {
    EXPECT_EQ(got[i].tokens, plain[i].tokens) << "request " << i;
    total.merge(got[i].stats);
  }
  ASSERT_EQ(total.drafted_at.size(), profile.size());
  for (size_t j = 0; j < profile.size(); ++j) {
    const double n = static_cast<double>(total.drafted_at[j]);
    ASSERT_GT(n, 100) << "position " << j;
    const double measured = static_cast<double>(total.accepted_at[j]) / n;
    const double se = std::sqrt(profile[j] * (1 - profile[j]) / n);
    EXPECT_NEAR(measured, profile[j], 4 * se) << "position " << j << " of " << n << " drafts";
  }
  EXPECT_THROW(replay::parse_acceptance_profile("0.8,1.2"), Error);
  EXPECT_THROW(replay::parse_acceptance_profile("0.8,,0.2"), Error);
  EXPECT_THROW(replay::parse_acceptance_profile(""), Error);
}

// A drafter that proposes by prompt lookup and records what the engine tells
// it: per sequence, the tapped hiddens of every committed position, and the
// tokens it saw (to tell the sequences apart).
class TapRecorder final : public Drafter {
 public:
  TapRecorder(Backend& be, int64_t vocab, std::vector<int> taps, int64_t hidden)
      : be_(be), vocab_(vocab), taps_(std::move(taps)), H_(hidden) {}
  struct Sequence {
    std::vector<int32_t> history;              // the longest seen
    std::map<int64_t, std::vector<float>> at;  // position -> [taps, H]
    int commits = 0;
  };
  int64_t vocab_size() const override { return vocab_; }
  Tensor step(int, std::span<const DraftRow>) override { fail("TapRecorder proposes tokens"); }
  bool proposes_tokens() const override { return true; }
  int propose(const DraftRow& row, std::span<int32_t> out) override {
    Sequence& s = live_[row.sequence];
    if (row.history.size() > s.history.size())
      s.history.assign(row.history.begin(), row.history.end());
    return ngram::propose_ngram(row.history, {}, out);
  }
  std::span<const int> taps() const override { return taps_; }
  void on_committed(std::span<const CommittedRow> rows, const Tensor& t) override {
    const int64_t n = static_cast<int64_t>(taps_.size());
    EXPECT_EQ(t.dim(0), n);
    std::vector<float> all(static_cast<size_t>(t.numel()));
    be_.download(t, all.data());
    const int64_t M = t.dim(1);
    for (const CommittedRow& c : rows) {
      Sequence& s = live_[c.sequence];
      ++s.commits;
      for (int j = 0; j < c.count; ++j) {
        std::vector<float> v(static_cast<size_t>(n * H_));
        for (int64_t k = 0; k < n; ++k) {
          const float* src = all.data() + (k * M + c.tap_row + j) * H_;
          std::copy(src, src + H_, v.begin() + k * H_);
        }
        EXPECT_TRUE(s.at.emplace(c.position + j, std::move(v)).second)
            << "position " << c.position + j << " committed twice";
      }
    }
  }
  void release(int sequence) override {
    ASSERT_TRUE(live_.count(sequence)) << "release of an unknown sequence " << sequence;
    ended.push_back(std::move(live_[sequence]));
    live_.erase(sequence);
  }
  std::vector<Sequence> ended;

 private:
  Backend& be_;
  int64_t vocab_;
  std::vector<int> taps_;
  int64_t H_;
  std::map<int, Sequence> live_;
};

// A drafter that asks for taps gets, for every position a sequence commits
// (prefill pieces and accepted windows), exactly the hidden states a single
// forward over the final sequence computes there; and a release per sequence.
TEST_F(EngineTest, DraftersGetTheTapsOfEveryCommittedPosition) {
  const int L = target_->config().num_hidden_layers;
  const int64_t H = target_->config().hidden_size;
  TapRecorder recorder(target_->backend(), target_->config().vocab_size, {1, L}, H);
  const int vocab = static_cast<int>(target_->config().vocab_size);
  std::vector<DecodeRequest> reqs = testing::mixed_requests(6, vocab, 31);
  for (DecodeRequest& r : reqs) {
    r.draft_tokens = -1;
    r.params.max_tokens = std::max(r.params.max_tokens, 3);
    r.params.stop_token_ids.clear();
  }
  Engine engine(*target_, &recorder,
                {.schedule = {.draft_tokens = 3},
                 .max_rows = 3,
                 .max_batch_tokens = 24,
                 .prefill_chunk = 16});
  const auto results = speculative::decode(engine, reqs);
  ASSERT_EQ(recorder.ended.size(), reqs.size());
  for (size_t i = 0; i < reqs.size(); ++i) {
    std::vector<int32_t> seq = reqs[i].prompt;
    seq.insert(seq.end(), results[i].tokens.begin(), results[i].tokens.end());
    seq.pop_back();  // the last token is emitted, never forwarded
    const auto it = std::find_if(recorder.ended.begin(), recorder.ended.end(), [&](const auto& s) {
      return s.history.size() >= reqs[i].prompt.size() &&
             std::equal(reqs[i].prompt.begin(), reqs[i].prompt.end(), s.history.begin());
    });
    ASSERT_NE(it, recorder.ended.end()) << "request " << i;
    ASSERT_EQ(it->at.size(), seq.size()) << "request " << i << ": committed positions";
    EXPECT_EQ(it->at.begin()->first, 0);
    EXPECT_EQ(it->at.rbegin()->first, static_cast<int64_t>(seq.size()) - 1);
    SequenceKv kv = target_->new_sequence();
    const gemma4::ForwardRow row{.kv = &kv, .tokens = seq, .all_logits = false};
    const gemma4::ForwardOutput& out =
        target_->forward(std::span(&row, 1), {.capture_layer_hidden = true});
    for (const auto& [pos, v] : it->at) {
      for (int k = 0; k < 2; ++k) {
        const float* want =
            out.layer_hidden[static_cast<size_t>(k == 0 ? 1 : L)].view().data_as<const float>() +
            pos * H;
        ASSERT_EQ(std::memcmp(v.data() + k * H, want, static_cast<size_t>(H) * sizeof(float)), 0)
            << "request " << i << " position " << pos << " tap " << k;
      }
    }
  }
}

TEST(NgramProposal, LatestLongestMatch) {
  const ngram::NgramOptions o{.min_n = 1, .max_n = 3};
  std::vector<int32_t> out(4);
  // ... 1 2 3 9 8 ... 1 2 3 7 6 ... 1 2 3: the latest match of "1 2 3" is
  // followed by 7 6 ...
  const std::vector<int32_t> h = {1, 2, 3, 9, 8, 5, 1, 2, 3, 7, 6, 4, 1, 2, 3};
  ASSERT_EQ(ngram::propose_ngram(h, o, out), 4);
  EXPECT_EQ(out, (std::vector<int32_t>{7, 6, 4, 1}));
  // No earlier occurrence of the last token: nothing.
  EXPECT_EQ(ngram::propose_ngram(std::vector<int32_t>{1, 2, 3, 4}, o, out), 0);
  // The continuation may run up to the end of the history.
  ASSERT_EQ(ngram::propose_ngram(std::vector<int32_t>{5, 6, 5}, o, out), 2);
  EXPECT_EQ(out[0], 6);
  EXPECT_EQ(out[1], 5);
  EXPECT_THROW(ngram::NgramDrafter(10, {.min_n = 0}), Error);
  EXPECT_THROW(ngram::NgramDrafter(10, {.min_n = 3, .max_n = 2}), Error);
}

}  // namespace
}  // namespace specula
