// SPDX-License-Identifier: Apache-2.0
// Quantized drafters on CUDA (`specula quantize`, issue #33): the golden
// DSpark drafter (specula layout) and the golden centroid-head assistant,
// quantized to int8 and fp8 on the host, load on the GPU (scales placed with
// the codes) and greedy decoding with them equals decoding without a drafter
// (batch 1 and 8; k 1 and 4).
#include <gtest/gtest.h>

#include <unistd.h>

#include <filesystem>
#include <string>
#include <vector>

#include "engine/draft/assistant/assistant.h"
#include "engine/draft/assistant/assistant_drafter.h"
#include "engine/draft/dspark/dspark_drafter.h"
#include "engine/io/quantize.h"
#include "engine/speculative/decoder.h"
#include "tests/cuda/cuda_model_util.h"
#include "tests/cuda/cuda_test_util.h"
#include "tests/unit/speculative/sampling_test_util.h"

namespace specula {
namespace {

using test::golden;
using test::have;
using test::on_cuda;

// A fresh folder under the system's temp directory, removed on destruction.
struct TempDir {
  std::string path;
  explicit TempDir(const std::string& name)
      : path((std::filesystem::temp_directory_path() /
              ("specula_quant_cuda_" + std::to_string(getpid()) + "_" + name))
                 .string()) {
    std::filesystem::remove_all(path);
  }
  ~TempDir() { std::filesystem::remove_all(path); }
};

void expect_lossless(gemma4::Gemma4Model& target, Drafter& drafter, const std::string& what) {
  const int vocab = target.config().vocab_size;
  for (int batch : {1, 8}) {
    const auto reqs = testing::greedy_requests(batch, vocab, 16);
    const auto plain = speculative::decode(target, nullptr, reqs, {});
    test::expect_speculation_matches_plain(target, drafter, reqs, plain, {1, 4}, what);
  }
}

TEST(CudaQuantizedDrafter, DSparkInt8AndFp8AreLossless) {
  SKIP_WITHOUT_CUDA();
  if (!have("dense_kev") || !have("dspark")) GTEST_SKIP() << "fixtures missing";
  auto target = gemma4::Gemma4Model::load(golden("dense_kev"), on_cuda());
  for (DType dtype : {DType::kI8, DType::kF8E4M3}) {
    TempDir out(fmt::format("dspark_{}", dtype_name(dtype)));
    io::quantize_folder({.in_dir = golden("dspark"),
                         .out_dir = out.path,
                         .matrices = dspark::dspark_matrix_names(golden("dspark")),
                         .dtype = dtype,
                         .config_file = "dspark.json",
                         .config_field = "weight_dtype"});
    auto model = dspark::DSparkModel::load(out.path, *target, target->backend());
    dspark::DSparkDrafter drafter(*target, *model);
    expect_lossless(*target, drafter, fmt::format("dspark {}", dtype_name(dtype)));
  }
}

TEST(CudaQuantizedDrafter, AssistantInt8AndFp8AreLossless) {
  SKIP_WITHOUT_CUDA();
  if (!have("e2b_like") || !have("e2b_like_assistant")) GTEST_SKIP() << "fixtures missing";
  auto target = gemma4::Gemma4Model::load(golden("e2b_like"), on_cuda());
  const std::string in = golden("e2b_like_assistant");
  for (DType dtype : {DType::kI8, DType::kF8E4M3}) {
    TempDir out(fmt::format("assistant_{}", dtype_name(dtype)));
    io::quantize_folder({.in_dir = in,
                         .out_dir = out.path,
                         .matrices = assistant::assistant_matrix_names(in),
                         .dtype = dtype,
                         .config_file = "config.json",
                         .config_field = "specula_weight_dtype"});
    auto drafter = assistant::AssistantModel::load(out.path, target->config(), target->backend());
    assistant::AssistantDrafter source(*target, *drafter);
    expect_lossless(*target, source, fmt::format("assistant {}", dtype_name(dtype)));
  }
}

}  // namespace
}  // namespace specula
