// SPDX-License-Identifier: Apache-2.0
// Random-weight assistant drafters (benchmarks without a checkpoint): the
// released-shape config builder, and a random drafter over a random tiny target
// drafting through AssistantDrafter (shapes, determinism per seed, the
// centroid head's fill, row subsets, no steady-state allocations).
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

#include "engine/draft/assistant/assistant.h"
#include "engine/draft/assistant/assistant_drafter.h"
#include "engine/model/gemma4/gemma4.h"

namespace specula {
namespace {

using gemma4::LayerType;
constexpr LayerType S = LayerType::kSliding;
constexpr LayerType F = LayerType::kFull;

std::vector<LayerType> repeat(const std::vector<LayerType>& block, int times) {
  std::vector<LayerType> out;
  for (int i = 0; i < times; ++i) out.insert(out.end(), block.begin(), block.end());
  return out;
}

// E2B's text config (gemma4-architecture.md §8); no weights are made from it.
gemma4::Gemma4Config e2b_config() {
  gemma4::Gemma4Config c;
  c.vocab_size = 262144;
  c.hidden_size = 1536;
  c.intermediate_size = 6144;
  c.num_hidden_layers = 35;
  c.layer_types = repeat({S, S, S, S, F}, 7);
  c.num_attention_heads = 8;
  c.num_key_value_heads = 1;
  c.head_dim = 256;
  c.global_head_dim = 512;
  c.hidden_size_per_layer_input = 256;
  c.vocab_size_per_layer_input = 262144;
  c.num_kv_shared_layers = 20;
  c.use_double_wide_mlp = true;
  c.sliding_window = 512;
  c.final_logit_softcapping = 30.0;
  c.finalize("e2b test config");
  return c;
}

// 31B's text config: k_eq_v full layers with 4 KV heads, no PLE.
gemma4::Gemma4Config config_31b() {
  gemma4::Gemma4Config c;
  c.vocab_size = 262144;
  c.hidden_size = 5376;
  c.intermediate_size = 21504;
  c.num_hidden_layers = 60;
  c.layer_types = repeat({S, S, S, S, S, F}, 10);
  c.num_attention_heads = 32;
  c.num_key_value_heads = 16;
  c.num_global_key_value_heads = 4;
  c.attention_k_eq_v = true;
  c.head_dim = 256;
  c.global_head_dim = 512;
  c.hidden_size_per_layer_input = 0;
  c.sliding_window = 1024;
  c.max_position_embeddings = 262144;
  c.final_logit_softcapping = 30.0;
  c.finalize("31b test config");
  return c;
}

// A tiny E2B-like target (PLE, one KV-shared layer) small enough for the CPU.
gemma4::Gemma4Config tiny_target() {
  gemma4::Gemma4Config c;
  c.vocab_size = 256;
  c.hidden_size = 32;
  c.intermediate_size = 64;
  c.num_hidden_layers = 4;
  c.layer_types = {S, F, S, F};
  c.num_attention_heads = 2;
  c.num_key_value_heads = 1;
  c.head_dim = 16;
  c.global_head_dim = 32;
  c.hidden_size_per_layer_input = 8;
  c.vocab_size_per_layer_input = 256;
  c.num_kv_shared_layers = 1;
  c.sliding_window = 4;
  c.max_position_embeddings = 256;
  c.finalize("tiny test target");
  return c;
}

// The centroid geometry of a tiny vocabulary: 16 clusters of 16 tokens, top-3.
assistant::AssistantConfig tiny_assistant(const gemma4::Gemma4Config& target) {
  assistant::AssistantConfig c = assistant::assistant_config_for(target);
  c.num_centroids = 16;
  c.centroid_intermediate_top_k = 3;
  return c;
}

TEST(AssistantConfigFor, E2BTargetGetsTheSmallCentroidDrafter) {
  const gemma4::Gemma4Config target = e2b_config();
  const assistant::AssistantConfig c = assistant::assistant_config_for(target);
  const gemma4::Gemma4Config& t = c.text;
  EXPECT_EQ(c.backbone_hidden_size, 1536);
  EXPECT_TRUE(c.use_ordered_embeddings);
  EXPECT_EQ(c.num_centroids, 2048);
  EXPECT_EQ(c.centroid_intermediate_top_k, 32);
  EXPECT_EQ(t.hidden_size, 256);
  EXPECT_EQ(t.intermediate_size, 2048);
  EXPECT_EQ(t.num_attention_heads, 4);
  EXPECT_EQ(t.vocab_size, 262144);
  EXPECT_EQ(t.sliding_window, 512);
  EXPECT_EQ(t.hidden_size_per_layer_input, 0);
  EXPECT_FALSE(t.final_logit_softcapping.has_value());
  ASSERT_EQ(t.layers.size(), 4u);
  const std::vector<LayerType> want = {S, S, S, F};
  for (size_t i = 0; i < 4; ++i) {
    EXPECT_EQ(t.layers[i].type, want[i]) << "layer " << i;
    EXPECT_TRUE(t.layers[i].kv_shared) << "layer " << i;
    EXPECT_EQ(t.layers[i].head_dim, want[i] == S ? 256 : 512) << "layer " << i;
    EXPECT_EQ(t.layers[i].n_kv_heads, 1) << "layer " << i;
    EXPECT_EQ(t.layers[i].intermediate_size, 2048) << "layer " << i;
  }
  EXPECT_EQ(assistant::assistant_config_for(target, 2).text.layers.size(), 2u);
}

TEST(AssistantConfigFor, LargeTargetGetsTheWideDenseDrafter) {
  const gemma4::Gemma4Config target = config_31b();
  const assistant::AssistantConfig c = assistant::assistant_config_for(target);
  const gemma4::Gemma4Config& t = c.text;
  EXPECT_EQ(c.backbone_hidden_size, 5376);
  EXPECT_FALSE(c.use_ordered_embeddings);
  EXPECT_EQ(t.hidden_size, 1024);
  EXPECT_EQ(t.intermediate_size, 8192);
  EXPECT_EQ(t.num_attention_heads, 32);
  EXPECT_EQ(t.sliding_window, 1024);
  ASSERT_EQ(t.layers.size(), 4u);
  EXPECT_EQ(t.layers[0].n_kv_heads, 16);
  EXPECT_EQ(t.layers[3].type, F);
  EXPECT_TRUE(t.layers[3].k_eq_v);
  EXPECT_EQ(t.layers[3].n_kv_heads, 4);
  EXPECT_THROW((void)assistant::assistant_config_for(target, 0), Error);
}

TEST(AssistantRandom, RejectsAGeometryThatDoesNotFitTheTarget) {
  Backend& be = backend_for(Device::cpu());
  const gemma4::Gemma4Config target = tiny_target();
  assistant::AssistantConfig c = tiny_assistant(target);
  c.backbone_hidden_size = 48;
  try {
    (void)assistant::AssistantModel::random(c, target, be, 1, false);
    FAIL() << "a drafter for another backbone must be rejected";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("backbone_hidden_size"), std::string::npos) << e.what();
  }
  c = tiny_assistant(target);
  c.num_centroids = 10;  // 256 tokens do not split into 10 clusters
  EXPECT_THROW((void)assistant::AssistantModel::random(c, target, be, 1, true), Error);
  EXPECT_NO_THROW((void)assistant::AssistantModel::random(c, target, be, 1, false));
}

// A random tiny target with prefilled sequences, and draft rounds over it.
class RandomDrafting : public ::testing::TestWithParam<bool> {
 protected:
  void SetUp() override {
    target_ = gemma4::Gemma4Model::random(tiny_target(), {.max_context = 64}, 11);
    const std::vector<std::vector<int32_t>> prompts = {
        {5, 9, 17, 33, 2, 71, 40, 8, 99, 12}, {3, 4, 5}, {7, 1, 9, 22, 23, 24, 60}};
    std::vector<gemma4::ForwardRow> rows;
    for (size_t i = 0; i < prompts.size(); ++i) kvs_.push_back(target_->new_sequence());
    for (size_t i = 0; i < prompts.size(); ++i)
      rows.push_back({.kv = &kvs_[i], .tokens = prompts[i]});
    const gemma4::ForwardOutput& out = target_->forward(rows);
    hidden_.assign(out.hidden.f32().begin(), out.hidden.f32().end());
  }

  std::unique_ptr<assistant::AssistantModel> drafter(uint64_t seed) {
    return assistant::AssistantModel::random(tiny_assistant(target_->config()), target_->config(),
                                               target_->backend(), seed, GetParam());
  }

  // One round: step s drafts the rows `subsets[s]` (indices of kvs_); returns
  // every step's logits, row-major, copied to the host.
  std::vector<std::vector<float>> draft_round(assistant::AssistantDrafter& source,
                                              const std::vector<std::vector<int>>& subsets) {
    const int64_t H = target_->config().hidden_size, V = target_->config().vocab_size;
    std::vector<std::vector<float>> result;
    for (size_t s = 0; s < subsets.size(); ++s) {
      std::vector<DraftRow> rows;
      for (int i : subsets[s]) {
        rows.push_back({.sequence = i,
                        .token = static_cast<int32_t>(10 + 7 * i + 3 * static_cast<int>(s)),
                        .position = static_cast<int32_t>(kvs_[static_cast<size_t>(i)].length()),
                        .target_kv = &kvs_[static_cast<size_t>(i)],
                        .target_hidden = s == 0 ? hidden_.data() + i * H : nullptr});
      }
      const Tensor logits = source.step(static_cast<int>(s), rows);
      EXPECT_EQ(logits.shape(), Shape({static_cast<int64_t>(rows.size()), V})) << "step " << s;
      std::vector<float> host(static_cast<size_t>(logits.numel()));
      target_->backend().download(logits, host.data());
      result.push_back(std::move(host));
    }
    return result;
  }

  std::unique_ptr<gemma4::Gemma4Model> target_;
  std::vector<SequenceKv> kvs_;
  std::vector<float> hidden_;  // f32 [3, H] post-norm hidden of each prompt's last token
};

TEST_P(RandomDrafting, StepsAreDeterministicPerSeed) {
  auto a = drafter(7), b = drafter(7), other = drafter(8);
  EXPECT_EQ(a->centroid_head(), GetParam()) << a->head_description();
  assistant::AssistantDrafter sa(*target_, *a), sb(*target_, *b), so(*target_, *other);
  const std::vector<std::vector<int>> subsets = {{0, 1, 2}, {0, 1, 2}, {0, 2}, {2}};
  const auto la = draft_round(sa, subsets), lb = draft_round(sb, subsets),
             lo = draft_round(so, subsets);
  for (size_t s = 0; s < la.size(); ++s) {
    for (float v : la[s]) ASSERT_TRUE(std::isfinite(v)) << "step " << s;
    EXPECT_EQ(la[s], lb[s]) << "step " << s << ": same seed, different logits";
    EXPECT_NE(la[s], lo[s]) << "step " << s << ": another seed, same logits";
  }
  // A second round restarts the chain from the target hiddens: same logits again.
  EXPECT_EQ(draft_round(sa, subsets), la);
}

TEST_P(RandomDrafting, RowSubsetsChainLikeRowsDraftedAlone) {
  // CPU kernels are batch-invariant, so a row drafted with others (and dropped
  // from the middle of later steps) chains exactly as when drafted alone.
  auto d = drafter(3);
  assistant::AssistantDrafter together(*target_, *d);
  const auto joint = draft_round(together, {{0, 1, 2}, {0, 1, 2}, {0, 2}, {2}});
  const int64_t V = target_->config().vocab_size;
  auto row = [&](const std::vector<float>& step, int64_t b) {
    return std::vector<float>(step.begin() + b * V, step.begin() + (b + 1) * V);
  };
  assistant::AssistantDrafter alone(*target_, *d);
  const auto solo2 = draft_round(alone, {{2}, {2}, {2}, {2}});
  EXPECT_EQ(row(joint[0], 2), solo2[0]);
  EXPECT_EQ(row(joint[1], 2), solo2[1]);
  EXPECT_EQ(row(joint[2], 1), solo2[2]);
  EXPECT_EQ(row(joint[3], 0), solo2[3]);
  const auto solo0 = draft_round(alone, {{0}, {0}, {0}});
  EXPECT_EQ(row(joint[2], 0), solo0[2]);
}

TEST_P(RandomDrafting, OnlyTheCentroidHeadFillsOutsideItsCandidates) {
  // Centroid head: every token outside the top-k clusters gets the same
  // (min candidate score - 1), the row's minimum. Dense head: every token is scored.
  auto d = drafter(5);
  assistant::AssistantDrafter source(*target_, *d);
  const int64_t V = target_->config().vocab_size;
  const int64_t at_min = GetParam() ? V - 3 * (V / 16) : 1;
  for (const auto& step : draft_round(source, {{0, 1, 2}, {0, 1, 2}})) {
    for (int64_t b = 0; b * V < static_cast<int64_t>(step.size()); ++b) {
      const auto first = step.begin() + b * V;
      const float fill = *std::min_element(first, first + V);
      EXPECT_EQ(std::count(first, first + V, fill), at_min) << "row " << b;
    }
  }
}

TEST_P(RandomDrafting, SteadyStepsMakeNoBackendAllocations) {
  auto d = drafter(9);
  assistant::AssistantDrafter source(*target_, *d);
  const std::vector<std::vector<int>> subsets = {{0, 1, 2}, {0, 1, 2}, {0, 2}};
  (void)draft_round(source, subsets);
  const int64_t before = target_->backend().allocation_count();
  for (int i = 0; i < 3; ++i) (void)draft_round(source, subsets);
  EXPECT_EQ(target_->backend().allocation_count(), before);
}

INSTANTIATE_TEST_SUITE_P(Heads, RandomDrafting, ::testing::Bool(),
                         [](const auto& info) { return info.param ? "centroid" : "dense"; });

}  // namespace
}  // namespace specula
