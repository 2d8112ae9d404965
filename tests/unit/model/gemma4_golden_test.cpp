// SPDX-License-Identifier: Apache-2.0
// Parity of the CPU Gemma 4 forward with Hugging Face transformers, on the
// fixtures of tests/golden (made by tools/golden/make_golden.py).
#include <gtest/gtest.h>

#include <unistd.h>

#include <cstring>
#include <filesystem>
#include <limits>

#include "engine/io/safetensors.h"
#include "engine/model/gemma4/gemma4.h"
#include "engine/speculative/decoder.h"
#include "tests/unit/model/golden_util.h"

namespace specula {
namespace {

using gemma4::ForwardOptions;
using gemma4::ForwardRow;
using gemma4::Gemma4Model;
using testing::golden_dir;
using testing::relative_error;
using testing::to_ids;

constexpr double kF32Tolerance = 1e-4;

class Gemma4Golden : public ::testing::TestWithParam<std::string> {
 protected:
  void SetUp() override {
    if (!testing::golden_exists(GetParam()))
      GTEST_SKIP() << "fixture " << GetParam() << " not generated";
    model_ = Gemma4Model::load(golden_dir(GetParam()));
    expected_ =
        std::make_unique<io::SafetensorsFile>(golden_dir(GetParam()) + "/expected.safetensors");
  }
  Tensor expected(const std::string& name) const { return expected_->get(name); }

  std::unique_ptr<Gemma4Model> model_;
  std::unique_ptr<io::SafetensorsFile> expected_;
};

// [kv, T, D] (HF) view of an engine [T, kv, D] tensor, compared element-wise.
double donor_error(const Tensor& engine, const Tensor& hf) {
  const int64_t T = engine.dim(0), KV = engine.dim(1), D = engine.dim(2);
  EXPECT_EQ(hf.shape(), Shape({KV, T, D}));
  HostTensor t(DType::kF32, {KV, T, D});
  for (int64_t i = 0; i < T; ++i)
    for (int64_t h = 0; h < KV; ++h)
      std::memcpy(t.data<float>() + (h * T + i) * D,
                  engine.data_as<const float>() + (i * KV + h) * D, static_cast<size_t>(D) * 4);
  return relative_error(t, hf);
}

TEST_P(Gemma4Golden, PrefillMatchesTransformers) {
  const std::vector<int32_t> ids = to_ids(expected("input_ids"));
  SequenceKv kv = model_->new_sequence();
  ForwardRow row{.kv = &kv, .tokens = ids, .all_logits = true};
  ForwardOptions options{
      .compute_logits = true, .capture_layer_hidden = true, .capture_donor_kv = true};
  const auto& out = model_->forward(std::span(&row, 1), options);

  double worst = 0;
  const int L = model_->config().num_hidden_layers;
  ASSERT_EQ(out.layer_hidden.size(), static_cast<size_t>(L + 1));
  for (int i = 0; i <= L; ++i) {
    const double err = relative_error(out.layer_hidden[static_cast<size_t>(i)],
                                      expected(fmt::format("hidden_states.{}", i)));
    EXPECT_LT(err, kF32Tolerance) << "hidden_states." << i;
    worst = std::max(worst, err);
  }
  const double logit_err = relative_error(out.logits, expected("logits"));
  EXPECT_LT(logit_err, kF32Tolerance);
  worst = std::max(worst, logit_err);
  for (const char* type : {"sliding_attention", "full_attention"}) {
    const auto& donor =
        std::string(type) == "sliding_attention" ? out.sliding_donor : out.full_donor;
    const std::string name = fmt::format("shared_kv.{}.k", type);
    if (!expected_->contains(name)) continue;
    ASSERT_TRUE(donor.has_value()) << type;
    EXPECT_LT(donor_error(donor->k, expected(name)), kF32Tolerance) << name;
    EXPECT_LT(donor_error(donor->v, expected(fmt::format("shared_kv.{}.v", type))), kF32Tolerance)
        << type;
  }
  RecordProperty("worst_relative_error", fmt::format("{:.3g}", worst));
  std::printf("[ parity ] %s worst relative error %.3g (logits %.3g)\n", GetParam().c_str(), worst,
              logit_err);
}

TEST_P(Gemma4Golden, GreedyGenerationMatchesTransformers) {
  const std::vector<int32_t> ids = to_ids(expected("input_ids"));
  const std::vector<int32_t> want = to_ids(expected("generate_ids"));
  speculative::DecodeRequest request{.prompt = ids};
  request.params.temperature = 0;
  request.params.max_tokens = static_cast<int>(want.size() - ids.size());
  const auto got = speculative::decode(*model_, nullptr, std::span(&request, 1), {});
  std::vector<int32_t> full = ids;
  full.insert(full.end(), got[0].tokens.begin(), got[0].tokens.end());
  EXPECT_EQ(full, want);
}

// An f32 checkpoint never takes a backend's fast (bf16/TF32) prefill path;
// the bf16 fixture does (Gemma4Model::fast_prefill(), the rule CUDA relies on
// for f32-exact generation: tests/cuda/golden_generation_cuda_test.cpp).
TEST_P(Gemma4Golden, OnlyBf16CheckpointsTakeTheFastPrefillPath) {
  EXPECT_FALSE(model_->fast_prefill()) << GetParam();
  if (!testing::golden_exists("e2b_like_bf16")) GTEST_SKIP() << "e2b_like_bf16 not generated";
  EXPECT_TRUE(Gemma4Model::load(golden_dir("e2b_like_bf16"))->fast_prefill());
}

TEST_P(Gemma4Golden, BatchedRowsEqualRowsAlone) {
  const std::vector<int32_t> a = to_ids(expected("input_ids"));
  const std::vector<int32_t> b = to_ids(expected("input_ids_b"));
  // Prefill both rows in one forward: each row's logits match its own golden.
  SequenceKv kv_a = model_->new_sequence(), kv_b = model_->new_sequence();
  ForwardRow rows[] = {{.kv = &kv_a, .tokens = a, .all_logits = true},
                       {.kv = &kv_b, .tokens = b, .all_logits = true}};
  const auto& prefill = model_->forward(rows);
  HostTensor batch_logits(DType::kF32,
                          prefill.logits.shape());  // outputs are overwritten by the next forward
  std::memcpy(batch_logits.data<float>(), prefill.logits.data(), prefill.logits.nbytes());
  const Tensor& out_logits = batch_logits.view();
  const int64_t na = static_cast<int64_t>(a.size());
  EXPECT_LT(relative_error(out_logits.slice_rows(0, na), expected("logits")), kF32Tolerance);
  EXPECT_LT(relative_error(out_logits.slice_rows(na, na + static_cast<int64_t>(b.size())),
                           expected("logits_b")),
            kF32Tolerance);

  // Decode both rows (now at different positions) together for 12 steps, and
  // compare with each row decoded alone: tokens identical, logits within 1e-5.
  SequenceKv solo_a = model_->new_sequence(), solo_b = model_->new_sequence();
  ForwardRow sa{.kv = &solo_a, .tokens = a}, sb{.kv = &solo_b, .tokens = b};
  std::vector<float> la, lb;
  auto argmax = [](const Tensor& logits) {
    auto v = logits.f32();
    return static_cast<int32_t>(std::max_element(v.begin(), v.end()) - v.begin());
  };
  int32_t next_a = argmax(model_->forward(std::span(&sa, 1)).logits);
  int32_t next_b = argmax(model_->forward(std::span(&sb, 1)).logits);
  int32_t batch_a = argmax(out_logits.slice_rows(na - 1, na));
  int32_t batch_b = argmax(out_logits.slice_rows(out_logits.dim(0) - 1, out_logits.dim(0)));
  for (int step = 0; step < 12; ++step) {
    ASSERT_EQ(batch_a, next_a) << "step " << step;
    ASSERT_EQ(batch_b, next_b) << "step " << step;
    ForwardRow both[] = {{.kv = &kv_a, .tokens = std::span(&batch_a, 1)},
                         {.kv = &kv_b, .tokens = std::span(&batch_b, 1)}};
    const auto& bo = model_->forward(both);
    HostTensor batched(DType::kF32, bo.logits.shape());
    std::memcpy(batched.data<float>(), bo.logits.data(), bo.logits.nbytes());
    ForwardRow ra{.kv = &solo_a, .tokens = std::span(&next_a, 1)};
    const auto& oa = model_->forward(std::span(&ra, 1));
    EXPECT_LT(relative_error(batched.view().slice_rows(0, 1), oa.logits), 1e-5);
    next_a = argmax(oa.logits);
    ForwardRow rb{.kv = &solo_b, .tokens = std::span(&next_b, 1)};
    const auto& ob = model_->forward(std::span(&rb, 1));
    EXPECT_LT(relative_error(batched.view().slice_rows(1, 2), ob.logits), 1e-5);
    next_b = argmax(ob.logits);
    batch_a = argmax(batched.view().slice_rows(0, 1));
    batch_b = argmax(batched.view().slice_rows(1, 2));
  }
}

TEST_P(Gemma4Golden, RollbackThenRedecodeEqualsNeverDecoding) {
  // Decode past the sliding window, append 5 junk tokens as one verify-like
  // chunk, roll them back, and check the next logits equal a clean run's.
  const std::vector<int32_t> ids = to_ids(expected("input_ids"));
  const std::vector<int32_t> want = to_ids(expected("generate_ids"));
  const size_t prefix = ids.size() + 6;
  std::vector<int32_t> context(want.begin(), want.begin() + static_cast<std::ptrdiff_t>(prefix));

  SequenceKv clean = model_->new_sequence();
  ForwardRow rc{.kv = &clean, .tokens = context};
  const auto& clean_out = model_->forward(std::span(&rc, 1));
  HostTensor clean_logits(DType::kF32, clean_out.logits.shape());
  std::memcpy(clean_logits.data<float>(), clean_out.logits.data(), clean_out.logits.nbytes());

  SequenceKv kv = model_->new_sequence();
  std::vector<int32_t> head(context.begin(), context.end() - 1);
  ForwardRow r1{.kv = &kv, .tokens = head};
  model_->forward(std::span(&r1, 1));
  const std::vector<int32_t> junk = {5, 9, 11, 7, 3};
  ForwardRow r2{.kv = &kv, .tokens = junk, .all_logits = true};
  model_->forward(std::span(&r2, 1));
  kv.truncate(static_cast<int64_t>(head.size()));
  ForwardRow r3{.kv = &kv, .tokens = std::span(&context.back(), 1)};
  const auto& out = model_->forward(std::span(&r3, 1));
  EXPECT_LT(relative_error(out.logits, clean_logits), 1e-5);
}

INSTANTIATE_TEST_SUITE_P(Fixtures, Gemma4Golden, ::testing::Values("e2b_like", "dense_kev", "moe"));

TEST(Gemma4GoldenBf16, Bf16CheckpointMatchesTransformersBf16) {
  const std::string name = "e2b_like_bf16";
  if (!testing::golden_exists(name)) GTEST_SKIP() << "fixture " << name << " not generated";
  auto model = Gemma4Model::load(golden_dir(name));
  EXPECT_EQ(model->config().hidden_size, 32);
  io::SafetensorsFile expected(golden_dir(name) + "/expected.safetensors");
  const std::vector<int32_t> ids = to_ids(expected.get("input_ids"));
  SequenceKv kv = model->new_sequence();
  ForwardRow row{.kv = &kv, .tokens = ids, .all_logits = true};
  const auto& out = model->forward(std::span(&row, 1));
  // transformers computes in bf16, we compute in f32 from the same bf16 weights:
  // the two differ by ~0.1 relative on this model (tests/golden/README.md).
  HostTensor want(DType::kF32, out.logits.shape());
  Tensor e = expected.get("logits");
  if (e.dtype() == DType::kBF16) {
    for (int64_t i = 0; i < e.numel(); ++i)
      want.data<float>()[i] = bf16_to_f32(e.data_as<const uint16_t>()[i]);
  } else {
    std::memcpy(want.data<float>(), e.data(), e.nbytes());
  }
  const double err = relative_error(out.logits, want);
  std::printf("[ parity ] %s bf16 relative error %.3g\n", name.c_str(), err);
  EXPECT_LT(err, 0.15);
}

}  // namespace
}  // namespace specula

namespace specula {
namespace {

TEST(Gemma4Load, RejectsAnAssistantCheckpointAsTarget) {
  if (!testing::golden_exists("e2b_like_assistant")) GTEST_SKIP();
  try {
    (void)gemma4::Gemma4Model::load(testing::golden_dir("e2b_like_assistant"));
    FAIL() << "an assistant checkpoint must not load as a target";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("config.json"), std::string::npos) << e.what();
  }
}

TEST(Gemma4Load, TokenOutsideTheVocabularyIsRejectedBeforeTouchingTheCache) {
  if (!testing::golden_exists("dense_kev")) GTEST_SKIP();
  auto model = gemma4::Gemma4Model::load(testing::golden_dir("dense_kev"));
  SequenceKv kv = model->new_sequence();
  const std::vector<int32_t> bad = {5, 6, 9999};
  gemma4::ForwardRow row{.kv = &kv, .tokens = bad};
  try {
    model->forward(std::span(&row, 1));
    FAIL() << "expected an error";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("9999"), std::string::npos) << e.what();
  }
  EXPECT_EQ(kv.length(), 0);
}

// The forward checks host token ids itself, before any device op (a device
// embedding gather could not report them): the error names the row.
TEST(Gemma4Load, TheForwardNamesTheRowOfATokenOutsideTheVocabulary) {
  if (!testing::golden_exists("dense_kev")) GTEST_SKIP();
  auto model = gemma4::Gemma4Model::load(testing::golden_dir("dense_kev"));
  SequenceKv kv0 = model->new_sequence(), kv1 = model->new_sequence();
  const std::vector<int32_t> good = {5, 6}, bad = {7, -3};
  const gemma4::ForwardRow rows[] = {{.kv = &kv0, .tokens = good}, {.kv = &kv1, .tokens = bad}};
  try {
    model->forward(rows);
    FAIL() << "expected an error";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("token id -3 in row 1"), std::string::npos) << e.what();
  }
  EXPECT_EQ(kv0.length(), 0);
  EXPECT_EQ(kv1.length(), 0);
}

// A NaN in one weight (here the third layer's up_proj) used to load and decode
// silently into token 0 forever; the load refuses it, naming the tensor and
// the file, unless the scan is switched off.
TEST(Gemma4Load, ANanWeightIsRefusedAtLoadNamingTheTensorAndTheFile) {
  if (!testing::golden_exists("dense_kev")) GTEST_SKIP();
  const std::string src = testing::golden_dir("dense_kev");
  const std::filesystem::path dir =
      std::filesystem::path(::testing::TempDir()) / fmt::format("specula_nan_{}", ::getpid());
  std::filesystem::remove_all(dir);
  std::filesystem::create_directories(dir);
  std::filesystem::copy_file(src + "/config.json", dir / "config.json");
  const std::string bad_name = "model.layers.2.mlp.up_proj.weight";
  {
    const io::SafetensorsFile in(src + "/model.safetensors");
    std::vector<HostTensor> owned;
    std::vector<io::NamedTensor> named;
    owned.reserve(in.tensors().size());
    for (const io::TensorInfo& info : in.tensors()) {
      const Tensor t = in.get(info.name);
      owned.emplace_back(t.dtype(), t.shape());
      std::memcpy(owned.back().view().data(), t.data(), t.nbytes());
      if (info.name == bad_name) {
        ASSERT_EQ(t.dtype(), DType::kF32);
        owned.back().data<float>()[5] = std::numeric_limits<float>::quiet_NaN();
      }
      named.push_back({info.name, owned.back()});
    }
    io::write_safetensors((dir / "model.safetensors").string(), named);
  }
  try {
    (void)gemma4::Gemma4Model::load(dir.string());
    FAIL() << "a checkpoint with a NaN weight must not load";
  } catch (const Error& e) {
    const std::string msg = e.what();
    EXPECT_NE(msg.find((dir / "model.safetensors").string()), std::string::npos) << msg;
    EXPECT_NE(msg.find("weight " + bad_name + " (f32 "), std::string::npos) << msg;
    EXPECT_NE(msg.find("holds NaN at element 5 of"), std::string::npos) << msg;
  }
  gemma4::LoadOptions unchecked;
  unchecked.scan_weights = false;
  EXPECT_NO_THROW((void)gemma4::Gemma4Model::load(dir.string(), unchecked));
  std::filesystem::remove_all(dir);
}

TEST(Gemma4Load, PromptLongerThanTheContextIsAClearError) {
  if (!testing::golden_exists("dense_kev")) GTEST_SKIP();
  gemma4::LoadOptions options;
  options.max_context = 8;
  auto model = gemma4::Gemma4Model::load(testing::golden_dir("dense_kev"), options);
  SequenceKv kv = model->new_sequence();
  const std::vector<int32_t> long_prompt(9, 5);
  gemma4::ForwardRow row{.kv = &kv, .tokens = long_prompt};
  try {
    model->forward(std::span(&row, 1));
    FAIL() << "expected an error";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("context size of 8"), std::string::npos) << e.what();
  }
}

}  // namespace
}  // namespace specula
