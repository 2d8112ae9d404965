// SPDX-License-Identifier: Apache-2.0
// Checks that the golden fixtures under tests/golden (made by tools/golden/make_golden.py
// from Hugging Face transformers) are present and follow the format contract of
// tests/golden/README.md: every expected tensor exists with its dtype and shape, the
// checkpoints parse, and the cross-fixture invariants hold (prompt prefix, assisted output
// equal to plain greedy output, accepted counts adding up). The numeric comparisons against
// the engine live in the model / speculative-decoding tests that consume these files.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <filesystem>
#include <set>
#include <string>
#include <vector>

#include "engine/core/dtype.h"
#include "engine/core/tensor.h"
#include "engine/io/json_util.h"
#include "engine/io/safetensors.h"

namespace specula::io {
namespace {

namespace fs = std::filesystem;

constexpr int64_t kSeq = 20;  // prompt length S
constexpr int64_t kSeqB = 7;  // second prompt
constexpr int64_t kNewTokens = 40;
constexpr int64_t kVocab = 128;
constexpr int64_t kDraftSteps = 6;
constexpr int64_t kBackbone = 32;  // target hidden size

std::string golden_dir(const std::string& name) {
  return (fs::path(SPECULA_SOURCE_DIR) / "tests" / "golden" / name).string();
}

// Per-fixture geometry of the donor K/V: {kv heads, head dim} for sliding and full layers.
struct TargetSpec {
  std::string name;
  int64_t sliding_kv;
  int64_t full_kv;
  DType weight_dtype;
};

const std::vector<TargetSpec>& target_specs() {
  static const std::vector<TargetSpec> specs = {
      {"e2b_like", 1, 1, DType::kF32},
      {"dense_kev", 2, 1, DType::kF32},
      {"moe", 2, 1, DType::kF32},
      {"e2b_like_bf16", 1, 1, DType::kBF16},
  };
  return specs;
}

struct AssistantSpec {
  std::string name;
  std::string target;
  int64_t sliding_kv;
  int64_t full_kv;
  bool ordered;  // centroid ("masked embedding") LM head
};

const std::vector<AssistantSpec>& assistant_specs() {
  static const std::vector<AssistantSpec> specs = {
      {"e2b_like_assistant", "e2b_like", 1, 1, true},
      {"e2b_like_assistant_dense", "e2b_like", 1, 1, false},
      {"dense_kev_assistant", "dense_kev", 2, 1, false},
  };
  return specs;
}

constexpr int64_t kSlidingDim = 16;  // head_dim
constexpr int64_t kFullDim = 32;     // global_head_dim

void expect_tensor(const SafetensorsFile& f, const std::string& name, DType dtype,
                   const Shape& shape) {
  ASSERT_TRUE(f.contains(name)) << f.path() << " lacks " << name;
  const TensorInfo& info = f.info(name);
  EXPECT_EQ(info.dtype, dtype) << f.path() << ": " << name;
  EXPECT_EQ(info.shape, shape) << f.path() << ": " << name;
}

std::vector<int32_t> ints(const SafetensorsFile& f, const std::string& name) {
  Tensor t = f.get(name);
  auto span = t.i32();
  return {span.begin(), span.end()};
}

void expect_files(const std::string& dir) {
  for (const char* file :
       {"config.json", "model.safetensors", "meta.json", "expected.safetensors"}) {
    EXPECT_TRUE(fs::exists(fs::path(dir) / file)) << dir << " lacks " << file;
  }
}

class GoldenTarget : public ::testing::TestWithParam<TargetSpec> {};

TEST_P(GoldenTarget, ExpectedTensorsFollowTheContract) {
  const TargetSpec& spec = GetParam();
  const std::string dir = golden_dir(spec.name);
  ASSERT_TRUE(fs::is_directory(dir)) << dir;
  expect_files(dir);
  const nlohmann::json config = read_json_file(dir + "/config.json");
  const int64_t layers = config.at("num_hidden_layers").get<int64_t>();
  const int64_t hidden = config.at("hidden_size").get<int64_t>();
  EXPECT_EQ(hidden, kBackbone);
  EXPECT_EQ(config.at("vocab_size").get<int64_t>(), kVocab);

  SafetensorsFile f(dir + "/expected.safetensors");
  expect_tensor(f, "input_ids", DType::kI32, {kSeq});
  for (int64_t i = 0; i <= layers; ++i) {
    expect_tensor(f, "hidden_states." + std::to_string(i), DType::kF32, {kSeq, hidden});
  }
  EXPECT_FALSE(f.contains("hidden_states." + std::to_string(layers + 1)));
  expect_tensor(f, "logits", DType::kF32, {kSeq, kVocab});
  expect_tensor(f, "shared_kv.sliding_attention.k", DType::kF32,
                {spec.sliding_kv, kSeq, kSlidingDim});
  expect_tensor(f, "shared_kv.sliding_attention.v", DType::kF32,
                {spec.sliding_kv, kSeq, kSlidingDim});
  expect_tensor(f, "shared_kv.full_attention.k", DType::kF32, {spec.full_kv, kSeq, kFullDim});
  expect_tensor(f, "shared_kv.full_attention.v", DType::kF32, {spec.full_kv, kSeq, kFullDim});
  expect_tensor(f, "generate_ids", DType::kI32, {kSeq + kNewTokens});
  expect_tensor(f, "input_ids_b", DType::kI32, {kSeqB});
  expect_tensor(f, "logits_b", DType::kF32, {kSeqB, kVocab});
  if (HasFatalFailure()) return;

  const std::vector<int32_t> ids = ints(f, "input_ids");
  for (int32_t id : ids) EXPECT_TRUE(id >= 3 && id < kVocab) << id;
  const std::vector<int32_t> gen = ints(f, "generate_ids");
  EXPECT_TRUE(std::equal(ids.begin(), ids.end(), gen.begin()))
      << "generate_ids must start with the prompt";
  for (int32_t id : gen) EXPECT_TRUE(id >= 0 && id < kVocab) << id;
  // Logits are soft-capped at 30.
  for (float v : f.get("logits").f32()) {
    ASSERT_TRUE(std::isfinite(v) && std::fabs(v) < 30.0f) << v;
  }
}

TEST_P(GoldenTarget, CheckpointParses) {
  const TargetSpec& spec = GetParam();
  Checkpoint ckpt(golden_dir(spec.name));
  ASSERT_TRUE(ckpt.contains("model.embed_tokens.weight"));
  EXPECT_EQ(ckpt.info("model.embed_tokens.weight").dtype, spec.weight_dtype);
  EXPECT_EQ(ckpt.info("model.embed_tokens.weight").shape, Shape({kVocab, kBackbone}));
  ASSERT_TRUE(ckpt.contains("model.norm.weight"));
  // Tied head: save_pretrained drops lm_head.weight.
  EXPECT_FALSE(ckpt.contains("lm_head.weight"));
  ASSERT_TRUE(ckpt.contains("model.layers.0.layer_scalar"));
  EXPECT_EQ(ckpt.info("model.layers.0.layer_scalar").shape, Shape({1}));
}

INSTANTIATE_TEST_SUITE_P(Fixtures, GoldenTarget, ::testing::ValuesIn(target_specs()),
                         [](const auto& info) { return info.param.name; });

class GoldenAssistant : public ::testing::TestWithParam<AssistantSpec> {};

TEST_P(GoldenAssistant, ExpectedTensorsFollowTheContract) {
  const AssistantSpec& spec = GetParam();
  const std::string dir = golden_dir(spec.name);
  ASSERT_TRUE(fs::is_directory(dir)) << dir;
  expect_files(dir);
  SafetensorsFile f(dir + "/expected.safetensors");
  SafetensorsFile target(golden_dir(spec.target) + "/expected.safetensors");

  expect_tensor(f, "input_ids", DType::kI32, {kSeq});
  expect_tensor(f, "draft.shared_kv.sliding_attention.k", DType::kF32,
                {spec.sliding_kv, kSeq, kSlidingDim});
  expect_tensor(f, "draft.shared_kv.sliding_attention.v", DType::kF32,
                {spec.sliding_kv, kSeq, kSlidingDim});
  expect_tensor(f, "draft.shared_kv.full_attention.k", DType::kF32, {spec.full_kv, kSeq, kFullDim});
  expect_tensor(f, "draft.shared_kv.full_attention.v", DType::kF32, {spec.full_kv, kSeq, kFullDim});
  expect_tensor(f, "draft.hidden_in", DType::kF32, {kBackbone});
  expect_tensor(f, "draft.token_in", DType::kI32, {1});
  expect_tensor(f, "draft.position", DType::kI32, {1});
  expect_tensor(f, "draft.attention_mask", DType::kI32, {kSeq + 1});
  for (const std::string prefix : {"draft.", "draft_fixed."}) {
    for (int64_t i = 0; i < kDraftSteps; ++i) {
      const std::string n = std::to_string(i);
      expect_tensor(f, prefix + "inputs_embeds." + n, DType::kF32, {1, 2 * kBackbone});
      expect_tensor(f, prefix + "logits." + n, DType::kF32, {kVocab});
      expect_tensor(f, prefix + "next_hidden." + n, DType::kF32, {kBackbone});
      expect_tensor(f, prefix + "token." + n, DType::kI32, {1});
    }
  }
  expect_tensor(f, "generate_ids", DType::kI32, {kSeq + kNewTokens});
  expect_tensor(f, "assisted_ids", DType::kI32, {kSeq + kNewTokens});
  ASSERT_TRUE(f.contains("assisted_accepted_per_round"));
  const int64_t rounds = f.info("assisted_accepted_per_round").shape.dim(0);
  expect_tensor(f, "assisted.drafted_per_round", DType::kI32, {rounds});
  expect_tensor(f, "assisted.round_n_cur", DType::kI32, {rounds});
  ASSERT_TRUE(f.contains("assisted.draft_tokens"));
  const int64_t calls = f.info("assisted.draft_tokens").shape.dim(0);
  expect_tensor(f, "assisted.draft_logits", DType::kF32, {calls, kVocab});
  expect_tensor(f, "assisted.draft_inputs_embeds", DType::kF32, {calls, 2 * kBackbone});
  expect_tensor(f, "assisted.draft_positions", DType::kI32, {calls});
  expect_tensor(f, "assisted.draft_kv_len", DType::kI32, {calls, 2});
  if (HasFatalFailure()) return;

  // The drafter runs on the target fixture's prompt; assisted greedy output is lossless.
  EXPECT_EQ(ints(f, "input_ids"), ints(target, "input_ids"));
  EXPECT_EQ(ints(f, "generate_ids"), ints(target, "generate_ids"));
  EXPECT_EQ(ints(f, "assisted_ids"), ints(f, "generate_ids"));
  // The first drafter input is [E_target(token_in) ; hidden_in] at position n_cur - 1 = S.
  EXPECT_EQ(ints(f, "draft.position"), std::vector<int32_t>{static_cast<int32_t>(kSeq)});
  EXPECT_EQ(ints(f, "draft.token_in")[0], ints(target, "generate_ids")[kSeq]);
  const auto embeds0 = f.get("draft.inputs_embeds.0").f32();
  const auto hidden_in = f.get("draft.hidden_in").f32();
  for (int64_t i = 0; i < kBackbone; ++i) EXPECT_EQ(embeds0[kBackbone + i], hidden_in[i]) << i;

  // Every round (the prefill round included) commits accepted + 1 tokens.
  const std::vector<int32_t> accepted = ints(f, "assisted_accepted_per_round");
  const std::vector<int32_t> drafted = ints(f, "assisted.drafted_per_round");
  const std::vector<int32_t> n_cur = ints(f, "assisted.round_n_cur");
  int64_t committed = 0;
  int64_t total_drafted = 0;
  for (size_t r = 0; r < accepted.size(); ++r) {
    EXPECT_LE(accepted[r], drafted[r]) << "round " << r;
    EXPECT_EQ(n_cur[r], kSeq + committed) << "round " << r;
    committed += accepted[r] + 1;
    total_drafted += drafted[r];
  }
  EXPECT_EQ(committed, kNewTokens);
  EXPECT_EQ(total_drafted, calls);
}

TEST_P(GoldenAssistant, CheckpointParses) {
  const AssistantSpec& spec = GetParam();
  Checkpoint ckpt(golden_dir(spec.name));
  ASSERT_TRUE(ckpt.contains("pre_projection.weight"));
  EXPECT_EQ(ckpt.info("pre_projection.weight").shape, Shape({16, 2 * kBackbone}));
  ASSERT_TRUE(ckpt.contains("post_projection.weight"));
  EXPECT_EQ(ckpt.info("post_projection.weight").shape, Shape({kBackbone, 16}));
  ASSERT_TRUE(ckpt.contains("model.embed_tokens.weight"));
  EXPECT_EQ(ckpt.contains("masked_embedding.centroids.weight"), spec.ordered);
  if (!spec.ordered) return;
  // token_ordering is a permutation of [0, V) (transformers initialises it to zeros).
  ASSERT_TRUE(ckpt.contains("masked_embedding.token_ordering"));
  Tensor order = ckpt.get("masked_embedding.token_ordering");
  ASSERT_EQ(order.dtype(), DType::kI64);
  ASSERT_EQ(order.shape(), Shape({kVocab}));
  std::set<int64_t> seen(order.data_as<const int64_t>(), order.data_as<const int64_t>() + kVocab);
  EXPECT_EQ(seen.size(), static_cast<size_t>(kVocab));
  EXPECT_EQ(*seen.begin(), 0);
  EXPECT_EQ(*seen.rbegin(), kVocab - 1);
}

INSTANTIATE_TEST_SUITE_P(Fixtures, GoldenAssistant, ::testing::ValuesIn(assistant_specs()),
                         [](const auto& info) { return info.param.name; });

}  // namespace
}  // namespace specula::io
