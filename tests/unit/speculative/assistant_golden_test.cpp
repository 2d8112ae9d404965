// SPDX-License-Identifier: Apache-2.0
// Parity of the assistant drafter with transformers: draft steps after prefill
// (logits, next hidden, tokens) on tests/golden/*_assistant* fixtures. We compare
// with the `draft_fixed.*` trace: the first draft after prefill reads the LAST
// prompt position's hidden (HF PR #48704); transformers 5.17 still reads
// position 0 (bug #48703), recorded as `draft.*`.
#include <gtest/gtest.h>

#include <cstring>

#include "engine/draft/assistant/assistant.h"
#include "engine/draft/assistant/assistant_drafter.h"
#include "engine/io/safetensors.h"
#include "engine/model/gemma4/gemma4.h"
#include "engine/speculative/decoder.h"
#include "tests/unit/model/golden_util.h"

namespace specula {
namespace {

using testing::golden_dir;
using testing::relative_error;
using testing::to_ids;

struct DrafterCase {
  const char* target;
  const char* drafter;
  bool centroid;
};

class AssistantGolden : public ::testing::TestWithParam<DrafterCase> {};

TEST_P(AssistantGolden, DraftStepsAfterPrefillMatchTransformers) {
  const DrafterCase c = GetParam();
  if (!testing::golden_exists(c.target) || !testing::golden_exists(c.drafter)) {
    GTEST_SKIP() << "fixtures " << c.target << " / " << c.drafter << " not generated";
  }
  auto target = gemma4::Gemma4Model::load(golden_dir(c.target));
  auto drafter =
      assistant::AssistantModel::load(golden_dir(c.drafter), target->config(), target->backend());
  EXPECT_EQ(drafter->centroid_head(), c.centroid) << drafter->head_description();
  io::SafetensorsFile want(golden_dir(c.drafter) + "/expected.safetensors");
  io::SafetensorsFile target_want(golden_dir(c.target) + "/expected.safetensors");

  const std::vector<int32_t> prompt = to_ids(target_want.get("input_ids"));
  SequenceKv kv = target->new_sequence();
  gemma4::ForwardRow row{.kv = &kv, .tokens = prompt};
  const auto& out = target->forward(std::span(&row, 1));
  auto logits = out.logits.f32();
  int32_t token =
      static_cast<int32_t>(std::max_element(logits.begin(), logits.end()) - logits.begin());
  const int64_t Hb = target->config().hidden_size;
  HostTensor hidden(DType::kF32, {1, Hb});
  std::memcpy(hidden.data<float>(), out.hidden.data(), out.hidden.nbytes());

  TargetCacheDonors donors(target->backend(), target->config());
  SequenceKv* kvs[] = {&kv};
  donors.bind(kvs);
  HostTensor ids(DType::kI32, {1}), positions(DType::kI32, {1}), embeds(DType::kF32, {1, Hb});
  positions.data<int32_t>()[0] = static_cast<int32_t>(kv.length());
  EXPECT_EQ(positions.data<int32_t>()[0], to_ids(want.get("draft.position"))[0]);
  double worst = 0;
  for (int step = 0; want.contains(fmt::format("draft_fixed.logits.{}", step)); ++step) {
    ids.data<int32_t>()[0] = token;
    target->embed_scaled(ids, embeds);
    // The drafter's input is [embedding ; hidden]: check both halves against transformers.
    Tensor inputs = want.get(fmt::format("draft_fixed.inputs_embeds.{}", step));
    EXPECT_LT(relative_error(embeds, Tensor(inputs.data(), DType::kF32, {1, Hb})), 1e-5)
        << "step " << step;
    auto s =
        drafter->step({.token_embeds = embeds, .hidden = hidden, .positions = positions}, donors);
    const double e_logits =
        relative_error(s.logits, want.get(fmt::format("draft_fixed.logits.{}", step)));
    const double e_hidden =
        relative_error(s.next_hidden, want.get(fmt::format("draft_fixed.next_hidden.{}", step)));
    EXPECT_LT(e_logits, 1e-4) << "step " << step;
    EXPECT_LT(e_hidden, 1e-4) << "step " << step;
    worst = std::max({worst, e_logits, e_hidden});
    token = s.tokens.i32()[0];
    EXPECT_EQ(token, to_ids(want.get(fmt::format("draft_fixed.token.{}", step)))[0])
        << "step " << step;
    std::memcpy(hidden.data<float>(), s.next_hidden.data(), s.next_hidden.nbytes());
  }
  std::printf("[ parity ] %s worst relative error %.3g\n", c.drafter, worst);
}

TEST_P(AssistantGolden, AssistedGreedyGenerationReproducesTransformers) {
  const DrafterCase c = GetParam();
  if (!testing::golden_exists(c.target) || !testing::golden_exists(c.drafter)) GTEST_SKIP();
  auto target = gemma4::Gemma4Model::load(golden_dir(c.target));
  auto drafter =
      assistant::AssistantModel::load(golden_dir(c.drafter), target->config(), target->backend());
  assistant::AssistantDrafter source(*target, *drafter);
  io::SafetensorsFile want(golden_dir(c.drafter) + "/expected.safetensors");
  const std::vector<int32_t> prompt = to_ids(want.get("input_ids"));
  const std::vector<int32_t> assisted = to_ids(want.get("assisted_ids"));
  speculative::DecodeRequest req{.prompt = prompt, .params = {}};
  req.params.temperature = 0;
  req.params.max_tokens = static_cast<int>(assisted.size() - prompt.size());
  // transformers' generate(assistant_model=...) used 6 draft tokens per round.
  const auto got = speculative::decode(*target, &source, std::span(&req, 1), {.draft_tokens = 6}).front();
  std::vector<int32_t> full = prompt;
  full.insert(full.end(), got.tokens.begin(), got.tokens.end());
  EXPECT_EQ(full, assisted);
  EXPECT_GT(got.stats.accepted, 0) << "the trained fixture drafter should get drafts accepted";
}

INSTANTIATE_TEST_SUITE_P(Fixtures, AssistantGolden,
                         ::testing::Values(DrafterCase{"e2b_like", "e2b_like_assistant", true},
                                           DrafterCase{"e2b_like", "e2b_like_assistant_dense",
                                                       false},
                                           DrafterCase{"dense_kev", "dense_kev_assistant", false}),
                         [](const auto& info) { return std::string(info.param.drafter); });

TEST(AssistantLoad, RejectsADrafterForAnotherTarget) {
  if (!testing::golden_exists("dense_kev") || !testing::golden_exists("e2b_like_assistant"))
    GTEST_SKIP();
  auto target = gemma4::Gemma4Model::load(golden_dir("dense_kev"));
  try {
    (void)assistant::AssistantModel::load(golden_dir("e2b_like_assistant"), target->config(),
                                            target->backend());
    FAIL() << "a drafter with mismatched donor geometry must be rejected";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("e2b_like_assistant"), std::string::npos) << e.what();
  }
}

}  // namespace
}  // namespace specula
