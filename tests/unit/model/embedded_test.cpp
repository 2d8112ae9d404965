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

// Where transformers' greedy golden disagrees with its own speculative run
// (meta.json golden.prompts[i].spec_first_difference): see
// ReferenceDisagreesWithItselfOnlyWhereMetaSaysSo.
struct ReferenceDisagreement {
  int prompt = 0;
  size_t new_token = 0;  // index into the generated tokens
  int32_t greedy = 0;    // generate_ids.<prompt> there
  int32_t spec = 0;      // the reference's speculative run there
};

std::vector<ReferenceDisagreement> reference_disagreements() {
  std::ifstream in(testing::golden_dir("embedded") + "/meta.json");
  const nlohmann::json meta = nlohmann::json::parse(in);
  std::vector<ReferenceDisagreement> out;
  const nlohmann::json& prompts = meta["golden"]["prompts"];
  for (size_t i = 0; i < prompts.size(); ++i) {
    if (!prompts[i].contains("spec_first_difference")) continue;
    const nlohmann::json& d = prompts[i]["spec_first_difference"];
    out.push_back({.prompt = static_cast<int>(i),
                   .new_token = d["new_token_index"].get<size_t>(),
                   .greedy = d["golden"][0].get<int32_t>(),
                   .spec = d["spec"][0].get<int32_t>()});
  }
  return out;
}

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
  const std::vector<ReferenceDisagreement> disagreements = reference_disagreements();
  for (int i = 0; i < 4; ++i) {
    const std::vector<int32_t> prompt = to_ids(expected_->get(fmt::format("input_ids.{}", i)));
    const std::vector<int32_t> want = to_ids(expected_->get(fmt::format("generate_ids.{}", i)));
    speculative::DecodeRequest req{.prompt = prompt, .params = {}};
    req.params.temperature = 0;
    req.params.max_tokens = static_cast<int>(want.size() - prompt.size());
    const auto got = speculative::decode(*target_, nullptr, std::span(&req, 1), {}).front().tokens;
    ASSERT_EQ(got.size(), want.size() - prompt.size()) << "prompt " << i;
    const auto d = std::find_if(disagreements.begin(), disagreements.end(),
                                [&](const ReferenceDisagreement& x) { return x.prompt == i; });
    for (size_t t = 0; t < got.size(); ++t) {
      if (d != disagreements.end() && t == d->new_token) {
        // The reference disagrees with itself here: specula takes the token of
        // the reference's speculative run, and what follows continues a
        // different prefix (checked teacher-forced below).
        EXPECT_EQ(want[prompt.size() + t], d->greedy);
        EXPECT_EQ(got[t], d->spec);
        break;
      }
      ASSERT_EQ(got[t], want[prompt.size() + t]) << "prompt " << i << " token " << t;
    }
  }
}

// Twice, with two different trained targets (the standard-library one of
// 2026-11-29 and the Debian-corpus one of 2026-12-04), transformers 5.17 (CUDA,
// fp32, SDPA) computed golden prompt 2's position 192 differently in two
// forwards over the same prefix:
//   - greedy (generate_ids.2), as the last row of a 193-token no-cache forward;
//   - the speculative run, whose last verify window held positions 192 and 193
//     in a 194-token forward (drafted 1, accepted 1; SpeculativeAcceptance-
//     EqualsPyTorch reproduces its rounds).
// Under a causal mask row 192 cannot depend on row 193, so the reference
// disagrees with itself; specula (CPU, f32) and, for the first target, a
// from-the-spec torch 1.13 CPU reference side with the 194-token forward, by a
// wide margin (3.24 logits for the first target; printed below). Both times the
// odd forward is the only one behind the golden whose last query row is alone
// in a 64-row tile (193 = 3 x 64 + 1) while the sliding window (128) masks part
// of its keys: an edge case of the CUDA attention path, not of the model math.
// So this test checks, teacher-forced over the greedy golden, that every token
// but the ones meta.json names is specula's argmax, and that at those specula
// takes the speculative run's token.
TEST_F(EmbeddedFamily, ReferenceDisagreesWithItselfOnlyWhereMetaSaysSo) {
  const std::vector<ReferenceDisagreement> disagreements = reference_disagreements();
  ASSERT_LE(disagreements.size(), 1u) << "more than one prompt where the reference disagrees";
  for (const ReferenceDisagreement& d : disagreements) {
    const std::vector<int32_t> prompt = to_ids(expected_->get(fmt::format("input_ids.{}", d.prompt)));
    const std::vector<int32_t> want = to_ids(expected_->get(fmt::format("generate_ids.{}", d.prompt)));
    const size_t pos = prompt.size() - 1 + d.new_token;  // the row that predicts it
    ASSERT_LT(pos + 1, want.size());
    ASSERT_EQ(want[pos + 1], d.greedy);
    const std::vector<int32_t> forced(want.begin(), want.end() - 1);
    SequenceKv kv = target_->new_sequence();
    gemma4::ForwardRow row{.kv = &kv, .tokens = forced, .all_logits = true};
    const auto& out = target_->forward(std::span(&row, 1));
    const int64_t V = out.logits.dim(1);
    auto logits_at = [&](size_t p) { return out.logits.data_as<const float>() + p * V; };
    for (size_t p = prompt.size() - 1; p < forced.size(); ++p) {
      if (p == pos) continue;
      const float* l = logits_at(p);
      EXPECT_EQ(std::max_element(l, l + V) - l, want[p + 1]) << "position " << p;
    }
    const float* l = logits_at(pos);
    std::vector<int32_t> order(static_cast<size_t>(V));
    std::iota(order.begin(), order.end(), 0);
    std::partial_sort(order.begin(), order.begin() + 6, order.end(),
                      [&](int32_t a, int32_t b) { return l[a] > l[b]; });
    std::string top;
    for (int k = 0; k < 6; ++k) top += fmt::format(" {}:{:.4f}", order[k], l[order[k]]);
    std::printf("[ parity ] prompt %d position %zu: logit[%d] - logit[%d] = %.5f; top%s\n",
                d.prompt, pos, d.spec, d.greedy, l[d.spec] - l[d.greedy], top.c_str());
    EXPECT_EQ(order[0], d.spec);
    // No near-tie: rounding moves these logits by ~1e-5.
    EXPECT_GT(l[d.spec] - l[d.greedy], 0.1f);
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
