// SPDX-License-Identifier: Apache-2.0
// The embedded default family (models/): the shipped bf16 checkpoints load,
// match transformers (logits, greedy continuations, tokenizer), and speculative
// decoding reproduces the per-round acceptance computed in PyTorch with the
// same semantics (tests/golden/embedded, made by tools/train/train_family.py).
#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include <filesystem>
#include <fstream>

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

class EmbeddedFamily : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    if (!std::filesystem::exists(models_dir() + "/gemma4-tiny-py") ||
        !testing::golden_exists("embedded"))
      return;
    target_ = gemma4::Gemma4Model::load(models_dir() + "/gemma4-tiny-py").release();
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
    // Prompt 2, token 30: transformers' GPU run disagrees with two fp32 CPU
    // implementations by a 3.2-logit margin (meta.json known_issues): compare before it.
    const size_t compare = i == 2 ? 30 : got.size();
    for (size_t t = 0; t < compare; ++t)
      ASSERT_EQ(got[t], want[prompt.size() + t]) << "prompt " << i << " token " << t;
  }
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
