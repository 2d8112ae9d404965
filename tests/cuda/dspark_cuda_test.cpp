// SPDX-License-Identifier: Apache-2.0
// The DSpark drafter on CUDA (docs/dspark.md): golden parity with PyTorch for
// both fixtures (the CPU test's check, dspark_golden_check.h); a random
// drafter of either layout on CUDA against the same weights on the CPU
// (context commits, the block's base logits, head steps' logits and
// confidences); greedy decoding through the engine identical with and without
// the drafter (k 1, 4, γ; batch 1, 8, 32; with and without pruning); and
// steady-state rounds that allocate no device memory.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <string>
#include <vector>

#include "engine/draft/dspark/dspark_drafter.h"
#include "engine/speculative/decoder.h"
#include "tests/cuda/cuda_model_util.h"
#include "tests/cuda/cuda_test_util.h"
#include "tests/unit/dspark/dspark_engine_check.h"
#include "tests/unit/dspark/dspark_golden_check.h"
#include "tests/unit/dspark/dspark_test_util.h"
#include "tests/unit/model/golden_util.h"
#include "tests/unit/speculative/sampling_test_util.h"

namespace specula {
namespace {

using dspark::DSparkDrafter;
using dspark::DSparkLayout;
using dspark::DSparkModel;
using test::golden;
using test::have;
using test::on_cuda;

// The CPU reference and CUDA agree within this (max |Δ| / max |ref|, f32 weights).
constexpr double kCrossBackendTolerance = 1e-5;

TEST(CudaDSparkGolden, SpeculaLayoutMatchesPyTorch) {
  SKIP_WITHOUT_CUDA();
  testing::check_dspark_fixture("dspark", on_cuda());
}

TEST(CudaDSparkGolden, DeepSpecLayoutMatchesDeepSpec) {
  SKIP_WITHOUT_CUDA();
  testing::check_dspark_fixture("dspark_deepspec", on_cuda());
}

class CudaDSpark : public ::testing::TestWithParam<DSparkLayout> {};

std::string layout_param_name(const ::testing::TestParamInfo<DSparkLayout>& info) {
  return testing::layout_name(info.param);
}

// The same random drafter (f32 weights: fill_uniform is exact across
// backends) on the CPU and on CUDA, fed the same taps (the CPU target's, also
// uploaded to the GPU): three rows of different context lengths committed in
// two batched pieces each, then the block and every head step, the later steps
// on a subset of the rows.
TEST_P(CudaDSpark, RandomDrafterMatchesTheCpu) {
  SKIP_WITHOUT_CUDA();
  if (!have("dense_kev")) GTEST_SKIP() << "dense_kev missing";
  const DSparkLayout layout = GetParam();
  constexpr int kGamma = 5;
  auto cpu_target = gemma4::Gemma4Model::load(golden("dense_kev"));
  auto gpu_target = gemma4::Gemma4Model::load(golden("dense_kev"), on_cuda());
  const gemma4::Gemma4Config& tc = cpu_target->config();
  const dspark::DSparkConfig config = testing::small_dspark(layout, tc, kGamma);
  auto cpu = DSparkModel::random(config, *cpu_target, cpu_target->backend(), 31, DType::kF32);
  auto gpu = DSparkModel::random(config, *gpu_target, gpu_target->backend(), 31, DType::kF32);
  Backend& gb = gpu_target->backend();
  const int64_t V = tc.vocab_size, H = tc.hidden_size;
  const auto m = static_cast<int64_t>(config.taps.size());

  // Taps of one sequence from the CPU target, on both sides.
  std::vector<int32_t> seq;
  for (int i = 0; i < 40; ++i) seq.push_back(3 + (i * 37 + 11) % static_cast<int>(V - 3));
  const auto N = static_cast<int64_t>(seq.size());
  HostTensor cpu_taps(DType::kF32, {m, N, H});
  {
    SequenceKv kv = cpu_target->new_sequence();
    const gemma4::ForwardRow row{.kv = &kv, .tokens = seq, .all_logits = false};
    gemma4::ForwardOptions o;
    o.tap_layers = config.taps;
    o.tap_out = cpu_taps.view();
    cpu_target->forward(std::span(&row, 1), o);
  }
  DeviceBuffer gpu_tap_buf(gb, cpu_taps.view().nbytes());
  const Tensor gpu_taps = gpu_tap_buf.view(DType::kF32, {m, N, H});
  gb.upload(cpu_taps.view().data(), gpu_taps);

  // Rows of context lengths 11, 20 and 33, each committed in two pieces.
  const int64_t lengths[3] = {11, 20, 33}, first[3] = {7, 13, 1};
  std::vector<SequenceKv> cpu_ctx, gpu_ctx;
  for (int b = 0; b < 3; ++b) {
    cpu_ctx.push_back(cpu->new_context());
    gpu_ctx.push_back(gpu->new_context());
  }
  for (int piece = 0; piece < 2; ++piece) {
    for (bool on_gpu : {false, true}) {
      std::vector<dspark::ContextPiece> pieces;
      for (int b = 0; b < 3; ++b) {
        const int64_t from = piece == 0 ? 0 : first[b], to = piece == 0 ? first[b] : lengths[b];
        pieces.push_back({.kv = &(on_gpu ? gpu_ctx : cpu_ctx)[static_cast<size_t>(b)],
                          .position = from,
                          .count = static_cast<int>(to - from),
                          .tap_row = from});
      }
      (on_gpu ? gpu : cpu)->commit_context(pieces, on_gpu ? gpu_taps : cpu_taps.view());
    }
  }

  // The block: anchors are each row's next token.
  const std::vector<int32_t> anchors = {seq[11], seq[20], seq[33]};
  DeviceBuffer gpu_io(gb, 64 * sizeof(int32_t));
  const Tensor gpu_tokens = gpu_io.view(DType::kI32, {3});
  gb.upload(anchors.data(), gpu_tokens);
  std::vector<int32_t> cpu_anchor_buf = anchors;
  SequenceKv* cpu_rows[3] = {&cpu_ctx[0], &cpu_ctx[1], &cpu_ctx[2]};
  SequenceKv* gpu_rows[3] = {&gpu_ctx[0], &gpu_ctx[1], &gpu_ctx[2]};
  cpu->run_block(cpu_rows, Tensor(cpu_anchor_buf.data(), DType::kI32, {3}));
  gpu->run_block(gpu_rows, gpu_tokens);
  const auto pull = [&](const Tensor& t) {
    HostTensor h(t.dtype(), t.shape());
    gb.download(t, h.view().data());
    return h;
  };
  test::expect_close(pull(gpu->base_logits()).view(), cpu->base_logits(), kCrossBackendTolerance,
                     "base logits U");
  test::expect_close(pull(gpu->block_hidden()).view(), cpu->block_hidden(), kCrossBackendTolerance,
                     "block hidden h");

  // Head steps: all rows at k = 0 and 1, rows {0, 2} at k = 2, row 2 after that;
  // each row extends the CPU's greedy draft (the same tokens on both sides).
  std::vector<int32_t> prev = anchors;
  std::vector<float> cpu_conf(3);
  const Tensor gpu_conf(static_cast<float*>(gpu_io.data()) + 32, DType::kF32, {3}, gb.device());
  for (int k = 0; k < kGamma; ++k) {
    std::vector<int> rows =
        k < 2 ? std::vector<int>{0, 1, 2} : (k == 2 ? std::vector<int>{0, 2} : std::vector<int>{2});
    const auto Bk = static_cast<int64_t>(rows.size());
    std::vector<int32_t> u_rows, prev_k;
    for (int b : rows) {
      u_rows.push_back(b * kGamma + k);
      prev_k.push_back(prev[static_cast<size_t>(b)]);
    }
    const Tensor gpu_prev = gpu_io.view(DType::kI32, {Bk});
    gb.upload(prev_k.data(), gpu_prev);
    const Tensor want = cpu->head_step(k, u_rows, Tensor(prev_k.data(), DType::kI32, {Bk}),
                                       Tensor(cpu_conf.data(), DType::kF32, {Bk}));
    const Tensor got_dev = gpu->head_step(k, u_rows, gpu_prev, gpu_conf.slice_rows(0, Bk));
    const std::string what = "head step " + std::to_string(k);
    test::expect_close(pull(got_dev).view(), want, kCrossBackendTolerance, what.c_str());
    std::vector<float> got_conf(static_cast<size_t>(Bk));
    gb.download(gpu_conf.slice_rows(0, Bk), got_conf.data());
    for (int64_t i = 0; i < Bk; ++i) {
      const double w = cpu_conf[static_cast<size_t>(i)], g = got_conf[static_cast<size_t>(i)];
      EXPECT_LE(std::fabs(g - w), kCrossBackendTolerance * std::max(1.0, std::fabs(w)))
          << what << " row " << rows[static_cast<size_t>(i)] << ": confidence logit " << g << " vs "
          << w;
    }
    const float* l = want.data_as<const float>();
    for (int64_t i = 0; i < Bk; ++i) {
      prev[static_cast<size_t>(rows[static_cast<size_t>(i)])] =
          static_cast<int32_t>(std::max_element(l + i * V, l + (i + 1) * V) - (l + i * V));
    }
  }
}

// Greedy output through the engine on CUDA (device rounds) equals plain
// decoding, with the drafter at k = 1, 4 and γ, batch 1, 8 and 32, without and
// with confidence pruning (which must cut some drafts).
TEST_P(CudaDSpark, GreedyOutputIdenticalWithAndWithoutDrafter) {
  SKIP_WITHOUT_CUDA();
  if (!have("dense_kev")) GTEST_SKIP() << "dense_kev missing";
  const DSparkLayout layout = GetParam();
  const int gamma = layout == DSparkLayout::kSpecula ? 6 : 5;
  auto target = gemma4::Gemma4Model::load(golden("dense_kev"), on_cuda());
  auto model = DSparkModel::random(testing::small_dspark(layout, target->config(), gamma), *target,
                                   target->backend(), 13, DType::kBF16);
  DSparkDrafter drafter(*target, *model);
  const int vocab = target->config().vocab_size;
  int64_t pruned = 0;
  for (int batch : {1, 8, 32}) {
    const auto reqs = testing::greedy_requests(batch, vocab, 24);
    const auto plain = speculative::decode(*target, nullptr, reqs, {});
    for (bool prune : {false, true}) {
      drafter.set_thresholds(prune ? std::vector<float>(static_cast<size_t>(gamma), 0.5f)
                                   : std::vector<float>());
      for (int k : {1, 4, gamma}) {
        const auto got = speculative::decode(*target, &drafter, reqs, {.draft_tokens = k});
        for (size_t i = 0; i < reqs.size(); ++i) {
          ASSERT_EQ(got[i].tokens, plain[i].tokens)
              << "batch " << batch << " k " << k << (prune ? " pruned" : "") << " row " << i;
          if (prune) {
            pruned += got[i].stats.pruned;
          } else {
            EXPECT_EQ(got[i].stats.pruned, 0);
          }
        }
        EXPECT_EQ(drafter.live_sequences(), 0) << "every sequence released";
      }
    }
  }
  EXPECT_GT(pruned, 0) << "the thresholds never cut a block";
}

// After warm-up, DSpark rounds on CUDA (device rounds and host rounds, greedy
// and sampled rows, with and without pruning) allocate no device memory.
TEST_P(CudaDSpark, SteadyRoundsDoNotAllocateDeviceMemory) {
  SKIP_WITHOUT_CUDA();
  if (!have("dense_kev")) GTEST_SKIP() << "dense_kev missing";
  const DSparkLayout layout = GetParam();
  constexpr int kGamma = 5;
  auto target = gemma4::Gemma4Model::load(golden("dense_kev"), on_cuda());
  auto model = DSparkModel::random(testing::small_dspark(layout, target->config(), kGamma), *target,
                                   target->backend(), 17, DType::kBF16);
  DSparkDrafter drafter(*target, *model);
  for (bool prune : {false, true}) {
    drafter.set_thresholds(prune ? std::vector<float>(kGamma, 0.5f) : std::vector<float>());
    for (bool host : {false, true}) {
      const int64_t n = testing::dspark_steady_allocations(
          *target, drafter, *model, {.rows = 4, .draft_tokens = kGamma, .host_rounds = host});
      EXPECT_EQ(n, 0) << "device allocations in steady-state rounds" << (prune ? ", pruned" : "")
                      << (host ? ", host rounds" : ", device rounds");
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Layouts, CudaDSpark,
                         ::testing::Values(DSparkLayout::kSpecula, DSparkLayout::kDeepSpec),
                         layout_param_name);

}  // namespace
}  // namespace specula
