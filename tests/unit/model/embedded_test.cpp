// SPDX-License-Identifier: Apache-2.0
// The embedded default family (models/): the shipped bf16 checkpoints load,
// match transformers (logits, greedy continuations, tokenizer), and speculative
// decoding reproduces the per-round acceptance computed in PyTorch with the
// same semantics (tests/golden/embedded, made by tools/train/train_family.py).
#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <numeric>

#include "engine/draft/assistant/assistant_drafter.h"
#include "engine/io/safetensors.h"
#include "engine/speculative/decoder.h"
#include "engine/tokenizer/tokenizer.h"
#include "tests/unit/model/golden_util.h"

namespace specula {
namespace {

using testing::relative_error;
using testing::to_ids;

std::string models_dir() {
  return std::string(SPECULA_SOURCE_DIR) + "/models";
}

// Prompt 2, new token 30: see Prompt2Token30IsTheReferencesOwnDisagreement.
constexpr size_t kPrompt2Token = 30;
constexpr int32_t kReference193 = 428;  // transformers, position 192 as the last of 193 rows
constexpr int32_t kReference194 = 429;  // transformers, position 192 in a 194-row forward

class EmbeddedFamily : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    if (!std::filesystem::exists(models_dir() + "/gemma4-tiny-py") ||
        !testing::golden_exists("embedded"))
      return;
    // An f32 KV cache: the reference is transformers in f32 math, and these
    // bounds are that tight (a bf16 checkpoint's default bf16 cache moves the
    // logits by 3e-3 relative here: tests/unit/kv_dtype_test.cpp).
    gemma4::LoadOptions options;
    options.kv_dtype = DType::kF32;
    target_ = gemma4::Gemma4Model::load(models_dir() + "/gemma4-tiny-py", options).release();
    drafter_ = assistant::AssistantModel::load(models_dir() + "/gemma4-tiny-py-assistant",
                                               target_->config(), target_->backend())
                   .release();
    expected_ = new io::SafetensorsFile(testing::golden_dir("embedded") + "/expected.safetensors");
  }
  static void TearDownTestSuite() {
    delete expected_;
    delete drafter_;
    delete target_;
  }
  void SetUp() override {
    if (target_ == nullptr) GTEST_SKIP() << "embedded family or its golden not present";
  }
  static gemma4::Gemma4Model* target_;
  static assistant::AssistantModel* drafter_;
  static io::SafetensorsFile* expected_;
};
gemma4::Gemma4Model* EmbeddedFamily::target_ = nullptr;
assistant::AssistantModel* EmbeddedFamily::drafter_ = nullptr;
io::SafetensorsFile* EmbeddedFamily::expected_ = nullptr;

TEST_F(EmbeddedFamily, ShardedBf16CheckpointMatchesTransformersLogits) {
  const std::vector<int32_t> ids = to_ids(expected_->get("input_ids.0"));
  SequenceKv kv = target_->new_sequence();
  gemma4::ForwardRow row{.kv = &kv, .tokens = ids, .all_logits = true};
  const auto& out = target_->forward(std::span(&row, 1));
  const double err = relative_error(out.logits, expected_->get("logits.0"));
  std::printf("[ parity ] embedded target logits relative error %.3g\n", err);
  // transformers ran fp32 on the GPU from the same bf16 weights; we run fp32 on the CPU.
  EXPECT_LT(err, 1e-3);
}

TEST_F(EmbeddedFamily, GreedyContinuationsMatchTransformers) {
  for (int i = 0; i < 4; ++i) {
    const std::vector<int32_t> prompt = to_ids(expected_->get(fmt::format("input_ids.{}", i)));
    const std::vector<int32_t> want = to_ids(expected_->get(fmt::format("generate_ids.{}", i)));
    speculative::DecodeRequest req{.prompt = prompt, .params = {}};
    req.params.temperature = 0;
    req.params.max_tokens = static_cast<int>(want.size() - prompt.size());
    const auto got = speculative::decode(*target_, nullptr, std::span(&req, 1), {}).front().tokens;
    ASSERT_EQ(got.size(), want.size() - prompt.size()) << "prompt " << i;
    for (size_t t = 0; t < got.size(); ++t) {
      if (i == 2 && t == kPrompt2Token) {
        // The reference disagrees with itself here: see
        // Prompt2Token30IsTheReferencesOwnDisagreement.
        EXPECT_EQ(want[prompt.size() + t], kReference193);
        EXPECT_EQ(got[t], kReference194);
        break;  // what follows continues a different prefix (teacher-forced below)
      }
      ASSERT_EQ(got[t], want[prompt.size() + t]) << "prompt " << i << " token " << t;
    }
  }
}

// Prompt 2, new token 30 (position 192): the golden's 428 disagrees with the
// golden's own speculative run (meta.json known_issues), so instead of cutting
// the comparison it is checked here, teacher-forced and in full. The
// continuation there is the loop "429 361 429 361 ..."; transformers (CUDA,
// fp32, SDPA) computed position 192 twice on the same prefix:
//   - greedy (generate_ids.2) and the first training run's speculative decode
//     (its window ended at 192 too): as the last row of a 193-token no-cache
//     forward -> 428;
//   - the drafter retrain's speculative decode (this golden's spec_drafted.2 and
//     spec_accepted.2, which SpeculativeAcceptanceEqualsPyTorch reproduces round
//     by round): its last round verifies positions 192 and 193 in a 194-token
//     forward (drafted 1, accepted 1) -> 429
//     (meta.json golden.prompts[2].spec_first_difference: spec 429, golden 428).
// Under a causal mask row 192 cannot depend on row 193, so the reference
// disagrees with itself. Specula (CPU, f32) and a from-the-spec torch 1.13 CPU
// reference give 429. It is no near-tie: specula's logits at 192 are
//   429: 15.7883, 1627: 13.1414, 621: 12.8917, 1163: 12.5771, 428: 12.5470,
// so 428 is fifth, 3.2413 below the top (rounding moves these by ~1e-5; the
// golden has no logits for prompt 2, so transformers' own margin is unknown).
// Nor is it the sliding window's edge: specula's argmax at 192 stays 429 with
// sliding_window 64, 127, 129 or 4096 (no window) in config.json. Every other
// reference token, the one after 428 included, is specula's argmax given the
// reference's prefix. Both forwards that gave 428 have 193 tokens; of every
// forward behind this golden (greedy, and the windows of both speculative runs,
// rebuilt from their spec_* tensors, the first run's at commit eebc11c) they are the only ones
// whose last query row is alone in a 64-row tile (193 = 3 x 64 + 1) while the window masks part of
// its keys (prompt 0's greedy meets 65 = 64 + 1 with no window in play). That points at an edge
// case of the CUDA attention kernel rather than at the model math; without a GPU torch here it
// stays a hypothesis.
TEST_F(EmbeddedFamily, Prompt2Token30IsTheReferencesOwnDisagreement) {
  const std::vector<int32_t> prompt = to_ids(expected_->get("input_ids.2"));
  const std::vector<int32_t> want = to_ids(expected_->get("generate_ids.2"));
  ASSERT_EQ(want.size(), prompt.size() + 32);
  const size_t pos = prompt.size() - 1 + kPrompt2Token;  // the row that predicts token 30
  ASSERT_EQ(pos, 192u);
  ASSERT_EQ(want[pos + 1], kReference193);
  // The retrain's speculative decode took 429 there (meta.json says so; the
  // spec_* tensors encode the 194-token window that computed it).
  std::ifstream in(testing::golden_dir("embedded") + "/meta.json");
  const nlohmann::json meta = nlohmann::json::parse(in);
  const nlohmann::json& diff = meta["golden"]["prompts"][2]["spec_first_difference"];
  EXPECT_EQ(diff["new_token_index"].get<size_t>(), kPrompt2Token);
  EXPECT_EQ(diff["spec"][0].get<int32_t>(), kReference194);
  EXPECT_EQ(diff["golden"][0].get<int32_t>(), kReference193);

  // Teacher-forced over the golden sequence, 428 included: every greedy token of
  // the reference, before and after position 192, is specula's argmax.
  const std::vector<int32_t> forced(want.begin(), want.end() - 1);
  SequenceKv kv = target_->new_sequence();
  gemma4::ForwardRow row{.kv = &kv, .tokens = forced, .all_logits = true};
  const auto& out = target_->forward(std::span(&row, 1));
  const int64_t V = out.logits.dim(1);
  auto logits_at = [&](size_t p) { return out.logits.data_as<const float>() + p * V; };
  for (size_t p = prompt.size() - 1; p < forced.size(); ++p) {
    const float* l = logits_at(p);
    const int32_t top = static_cast<int32_t>(std::max_element(l, l + V) - l);
    if (p == pos) continue;
    EXPECT_EQ(top, want[p + 1]) << "position " << p;
  }
  // Position 192: specula's argmax is 429, and 428 is not even the runner-up.
  const float* l = logits_at(pos);
  const float margin = l[kReference194] - l[kReference193];
  const auto rank_of_428 = std::count_if(l, l + V, [&](float x) { return x > l[kReference193]; });
  std::vector<int32_t> order(static_cast<size_t>(V));
  std::iota(order.begin(), order.end(), 0);
  std::partial_sort(order.begin(), order.begin() + 6, order.end(),
                    [&](int32_t a, int32_t b) { return l[a] > l[b]; });
  std::string top;
  for (int k = 0; k < 6; ++k) top += fmt::format(" {}:{:.4f}", order[k], l[order[k]]);
  std::printf(
      "[ parity ] prompt 2 position 192: logit[%d] - logit[%d] = %.5f, %d ranks %ld; top%s\n",
      kReference194, kReference193, margin, kReference193, static_cast<long>(rank_of_428),
      top.c_str());
  EXPECT_EQ(order[0], kReference194);
  EXPECT_EQ(rank_of_428, 4);
  EXPECT_NEAR(margin, 3.2413f, 0.001f);
}

TEST_F(EmbeddedFamily, SpeculativeAcceptanceEqualsPyTorch) {
  assistant::AssistantDrafter source(*target_, *drafter_);
  EXPECT_TRUE(drafter_->centroid_head());
  for (int i = 0; i < 4; ++i) {
    const std::vector<int32_t> prompt = to_ids(expected_->get(fmt::format("input_ids.{}", i)));
    speculative::DecodeRequest req{.prompt = prompt, .params = {}};
    req.params.temperature = 0;
    req.params.max_tokens = 32;
    const auto plain = speculative::decode(*target_, nullptr, std::span(&req, 1), {}).front();
    const auto specd =
        speculative::decode(*target_, &source, std::span(&req, 1), {.draft_tokens = 4}).front();
    EXPECT_EQ(specd.tokens, plain.tokens) << "prompt " << i;
    EXPECT_EQ(specd.stats.round_drafted, to_ids(expected_->get(fmt::format("spec_drafted.{}", i))))
        << "prompt " << i;
    EXPECT_EQ(specd.stats.round_accepted,
              to_ids(expected_->get(fmt::format("spec_accepted.{}", i))))
        << "prompt " << i;
  }
}

TEST_F(EmbeddedFamily, TokenizerRoundTripsMatchTransformers) {
  std::ifstream in(testing::golden_dir("embedded") + "/meta.json");
  const nlohmann::json meta = nlohmann::json::parse(in);
  Tokenizer tok = Tokenizer::load(models_dir() + "/gemma4-tiny-py");
  for (const auto& rt : meta["tokenizer"]["round_trips"]) {
    const std::string text = rt["text"];
    EXPECT_EQ(tok.encode(text, true), rt["ids"].get<std::vector<int32_t>>()) << text;
    EXPECT_EQ(tok.decode(tok.encode(text, true), false), rt["decoded"].get<std::string>()) << text;
  }
}

}  // namespace
}  // namespace specula
