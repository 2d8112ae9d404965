// SPDX-License-Identifier: Apache-2.0
// Weight-only quantized drafters (`specula quantize`, issue #33): fp8 e4m3
// conversions, the per-row quantizer's error bound, the CPU ops on quantized
// weights (exactly the f32 ops on the dequantized matrix), loading a
// quantized folder (bad layouts named), and lossless decoding with int8 and
// fp8 DSpark and assistant drafters.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <nlohmann/json.hpp>
#include <random>

#include "engine/backend/backends.h"
#include "engine/draft/assistant/assistant.h"
#include "engine/draft/assistant/assistant_drafter.h"
#include "engine/draft/dspark/dspark_drafter.h"
#include "engine/io/quantize.h"
#include "engine/io/weight_table.h"
#include "engine/speculative/decoder.h"
#include "tests/unit/dspark/dspark_test_util.h"
#include "tests/unit/model/golden_util.h"
#include "tests/unit/test_util.h"

namespace specula {
namespace {

using testing::error_of;

// Scratch folders under <build>/quantize_test_tmp/.
const testing::TempDirs temp_dir("quantize_test");

// A host f32 matrix of uniform values in [-1, 1) with a few rows scaled up
// and one row of zeros (the all-zero guard).
HostTensor random_matrix(int64_t rows, int64_t cols, uint32_t seed) {
  HostTensor w(DType::kF32, {rows, cols});
  std::mt19937 rng(seed);
  std::uniform_real_distribution<float> u(-1.0f, 1.0f);
  for (int64_t r = 0; r < rows; ++r) {
    const float row_scale = r == 1 ? 0.0f : (r % 3 == 0 ? 40.0f : 0.01f + r);
    for (int64_t c = 0; c < cols; ++c) w.data<float>()[r * cols + c] = u(rng) * row_scale;
  }
  return w;
}

float decode(DType dtype, uint8_t code) {
  return dtype == DType::kI8 ? static_cast<float>(static_cast<int8_t>(code)) : e4m3_to_f32(code);
}

// The f32 matrix q decodes to: decode(q[r, c]) · scale[r].
HostTensor dequantized(const io::QuantizedMatrix& q) {
  const int64_t rows = q.q.shape()[0], cols = q.q.shape()[1];
  HostTensor w(DType::kF32, {rows, cols});
  for (int64_t i = 0; i < rows * cols; ++i)
    w.data<float>()[i] =
        decode(q.q.dtype(), q.q.data<const uint8_t>()[i]) * q.scales.data<const float>()[i / cols];
  return w;
}

TEST(E4m3, DecodingThenEncodingGivesBackEveryCode) {
  for (int code = 0; code < 256; ++code) {
    const float v = e4m3_to_f32(static_cast<uint8_t>(code));
    if ((code & 0x7f) == 0x7f) {
      EXPECT_TRUE(std::isnan(v)) << code;
      continue;
    }
    const uint8_t back = f32_to_e4m3(v);
    // -0 and +0 both decode to zero; every other code is its own value's encoding.
    if (code == 0x80) {
      EXPECT_EQ(back, 0x80);
    } else {
      EXPECT_EQ(back, code) << "value " << v;
    }
  }
  EXPECT_EQ(e4m3_to_f32(0x7e), 448.0f);
  EXPECT_EQ(e4m3_to_f32(0x38), 1.0f);
  EXPECT_EQ(e4m3_to_f32(0x01), 0x1p-9f);
  EXPECT_EQ(e4m3_to_f32(0x08), 0x1p-6f);
  EXPECT_EQ(f32_to_e4m3(1000.0f), 0x7e) << "saturates";
  EXPECT_EQ(f32_to_e4m3(-1000.0f), 0xfe);
  EXPECT_EQ(f32_to_e4m3(1.0625f), 0x38) << "a tie rounds to the even mantissa (1.0)";
  EXPECT_EQ(f32_to_e4m3(1.1875f), 0x3a) << "a tie rounds to the even mantissa (1.25)";
  EXPECT_EQ(f32_to_e4m3(0x1p-11f), 0x00) << "below half the smallest subnormal";
}

TEST(QuantizeRows, Int8ErrorIsAtMostHalfAScaleStepPerRow) {
  const HostTensor w = random_matrix(7, 37, 1);
  const io::QuantizedMatrix q = io::quantize_rows(w, DType::kI8, "w");
  ASSERT_EQ(q.q.dtype(), DType::kI8);
  ASSERT_EQ(q.scales.shape(), Shape({7}));
  const HostTensor back = dequantized(q);
  for (int64_t r = 0; r < 7; ++r) {
    const float s = q.scales.data<const float>()[r];
    float amax = 0;
    for (int64_t c = 0; c < 37; ++c)
      amax = std::max(amax, std::fabs(w.data<const float>()[r * 37 + c]));
    if (amax == 0) {
      EXPECT_EQ(s, 1.0f) << "a zero row gets scale 1";
    } else {
      EXPECT_FLOAT_EQ(s, amax / 127.0f) << "row " << r;
    }
    for (int64_t c = 0; c < 37; ++c) {
      const int8_t code = q.q.data<const int8_t>()[r * 37 + c];
      EXPECT_GE(code, -127);
      const float err =
          std::fabs(w.data<const float>()[r * 37 + c] - back.data<const float>()[r * 37 + c]);
      // Half a step, plus the f32 roundings of w / s and q · s.
      EXPECT_LE(err, s * 0.5f * (1 + 1e-5f) + amax * 1e-6f) << "row " << r << " col " << c;
    }
  }
}

TEST(QuantizeRows, Fp8ErrorIsAtMostHalfAnE4m3Step) {
  const HostTensor w = random_matrix(5, 29, 2);
  const io::QuantizedMatrix q = io::quantize_rows(w, DType::kF8E4M3, "w");
  const HostTensor back = dequantized(q);
  for (int64_t r = 0; r < 5; ++r) {
    const float s = q.scales.data<const float>()[r];
    for (int64_t c = 0; c < 29; ++c) {
      const float v = w.data<const float>()[r * 29 + c];
      const float err = std::fabs(v - back.data<const float>()[r * 29 + c]);
      // e4m3 keeps 3 mantissa bits: half a step is 2^-4 of the value, or half
      // the subnormal step 2^-9 (in units of s) near zero.
      EXPECT_LE(err, std::max(std::fabs(v) * 0x1p-4f, s * 0x1p-10f) * (1 + 1e-5f))
          << "row " << r << " col " << c;
    }
  }
}

TEST(QuantizeRows, RefusesNonFiniteAndNonMatrixInputs) {
  HostTensor w = random_matrix(2, 4, 3);
  w.data<float>()[5] = NAN;
  EXPECT_NE(error_of([&] {
              io::quantize_rows(w, DType::kI8, "layers.0.q_proj");
            }).find("layers.0.q_proj"),
            std::string::npos);
  const HostTensor v(DType::kF32, {4});
  EXPECT_NE(error_of([&] { io::quantize_rows(v, DType::kI8, "norm"); }).find("rank 2"),
            std::string::npos);
  EXPECT_NE(error_of([] { io::parse_quantized_dtype("int4", "--dtype"); }).find("--dtype"),
            std::string::npos);
}

// On the CPU a quantized weight is exactly its dequantized f32 matrix: linear
// (one row and several, K odd and even) and embedding give the same bits.
TEST(QuantizedOps, CpuLinearAndEmbeddingEqualTheDequantizedF32Ops) {
  Backend& be = backend_for(Device::cpu());
  for (DType dtype : {DType::kI8, DType::kF8E4M3}) {
    for (int64_t k : {1, 37, 64, 515}) {
      const int64_t n = 19;
      const HostTensor w = random_matrix(n, k, static_cast<uint32_t>(k));
      const io::QuantizedMatrix q = io::quantize_rows(w, dtype, "w");
      const Tensor wq = q.q.view().with_scales(q.scales.data<const float>());
      const HostTensor wf = dequantized(q);
      for (int64_t m : {1, 3, 9}) {
        HostTensor x = random_matrix(m, k, 99);
        HostTensor y(DType::kF32, {m, n}), y_ref(DType::kF32, {m, n});
        be.linear(x, wq, y);
        be.linear(x, wf, y_ref);
        EXPECT_EQ(std::memcmp(y.data<float>(), y_ref.data<float>(), y.view().nbytes()), 0)
            << dtype_name(dtype) << " k " << k << " m " << m;
      }
      std::vector<int32_t> id_data = {3, 0, 18, 1, 3};
      const Tensor ids(id_data.data(), DType::kI32, {5});
      HostTensor e(DType::kF32, {5, k}), e_ref(DType::kF32, {5, k});
      be.embedding(wq, ids, 0.5f, e);
      be.embedding(wf, ids, 0.5f, e_ref);
      EXPECT_EQ(std::memcmp(e.data<float>(), e_ref.data<float>(), e.view().nbytes()), 0);
      // Rows of a quantized view keep their scales.
      HostTensor y2(DType::kF32, {1, 4}), y2_ref(DType::kF32, {1, 4});
      HostTensor x1 = random_matrix(1, k, 5);
      be.linear(x1, wq.slice_rows(10, 14), y2);
      be.linear(x1, wf.view().slice_rows(10, 14), y2_ref);
      EXPECT_EQ(std::memcmp(y2.data<float>(), y2_ref.data<float>(), y2.view().nbytes()), 0);
    }
  }
}

TEST(QuantizedOps, AQuantizedWeightWithoutScalesIsRefused) {
  Backend& be = backend_for(Device::cpu());
  HostTensor w(DType::kI8, {4, 8});
  HostTensor x(DType::kF32, {1, 8}), y(DType::kF32, {1, 4});
  const std::string e = error_of([&] { be.linear(x, w, y); });
  EXPECT_NE(e.find("linear"), std::string::npos) << e;
  EXPECT_NE(e.find("per-row scales"), std::string::npos) << e;
  std::vector<int32_t> id = {0};
  HostTensor out(DType::kF32, {1, 8});
  EXPECT_NE(error_of([&] {
              be.embedding(w, Tensor(id.data(), DType::kI32, {1}), 1.0f, out);
            }).find("per-row scales"),
            std::string::npos);
}

// Prompts of 6..20 tokens of the golden targets' vocabulary, greedy.
std::vector<speculative::DecodeRequest> greedy_requests(int n, uint32_t seed, int max_tokens) {
  std::mt19937 rng(seed);
  std::vector<speculative::DecodeRequest> reqs;
  for (int i = 0; i < n; ++i) {
    speculative::DecodeRequest r;
    const int len = std::uniform_int_distribution<int>(6, 20)(rng);
    for (int j = 0; j < len; ++j)
      r.prompt.push_back(std::uniform_int_distribution<int>(3, 127)(rng));
    r.params.temperature = 0.0f;
    r.params.max_tokens = max_tokens;
    r.params.stop_token_ids.clear();
    reqs.push_back(std::move(r));
  }
  return reqs;
}

// Greedy decoding with `drafter` equals plain decoding at k = 1..4, batch 1 and 3.
void expect_lossless(gemma4::Gemma4Model& target, Drafter& drafter, const std::string& what) {
  for (int batch : {1, 3}) {
    const auto reqs = greedy_requests(batch, 200 + static_cast<uint32_t>(batch), 12);
    const auto plain = speculative::decode(target, nullptr, reqs, {.draft_tokens = 1});
    for (int k = 1; k <= 4; ++k) {
      const auto got = speculative::decode(target, &drafter, reqs, {.draft_tokens = k});
      int64_t drafted = 0;
      for (size_t i = 0; i < reqs.size(); ++i) {
        EXPECT_EQ(got[i].tokens, plain[i].tokens)
            << what << ": batch " << batch << " k " << k << " request " << i;
        drafted += got[i].stats.drafted;
      }
      EXPECT_GT(drafted, 0) << what << ": the drafter must have drafted";
    }
  }
}

io::QuantizeFolderParams dspark_params(const std::string& in, const std::string& out, DType dtype) {
  const bool specula = dspark::load_dspark_config(in).layout == dspark::DSparkLayout::kSpecula;
  return {.in_dir = in,
          .out_dir = out,
          .matrices = dspark::dspark_matrix_names(in),
          .dtype = dtype,
          .config_file = specula ? "dspark.json" : "config.json",
          .config_field = specula ? "weight_dtype" : "specula_weight_dtype"};
}

class QuantizedDrafterTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    target_ = gemma4::Gemma4Model::load(testing::golden_dir("dense_kev")).release();
  }
  static void TearDownTestSuite() {
    delete target_;
    target_ = nullptr;
  }
  // Base logits U [γ, V] of one block after the context `seq` (its taps committed).
  static std::vector<float> block_logits(dspark::DSparkModel& model,
                                         const std::vector<int32_t>& seq) {
    const std::span<const int> taps = model.config().taps;
    const int64_t N = static_cast<int64_t>(seq.size()), H = target_->config().hidden_size;
    const auto m = static_cast<int64_t>(taps.size());
    std::vector<float> buf(static_cast<size_t>(m * N * H));
    const Tensor tap_out(buf.data(), DType::kF32, {m, N, H});
    SequenceKv kv = target_->new_sequence();
    const gemma4::ForwardRow row{.kv = &kv, .tokens = seq, .all_logits = false};
    gemma4::ForwardOptions o;
    o.tap_layers = taps;
    o.tap_out = tap_out;
    target_->forward(std::span(&row, 1), o);
    SequenceKv ctx = model.new_context();
    const dspark::ContextPiece piece{.kv = &ctx, .position = 0, .count = static_cast<int>(N)};
    model.commit_context(std::span(&piece, 1), tap_out);
    int32_t anchor = seq.back();
    SequenceKv* rows[1] = {&ctx};
    model.run_block(rows, Tensor(&anchor, DType::kI32, {1}));
    const Tensor U = model.base_logits();
    return std::vector<float>(U.data_as<const float>(), U.data_as<const float>() + U.numel());
  }
  static inline gemma4::Gemma4Model* target_ = nullptr;
};

// A random specula-layout drafter, saved, quantized to int8 and fp8: the
// folder loads, its block logits stay close to the original's (and are not
// the original's: the quantized weights are used), and decoding is lossless.
TEST_F(QuantizedDrafterTest, QuantizedDSparkDrafterLoadsStaysCloseAndIsLossless) {
  const std::string dir = temp_dir("dspark_f32");
  dspark::DSparkModel::random(testing::small_specula_dspark(target_->config(), 4), *target_,
                              target_->backend(), 5, DType::kF32)
      ->save(dir);
  auto original = dspark::DSparkModel::load(dir, *target_, target_->backend());
  const std::vector<int32_t> seq = {5, 17, 3, 99, 42, 8, 61, 7, 23};
  const std::vector<float> want = block_logits(*original, seq);
  float want_max = 0;
  for (float v : want) want_max = std::max(want_max, std::fabs(v));
  for (DType dtype : {DType::kI8, DType::kF8E4M3}) {
    const std::string out = temp_dir(fmt::format("dspark_{}", dtype_name(dtype)));
    const auto stats = io::quantize_folder(dspark_params(dir, out, dtype));
    int quantized = 0;
    for (const auto& s : stats) quantized += s.to == dtype ? 1 : 0;
    // 2 layers × 7 matrices, context/token/out projections, Markov W1/W2.
    EXPECT_EQ(quantized, 2 * 7 + 3 + 2);
    const nlohmann::json j = nlohmann::json::parse(std::ifstream(out + "/dspark.json"));
    EXPECT_EQ(j.at("weight_dtype"), io::quantized_dtype_label(dtype));

    auto model = dspark::DSparkModel::load(out, *target_, target_->backend());
    EXPECT_LT(model->weight_bytes(), original->weight_bytes() / 2);
    const std::vector<float> got = block_logits(*model, seq);
    ASSERT_EQ(got.size(), want.size());
    float max_err = 0;
    for (size_t i = 0; i < got.size(); ++i)
      max_err = std::max(max_err, std::fabs(got[i] - want[i]));
    EXPECT_GT(max_err, 0.0f) << "the quantized weights must be the ones used";
    // Measured: 0.024 (int8), 0.083 (fp8) for this seed.
    EXPECT_LT(max_err / want_max, dtype == DType::kI8 ? 0.05f : 0.2f) << dtype_name(dtype);

    dspark::DSparkDrafter drafter(*target_, *model);
    expect_lossless(*target_, drafter, fmt::format("dspark {}", dtype_name(dtype)));
  }
}

// Random drafters of a quantized dtype (bench --draft-dtype): the bf16
// values' matrices quantized in place on the backend; lossless, and smaller.
TEST_F(QuantizedDrafterTest, RandomQuantizedDSparkDraftersAreLosslessAndSmaller) {
  for (dspark::DSparkLayout layout :
       {dspark::DSparkLayout::kSpecula, dspark::DSparkLayout::kDeepSpec}) {
    const dspark::DSparkConfig c = testing::small_dspark(layout, target_->config(), 4);
    auto bf16 = dspark::DSparkModel::random(c, *target_, target_->backend(), 3, DType::kBF16);
    for (DType dtype : {DType::kI8, DType::kF8E4M3}) {
      auto model = dspark::DSparkModel::random(c, *target_, target_->backend(), 3, dtype);
      EXPECT_LT(model->weight_bytes(), bf16->weight_bytes());
      dspark::DSparkDrafter drafter(*target_, *model);
      expect_lossless(*target_, drafter,
                      fmt::format("random {} {}", testing::layout_name(layout), dtype_name(dtype)));
    }
  }
}

// The golden DeepSpec-layout folder (config.json, own embedding and head)
// quantizes and decodes losslessly.
TEST_F(QuantizedDrafterTest, QuantizedDeepSpecFolderIsLossless) {
  const std::string out = temp_dir("deepspec_i8");
  io::quantize_folder(dspark_params(testing::golden_dir("dspark_deepspec"), out, DType::kI8));
  const nlohmann::json j = nlohmann::json::parse(std::ifstream(out + "/config.json"));
  EXPECT_EQ(j.at("specula_weight_dtype"), "int8");
  EXPECT_EQ(j.at("architectures"), nlohmann::json::array({"Gemma4DSparkModel"}));
  auto model = dspark::DSparkModel::load(out, *target_, target_->backend());
  dspark::DSparkDrafter drafter(*target_, *model);
  expect_lossless(*target_, drafter, "deepspec int8");
}

// The golden assistants (centroid head: quantized centroids and embedding;
// dense tied head) quantized to int8 decode losslessly.
TEST(QuantizedAssistant, QuantizedAssistantDraftersAreLossless) {
  if (!testing::golden_exists("e2b_like")) GTEST_SKIP() << "no e2b_like fixture";
  auto target = gemma4::Gemma4Model::load(testing::golden_dir("e2b_like"));
  for (const char* name : {"e2b_like_assistant", "e2b_like_assistant_dense"}) {
    const std::string in = testing::golden_dir(name);
    const std::string out = temp_dir(std::string(name) + "_i8");
    io::quantize_folder({.in_dir = in,
                         .out_dir = out,
                         .matrices = assistant::assistant_matrix_names(in),
                         .dtype = DType::kI8,
                         .config_file = "config.json",
                         .config_field = "specula_weight_dtype"});
    auto drafter = assistant::AssistantModel::load(out, target->config(), target->backend());
    assistant::AssistantDrafter source(*target, *drafter);
    expect_lossless(*target, source, name);
  }
}

// Bad folders: a missing or mis-typed scale is named by the loader; a folder
// already quantized, or an --out that is not empty, is refused by the quantizer.
TEST_F(QuantizedDrafterTest, BadQuantizedFoldersAreNamed) {
  const std::string dir = temp_dir("bad_f32");
  dspark::DSparkModel::random(testing::small_specula_dspark(target_->config(), 4), *target_,
                              target_->backend(), 9, DType::kF32)
      ->save(dir);
  const std::string q = temp_dir("bad_i8");
  io::quantize_folder(dspark_params(dir, q, DType::kI8));

  // Quantizing again: refused by the config's field, then (field removed) by the dtypes.
  std::string e =
      error_of([&] { io::quantize_folder(dspark_params(q, temp_dir("again"), DType::kI8)); });
  EXPECT_NE(e.find("already"), std::string::npos) << e;
  nlohmann::json j = nlohmann::json::parse(std::ifstream(q + "/dspark.json"));
  j.erase("weight_dtype");
  std::ofstream(q + "/dspark.json") << j.dump(2);
  e = error_of([&] { io::quantize_folder(dspark_params(q, temp_dir("again2"), DType::kI8)); });
  EXPECT_NE(e.find("already quantized"), std::string::npos) << e;
  EXPECT_NE(error_of([&] {
              io::quantize_folder(dspark_params(dir, q, DType::kI8));
            }).find("not an empty folder"),
            std::string::npos);

  // Rewrite the quantized weights: layers.0.q_proj.scale dropped, layers.1.k_proj.scale as bf16.
  auto rewrite = [&](const std::string& out_dir,
                     const std::function<bool(io::NamedTensor&)>& edit) {
    std::filesystem::copy(q, out_dir, std::filesystem::copy_options::recursive);
    io::SafetensorsFile in(q + "/model.safetensors");
    std::vector<io::NamedTensor> tensors;
    for (const io::TensorInfo& info : in.tensors()) {
      io::NamedTensor t{info.name, in.get(info.name)};
      if (edit(t)) tensors.push_back(t);
    }
    io::write_safetensors(out_dir + "/model.safetensors", tensors);
  };
  const std::string missing = temp_dir("missing_scale");
  std::filesystem::remove_all(missing);
  rewrite(missing, [](io::NamedTensor& t) { return t.name != "layers.0.q_proj.scale"; });
  e = error_of([&] { dspark::DSparkModel::load(missing, *target_, target_->backend()); });
  EXPECT_NE(e.find("missing: layers.0.q_proj.scale"), std::string::npos) << e;
  EXPECT_NE(e.find("i8 layers.0.q_proj"), std::string::npos) << e;

  const std::string wrong = temp_dir("wrong_scale");
  std::filesystem::remove_all(wrong);
  std::vector<uint16_t> half(32, 0x3f80);
  rewrite(wrong, [&](io::NamedTensor& t) {
    if (t.name == "layers.1.k_proj.scale") t.tensor = Tensor(half.data(), DType::kBF16, {32});
    return true;
  });
  e = error_of([&] { dspark::DSparkModel::load(wrong, *target_, target_->backend()); });
  EXPECT_NE(e.find("layers.1.k_proj.scale: expected f32[32], got bf16[32]"), std::string::npos)
      << e;

  // A quantized tensor where the table wants a float one (a norm) is refused by dtype.
  const std::string norm = temp_dir("quantized_norm");
  std::filesystem::remove_all(norm);
  std::vector<int8_t> codes(32, 1);
  rewrite(norm, [&](io::NamedTensor& t) {
    if (t.name == "out_norm") t.tensor = Tensor(codes.data(), DType::kI8, {32});
    return true;
  });
  e = error_of([&] { dspark::DSparkModel::load(norm, *target_, target_->backend()); });
  EXPECT_NE(e.find("out_norm: dtype i8 not accepted"), std::string::npos) << e;
}

}  // namespace
}  // namespace specula
