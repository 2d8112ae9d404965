// SPDX-License-Identifier: Apache-2.0
// Logprobs (DecodeRequest::logprobs): the op against a double-precision
// reference, and the engine's values against the target's own forward over
// the whole sequence, with and without a drafter (assistant, ngram), k = 1 and
// 4, device and host rounds, in batches where only some requests ask. Asking
// changes no row's tokens, and speculation changes no logprob (the CPU
// kernels are batch invariant: bit for bit).
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <limits>
#include <random>
#include <vector>

#include "engine/backend/backends.h"
#include "engine/core/buffer.h"
#include "engine/draft/assistant/assistant_drafter.h"
#include "engine/draft/ngram/ngram_drafter.h"
#include "engine/sampling/logprobs.h"
#include "engine/speculative/decoder.h"
#include "engine/speculative/engine.h"
#include "tests/unit/speculative/engine_test_util.h"

namespace specula {
namespace {

using speculative::DecodeRequest;
using speculative::DecodeResult;
using speculative::Engine;

// log_softmax(x)[t] in double, the naive way.
double reference_logprob(std::span<const float> x, int32_t t) {
  double mx = -std::numeric_limits<double>::infinity();
  for (float v : x) mx = std::max(mx, static_cast<double>(v));
  double sum = 0;
  for (float v : x) sum += std::exp(static_cast<double>(v) - mx);
  return static_cast<double>(x[static_cast<size_t>(t)]) - mx - std::log(sum);
}

// The ids of the n largest, larger first and lower id first on ties (a full sort).
std::vector<int32_t> reference_top(std::span<const float> x, int n) {
  std::vector<int32_t> ids(x.size());
  for (size_t i = 0; i < ids.size(); ++i) ids[i] = static_cast<int32_t>(i);
  std::stable_sort(ids.begin(), ids.end(), [&](int32_t a, int32_t b) {
    return x[static_cast<size_t>(a)] > x[static_cast<size_t>(b)];
  });
  ids.resize(static_cast<size_t>(n));
  return ids;
}

TEST(LogprobRows, CpuMatchesADoublePrecisionReference) {
  Backend& be = backend_for(Device::cpu());
  const int64_t R = 5, V = 3000, M = 4, C = 2, n = 20;
  HostTensor logits(DType::kF32, {R, V});
  be.fill_uniform(logits.view(), 7, -30.0f, 30.0f);
  float* x = logits.data<float>();
  // Row 1: ties at the top, so the order falls back to the lower id.
  x[1 * V + 10] = 40.0f;
  x[1 * V + 5] = 40.0f;
  x[1 * V + 2999] = 40.0f;
  HostTensor rows(DType::kI32, {M});
  HostTensor ids(DType::kI32, {M, C});
  const int32_t row_of[M] = {1, 4, 1, 0};
  const int32_t id_of[M * C] = {10, 0, 7, 2999, 5, 5, 1234, 42};
  std::copy(row_of, row_of + M, rows.data<int32_t>());
  std::copy(id_of, id_of + M * C, ids.data<int32_t>());
  HostTensor logprobs(DType::kF32, {M, C});
  HostTensor top_ids(DType::kI32, {M, n});
  HostTensor top_values(DType::kF32, {M, n});
  be.logprob_rows({.logits = logits.view(),
                   .rows = rows.view(),
                   .ids = ids.view(),
                   .logprobs = logprobs.view(),
                   .top_ids = top_ids.view(),
                   .top_values = top_values.view()});
  for (int64_t m = 0; m < M; ++m) {
    const std::span<const float> row(x + row_of[m] * V, static_cast<size_t>(V));
    for (int64_t c = 0; c < C; ++c) {
      EXPECT_NEAR(logprobs.data<float>()[m * C + c], reference_logprob(row, id_of[m * C + c]), 1e-5)
          << m << ", " << c;
    }
    const std::vector<int32_t> want = reference_top(row, n);
    for (int64_t j = 0; j < n; ++j) {
      const int32_t id = top_ids.data<int32_t>()[m * n + j];
      EXPECT_EQ(id, want[static_cast<size_t>(j)]) << m << ", " << j;
      EXPECT_NEAR(top_values.data<float>()[m * n + j], reference_logprob(row, id), 1e-5);
      if (j > 0) {
        EXPECT_LE(top_values.data<float>()[m * n + j], top_values.data<float>()[m * n + j - 1]);
      }
    }
  }
  // Output row 0 reads logits row 1.
  EXPECT_EQ(top_ids.data<int32_t>()[0], 5);
  EXPECT_EQ(top_ids.data<int32_t>()[1], 10);
  EXPECT_EQ(top_ids.data<int32_t>()[2], 2999);

  // Without top ids, and without candidates.
  HostTensor lp1(DType::kF32, {M, C});
  be.logprob_rows(
      {.logits = logits.view(), .rows = rows.view(), .ids = ids.view(), .logprobs = lp1.view()});
  for (int64_t i = 0; i < M * C; ++i) EXPECT_EQ(lp1.data<float>()[i], logprobs.data<float>()[i]);
  HostTensor ti(DType::kI32, {M, 3});
  HostTensor tv(DType::kF32, {M, 3});
  be.logprob_rows({.logits = logits.view(),
                   .rows = rows.view(),
                   .top_ids = ti.view(),
                   .top_values = tv.view()});
  for (int64_t m = 0; m < M; ++m) {
    for (int64_t j = 0; j < 3; ++j) {
      EXPECT_EQ(ti.data<int32_t>()[m * 3 + j], top_ids.data<int32_t>()[m * n + j]);
      EXPECT_EQ(tv.data<float>()[m * 3 + j], top_values.data<float>()[m * n + j]);
    }
  }

  // Bad calls throw, naming what is wrong.
  rows.data<int32_t>()[2] = static_cast<int32_t>(R);
  EXPECT_THROW(be.logprob_rows({.logits = logits.view(),
                                .rows = rows.view(),
                                .ids = ids.view(),
                                .logprobs = logprobs.view()}),
               Error);
  rows.data<int32_t>()[2] = 0;
  ids.data<int32_t>()[1] = static_cast<int32_t>(V);
  EXPECT_THROW(be.logprob_rows({.logits = logits.view(),
                                .rows = rows.view(),
                                .ids = ids.view(),
                                .logprobs = logprobs.view()}),
               Error);
  HostTensor too_many(DType::kI32, {M, 21});
  HostTensor too_many_v(DType::kF32, {M, 21});
  EXPECT_THROW(be.logprob_rows({.logits = logits.view(),
                                .rows = rows.view(),
                                .top_ids = too_many.view(),
                                .top_values = too_many_v.view()}),
               Error);
}

TEST(LogprobRows, HostHelpersAgreeWithTheReference) {
  std::mt19937 rng(3);
  std::vector<float> x(1000);
  for (float& v : x) v = std::uniform_real_distribution<float>(-5, 5)(rng);
  x[17] = x[400] = 9.0f;  // a tie at the top
  const RowLogSoftmax ls = row_log_softmax(x);
  for (int32_t t : {0, 17, 400, 999})
    EXPECT_NEAR(ls.at(x[static_cast<size_t>(t)]), reference_logprob(x, t), 1e-5);
  std::vector<int32_t> top(20);
  top_logit_ids(x, top);
  EXPECT_EQ(top, reference_top(x, 20));
  EXPECT_EQ(top[0], 17);
  EXPECT_EQ(top[1], 400);
}

std::string models_dir() {
  return std::string(SPECULA_SOURCE_DIR) + "/models";
}

// The embedded family, shared by the engine tests here.
class EngineLogprobs : public ::testing::Test {
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

  // Requests of mixed settings (greedy, sampled, penalties) where the
  // logprobs setting cycles through -1, 0, 3, 20.
  // greedy_only: every request greedy without penalties (the rounds that
  // take argmaxes on the backend).
  static std::vector<DecodeRequest> requests(int n, uint32_t seed, bool greedy_only = false) {
    const int vocab = static_cast<int>(target_->config().vocab_size);
    auto reqs = testing::mixed_requests(n, vocab, seed);
    const int settings[4] = {3, -1, 0, 20};
    for (size_t i = 0; i < reqs.size(); ++i) {
      if (greedy_only) {
        SamplingParams p;
        p.temperature = 0.0f;
        p.max_tokens = reqs[i].params.max_tokens;
        reqs[i].params = p;
      }
      reqs[i].logprobs = settings[i % 4];
      reqs[i].draft_tokens = i % 5 == 4 ? 0 : -1;
      reqs[i].params.max_tokens = std::max(reqs[i].params.max_tokens, 6);
    }
    return reqs;
  }

  // Scores prompt + tokens with the target's plain forward (all logits) and
  // checks every logprob and top list of `got` against log_softmax there.
  static void expect_reference(const DecodeRequest& req, const DecodeResult& got,
                               const std::string& what) {
    const size_t L = got.tokens.size();
    if (req.logprobs < 0) {
      EXPECT_TRUE(got.token_logprobs.empty() && got.top_ids.empty() && got.top_values.empty())
          << what;
      EXPECT_EQ(got.top_logprobs, 0) << what;
      return;
    }
    const auto n = static_cast<size_t>(req.logprobs);
    ASSERT_EQ(got.token_logprobs.size(), L) << what;
    ASSERT_EQ(got.top_logprobs, req.logprobs) << what;
    ASSERT_EQ(got.top_ids.size(), L * n) << what;
    ASSERT_EQ(got.top_values.size(), L * n) << what;
    if (L == 0) return;
    std::vector<int32_t> seq = req.prompt;
    seq.insert(seq.end(), got.tokens.begin(), got.tokens.end() - 1);
    SequenceKv kv = target_->new_sequence();
    const gemma4::ForwardRow row{.kv = &kv, .tokens = seq, .all_logits = true};
    const gemma4::ForwardOutput& out = target_->forward(std::span(&row, 1));
    const int64_t V = target_->config().vocab_size;
    HostTensor logits(DType::kF32, out.logits.shape());
    target_->backend().download(out.logits, logits.view().data());
    for (size_t t = 0; t < L; ++t) {
      const int64_t pos = static_cast<int64_t>(req.prompt.size()) - 1 + static_cast<int64_t>(t);
      const std::span<const float> x(logits.data<float>() + pos * V, static_cast<size_t>(V));
      EXPECT_NEAR(got.token_logprobs[t], reference_logprob(x, got.tokens[t]), 1e-4)
          << what << " token " << t;
      const std::vector<int32_t> want = reference_top(x, static_cast<int>(n));
      for (size_t j = 0; j < n; ++j) {
        const int32_t id = got.top_ids[t * n + j];
        EXPECT_EQ(id, want[j]) << what << " token " << t << " top " << j;
        EXPECT_NEAR(got.top_values[t * n + j], reference_logprob(x, id), 1e-4) << what;
        if (j > 0) {
          EXPECT_LE(got.top_values[t * n + j], got.top_values[t * n + j - 1]) << what;
        }
      }
      // A greedy token is the argmax: the first of the top list, same value.
      if (req.params.greedy() && !req.params.has_penalties() && n > 0) {
        EXPECT_EQ(got.top_ids[t * n], got.tokens[t]) << what << " token " << t;
        EXPECT_EQ(got.top_values[t * n], got.token_logprobs[t]) << what << " token " << t;
      }
    }
  }

  static inline gemma4::Gemma4Model* target_ = nullptr;
  static inline assistant::AssistantModel* drafter_ = nullptr;
  static inline assistant::AssistantDrafter* assistant_ = nullptr;
  static inline ngram::NgramDrafter* ngram_ = nullptr;
};

// With and without a drafter, at k = 1 and 4, on device and host rounds: the
// logprobs equal the target's own log_softmax over the sequence, the tokens
// are those of the same batch without logprobs, and speculation changes no
// logprob (bit for bit on the CPU).
class EngineLogprobsBatch : public EngineLogprobs, public ::testing::WithParamInterface<bool> {};

TEST_P(EngineLogprobsBatch, EqualTheTargetsLogSoftmaxWithAndWithoutSpeculation) {
  const auto reqs = requests(8, 31, /*greedy_only=*/GetParam());
  auto without = reqs;
  for (DecodeRequest& r : without) r.logprobs = -1;
  const auto plain = speculative::decode(*target_, nullptr, reqs, {});
  const auto plain_tokens = speculative::decode(*target_, nullptr, without, {});
  for (size_t i = 0; i < reqs.size(); ++i) {
    EXPECT_EQ(plain[i].tokens, plain_tokens[i].tokens) << "request " << i;
    expect_reference(reqs[i], plain[i], "no drafter, request " + std::to_string(i));
  }
  struct Case {
    Drafter* drafter;
    const char* name;
    int k;
    speculative::RoundModes modes;
  };
  const Case cases[] = {{assistant_, "assistant", 1, {}},
                        {assistant_, "assistant", 4, {}},
                        {assistant_, "assistant host rounds", 4, {.host_rounds = true}},
                        {assistant_, "assistant host sampling", 4, {.host_sampling = true}},
                        {ngram_, "ngram", 1, {}},
                        {ngram_, "ngram", 4, {}}};
  for (const Case& c : cases) {
    const std::string what = std::string(c.name) + " k " + std::to_string(c.k);
    const auto specd =
        speculative::decode(*target_, c.drafter, reqs, {.draft_tokens = c.k}, {}, c.modes);
    const auto specd_tokens =
        speculative::decode(*target_, c.drafter, without, {.draft_tokens = c.k}, {}, c.modes);
    for (size_t i = 0; i < reqs.size(); ++i) {
      const std::string w = what + ", request " + std::to_string(i);
      EXPECT_EQ(specd[i].tokens, specd_tokens[i].tokens) << w << ": logprobs changed tokens";
      expect_reference(reqs[i], specd[i], w);
      // Greedy rows decode the same tokens with and without speculation, and
      // so get the same logprobs, bit for bit (batch-invariant kernels).
      if (reqs[i].params.greedy()) {
        ASSERT_EQ(specd[i].tokens, plain[i].tokens) << w;
        EXPECT_EQ(specd[i].token_logprobs, plain[i].token_logprobs) << w;
        EXPECT_EQ(specd[i].top_ids, plain[i].top_ids) << w;
        EXPECT_EQ(specd[i].top_values, plain[i].top_values) << w;
      }
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Batches, EngineLogprobsBatch, ::testing::Bool(),
                         [](const auto& info) { return info.param ? "greedy" : "mixed"; });

// Streaming: every update carries one logprob per token (and n top entries
// per token) for the requests that asked, none for the others.
TEST_F(EngineLogprobs, UpdatesCarryOneLogprobPerToken) {
  const auto reqs = requests(6, 5);
  Engine engine(*target_, assistant_,
                {.schedule = {.draft_tokens = 3}, .max_rows = 3, .max_batch_tokens = 16});
  std::vector<int64_t> ids;
  for (const DecodeRequest& r : reqs) ids.push_back(engine.submit(r).id);
  std::vector<size_t> seen(reqs.size());
  while (engine.has_work()) {
    for (const speculative::RequestUpdate& u : engine.step()) {
      const auto i = static_cast<size_t>(u.id);
      const int n = reqs[i].logprobs;
      if (n < 0) {
        EXPECT_TRUE(u.token_logprobs.empty() && u.top_ids.empty() && u.top_values.empty());
        EXPECT_EQ(u.top_logprobs, 0);
        continue;
      }
      EXPECT_EQ(u.token_logprobs.size(), u.tokens.size());
      EXPECT_EQ(u.top_logprobs, n);
      EXPECT_EQ(u.top_ids.size(), u.tokens.size() * static_cast<size_t>(n));
      EXPECT_EQ(u.top_values.size(), u.tokens.size() * static_cast<size_t>(n));
      for (float v : u.token_logprobs) EXPECT_TRUE(v <= 0.0f && std::isfinite(v)) << v;
      seen[i] += u.tokens.size();
    }
  }
  for (size_t i = 0; i < reqs.size(); ++i) {
    if (reqs[i].logprobs >= 0) {
      EXPECT_GT(seen[i], 0u) << i;
    }
  }
}

TEST_F(EngineLogprobs, SubmitRefusesSettingsOutsideTheRange) {
  Engine engine(*target_, nullptr, {});
  for (int bad : {-2, 21}) {
    const speculative::Submission s =
        engine.submit(DecodeRequest{.prompt = {1, 2}, .logprobs = bad});
    EXPECT_FALSE(s.accepted());
    EXPECT_NE(s.error.find("logprobs " + std::to_string(bad)), std::string::npos) << s.error;
  }
  for (int good : {-1, 0, 1, 20}) {
    EXPECT_TRUE(engine.submit(DecodeRequest{.prompt = {1, 2}, .logprobs = good}).accepted());
  }
}

}  // namespace
}  // namespace specula
