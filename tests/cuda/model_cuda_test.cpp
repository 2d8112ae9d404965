// SPDX-License-Identifier: Apache-2.0
// The Gemma 4 target and the assistant drafter on CUDA: golden logits within the
// fixture's tolerance, speculation never changes greedy output (K 1..8, batch
// 1, 3, 8), rollback exactness, and no device allocation in steady state.
#include <gtest/gtest.h>

#include <filesystem>

#include "engine/draft/assistant/assistant_drafter.h"
#include "engine/io/safetensors.h"
#include "engine/model/gemma4/gemma4.h"
#include "engine/speculative/decoder.h"
#include "tests/cuda/cuda_model_util.h"
#include "tests/cuda/cuda_test_util.h"
#include "tests/unit/model/golden_util.h"
#include "tests/unit/speculative/sampling_test_util.h"

namespace specula {
namespace {

using test::golden;
using test::have;
using test::expect_speculation_matches_plain;
using test::on_cuda;

// Logit tolerances (max |Δ| / max |ref|) against transformers' f32 reference.
// f32 fixtures run the f32-weight kernels (products ≤ 256 rows are our own
// kernels in f32); the bf16 fixture carries bf16 weights and the same bound as
// on the CPU.
constexpr double kF32FixtureTolerance = 2e-4;
constexpr double kBf16FixtureTolerance = 0.15;
// The embedded family: bf16 weights, f32 activations on both sides (CPU: 2.4e-5).
constexpr double kEmbeddedTolerance = 1e-3;

std::vector<int32_t> ids_of(const Tensor& t) {
  auto s = t.i32();
  return {s.begin(), s.end()};
}

class CudaGolden : public ::testing::TestWithParam<const char*> {};

TEST_P(CudaGolden, PrefillLogitsMatchTransformers) {
  SKIP_WITHOUT_CUDA();
  const std::string name = GetParam();
  if (!have(name)) GTEST_SKIP() << name << " missing";
  auto model = gemma4::Gemma4Model::load(golden(name), on_cuda());
  io::SafetensorsFile expected(golden(name) + "/expected.safetensors");
  const std::vector<int32_t> ids = ids_of(expected.get("input_ids"));
  SequenceKv kv = model->new_sequence();
  gemma4::ForwardRow row{.kv = &kv, .tokens = ids, .all_logits = true};
  const auto& out = model->forward(std::span(&row, 1));
  ASSERT_EQ(out.logits.device(), Device::cuda(0));
  HostTensor logits(DType::kF32, out.logits.shape());
  model->backend().download(out.logits, logits.view().data());
  const Tensor want = expected.get("logits");
  ASSERT_EQ(logits.numel(), want.numel());
  const double err =
      testing::relative_error(logits.data<float>(), want.data_as<const float>(), want.numel());
  const double tol =
      name.find("bf16") != std::string::npos ? kBf16FixtureTolerance : kF32FixtureTolerance;
  std::printf("[ cuda golden ] %s logits rel err %.3g (limit %.3g)\n", name.c_str(), err, tol);
  EXPECT_LT(err, tol);
}

TEST_P(CudaGolden, RollbackThenRedecodeEqualsNeverDecoding) {
  SKIP_WITHOUT_CUDA();
  const std::string name = GetParam();
  if (!have(name)) GTEST_SKIP() << name << " missing";
  auto model = gemma4::Gemma4Model::load(golden(name), on_cuda());
  io::SafetensorsFile expected(golden(name) + "/expected.safetensors");
  std::vector<int32_t> context = ids_of(expected.get("generate_ids"));
  context.resize(std::min<size_t>(context.size(), 20));
  Backend& be = model->backend();
  const int64_t V = model->config().vocab_size;

  SequenceKv clean = model->new_sequence();
  gemma4::ForwardRow rc{.kv = &clean, .tokens = context};
  std::vector<float> clean_logits(static_cast<size_t>(V)), logits(static_cast<size_t>(V));
  be.download(model->forward(std::span(&rc, 1)).logits, clean_logits.data());

  SequenceKv kv = model->new_sequence();
  std::vector<int32_t> head(context.begin(), context.end() - 1);
  gemma4::ForwardRow r1{.kv = &kv, .tokens = head};
  model->forward(std::span(&r1, 1));
  const std::vector<int32_t> junk = {5, 9, 11, 7, 3};
  gemma4::ForwardRow r2{.kv = &kv, .tokens = junk, .all_logits = true};
  model->forward(std::span(&r2, 1));
  kv.truncate(static_cast<int64_t>(head.size()));
  gemma4::ForwardRow r3{.kv = &kv, .tokens = std::span(&context.back(), 1)};
  be.download(model->forward(std::span(&r3, 1)).logits, logits.data());
  // Prefill of `context` ran through the same kernels as head + one token only
  // up to batch invariance of ≤ 256-row products, which holds here.
  EXPECT_EQ(logits, clean_logits);
}

INSTANTIATE_TEST_SUITE_P(Fixtures, CudaGolden,
                         ::testing::Values("e2b_like", "dense_kev", "moe", "e2b_like_bf16"));

struct Pair {
  const char* target;
  const char* drafter;
};
class CudaSpeculation : public ::testing::TestWithParam<Pair> {};

using testing::greedy_requests;

TEST_P(CudaSpeculation, GreedyOutputIdenticalWithAndWithoutDrafter) {
  SKIP_WITHOUT_CUDA();
  const Pair c = GetParam();
  if (!have(c.target) || !have(c.drafter)) GTEST_SKIP() << "fixtures missing";
  auto target = gemma4::Gemma4Model::load(golden(c.target), on_cuda());
  auto drafter =
      assistant::AssistantModel::load(golden(c.drafter), target->config(), target->backend());
  assistant::AssistantDrafter source(*target, *drafter);
  const int vocab = target->config().vocab_size;
  for (int batch : {1, 3, 8}) {
    auto reqs = greedy_requests(batch, vocab, 24);
    const auto plain = speculative::decode(*target, nullptr, reqs, {});
    expect_speculation_matches_plain(*target, source, reqs, plain, {1, 2, 3, 4, 5, 6, 7, 8},
                                     c.target);
    // Uneven rows and adaptive draft lengths: later draft steps run a strict
    // subset of the rows, whose tokens and hiddens are gathered on the device.
    for (int b = 0; b < batch; ++b) reqs[static_cast<size_t>(b)].params.max_tokens = 9 + 5 * b;
    const auto plain_uneven = speculative::decode(*target, nullptr, reqs, {});
    const auto adaptive = speculative::decode(
        *target, &source, reqs, {.draft_tokens = 3, .adaptive = true, .max_draft_tokens = 8});
    for (int b = 0; b < batch; ++b) {
      ASSERT_EQ(adaptive[static_cast<size_t>(b)].tokens,
                plain_uneven[static_cast<size_t>(b)].tokens)
          << "adaptive, batch " << batch << " row " << b;
    }
  }
}

// A greedy round on the GPU reads back once (its drafts and the target's ids
// together), plus once for the prefill's first tokens, with either head.
TEST(CudaSpeculationReadbacks, GreedyRoundsReadBackOncePerRound) {
  SKIP_WITHOUT_CUDA();
  for (const char* name : {"e2b_like_assistant_dense", "e2b_like_assistant"}) {
    if (!have("e2b_like") || !have(name)) GTEST_SKIP() << "fixtures missing";
    auto target = gemma4::Gemma4Model::load(golden("e2b_like"), on_cuda());
    auto drafter =
        assistant::AssistantModel::load(golden(name), target->config(), target->backend());
    assistant::AssistantDrafter source(*target, *drafter);
    auto reqs = greedy_requests(3, target->config().vocab_size, 20);
    for (int k : {1, 3, 6}) {
      const int64_t before = target->backend().readback_count();
      const auto out = speculative::decode(*target, &source, reqs, {.draft_tokens = k});
      int64_t rounds = 0;
      for (const auto& r : out) rounds = std::max(rounds, r.stats.rounds);
      EXPECT_EQ(target->backend().readback_count() - before, 1 + rounds) << name << " k " << k;
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Fixtures, CudaSpeculation,
                         ::testing::Values(Pair{"e2b_like", "e2b_like_assistant"},
                                           Pair{"e2b_like", "e2b_like_assistant_dense"},
                                           Pair{"dense_kev", "dense_kev_assistant"}));

// The embedded family (bf16 weights, real tokenizer) on CUDA against the CPU:
// greedy ids of plain decoding agree for the first tokens (different kernels
// may break near-ties later), and speculation matches plain on CUDA.
TEST(CudaEmbedded, SpeculationMatchesPlainAndStartsLikeTheCpu) {
  SKIP_WITHOUT_CUDA();
  const std::string dir = std::string(SPECULA_SOURCE_DIR) + "/models/gemma4-tiny-py";
  if (!std::filesystem::exists(dir + "/config.json")) GTEST_SKIP();
  // f32 KV caches: the reference is transformers in f32 math (the default
  // bf16 cache of this bf16 checkpoint: tests/cuda/kv_dtype_cuda_test.cpp).
  gemma4::LoadOptions gpu_options = on_cuda(), cpu_options;
  gpu_options.kv_dtype = cpu_options.kv_dtype = DType::kF32;
  auto gpu = gemma4::Gemma4Model::load(dir, gpu_options);
  auto cpu = gemma4::Gemma4Model::load(dir, cpu_options);
  auto drafter = assistant::AssistantModel::load(dir + "-assistant", gpu->config(), gpu->backend());
  assistant::AssistantDrafter source(*gpu, *drafter);
  // Logits of golden prompt 0 against transformers (bf16 weights, f32 math).
  if (have("embedded")) {
    io::SafetensorsFile expected(golden("embedded") + "/expected.safetensors");
    const std::vector<int32_t> ids = ids_of(expected.get("input_ids.0"));
    SequenceKv kv = gpu->new_sequence();
    gemma4::ForwardRow row{.kv = &kv, .tokens = ids, .all_logits = true};
    const auto& out = gpu->forward(std::span(&row, 1));
    HostTensor logits(DType::kF32, out.logits.shape());
    gpu->backend().download(out.logits, logits.view().data());
    const Tensor want = expected.get("logits.0");
    ASSERT_EQ(logits.numel(), want.numel());
    const double err =
        testing::relative_error(logits.data<float>(), want.data_as<const float>(), want.numel());
    std::printf("[ cuda golden ] embedded logits rel err %.3g\n", err);
    EXPECT_LT(err, kEmbeddedTolerance);
  }
  auto reqs = greedy_requests(3, gpu->config().vocab_size, 32);
  const auto plain_gpu = speculative::decode(*gpu, nullptr, reqs, {});
  const auto plain_cpu = speculative::decode(*cpu, nullptr, reqs, {});
  for (size_t b = 0; b < reqs.size(); ++b) {
    ASSERT_GE(plain_gpu[b].tokens.size(), 4u);
    EXPECT_EQ(std::vector<int32_t>(plain_gpu[b].tokens.begin(), plain_gpu[b].tokens.begin() + 4),
              std::vector<int32_t>(plain_cpu[b].tokens.begin(), plain_cpu[b].tokens.begin() + 4))
        << "row " << b;
  }
  for (int k : {1, 4, 8}) {
    const auto specd = speculative::decode(*gpu, &source, reqs, {.draft_tokens = k});
    for (size_t b = 0; b < reqs.size(); ++b) EXPECT_EQ(specd[b].tokens, plain_gpu[b].tokens);
  }
}

// Recorded steps (CUDA graphs) give the same logits, bit for bit, as the same
// steps run directly: decode steps across the 64- and 128-position bounds of
// the attention launches and across sliding-ring wraps, verify windows with
// rollback, and three rows at once (separate cache stores per row).
TEST(CudaGraphs, ReplayedStepsEqualDirectSteps) {
  SKIP_WITHOUT_CUDA();
  if (!have("e2b_like")) GTEST_SKIP();
  auto model = gemma4::Gemma4Model::load(golden("e2b_like"), on_cuda());
  Backend& be = model->backend();
  ASSERT_TRUE(be.supports_graphs());
  const int vocab = model->config().vocab_size;
  // Logits of a fixed schedule of forwards: a prompt, then per step either one
  // token or a window of 5 (all logits) rolled back to 1, on `rows` rows.
  auto run = [&](bool graphs, int n_rows) {
    model->set_graphs_enabled(graphs);
    std::vector<SequenceKv> kvs;
    for (int r = 0; r < n_rows; ++r) kvs.push_back(model->new_sequence());
    std::vector<float> all;
    std::vector<std::vector<int32_t>> tokens(static_cast<size_t>(n_rows));
    std::vector<gemma4::ForwardRow> rows(static_cast<size_t>(n_rows));
    for (int step = 0; step < 200; ++step) {
      const bool window = step % 7 == 3;
      for (int r = 0; r < n_rows; ++r) {
        auto& t = tokens[static_cast<size_t>(r)];
        t.clear();
        const int n = step == 0 ? 6 + r : (window ? 5 : 1);
        for (int i = 0; i < n; ++i) t.push_back(3 + (step * 131 + r * 17 + i * 7) % (vocab - 3));
        rows[static_cast<size_t>(r)] = {
            .kv = &kvs[static_cast<size_t>(r)], .tokens = t, .all_logits = window};
      }
      const auto& out = model->forward(rows);
      const size_t at = all.size();
      all.resize(at + static_cast<size_t>(out.logits.numel()));
      be.download(out.logits, all.data() + at);
      if (window) {
        for (auto& kv : kvs) kv.truncate(kv.length() - 4);
      }
    }
    return all;
  };
  for (int n_rows : {1, 3}) {
    const int64_t replays_before = model->graph_replays();
    const std::vector<float> recorded = run(true, n_rows);
    const int64_t replays = model->graph_replays() - replays_before;
    const std::vector<float> direct = run(false, n_rows);
    ASSERT_EQ(recorded.size(), direct.size());
    EXPECT_EQ(std::memcmp(recorded.data(), direct.data(), recorded.size() * sizeof(float)), 0)
        << n_rows << " rows";
    // Every step but the first sighting of each shape (prompt, decode, window,
    // per positions bound) replays a graph.
    EXPECT_GT(replays, 170) << n_rows << " rows";
  }
  model->set_graphs_enabled(true);
}

// Draft steps (dense head, and centroid head with its device top-k) are
// recorded and replayed too: their logits equal the same steps run directly,
// bit for bit, over rounds of 4 steps while the target's cache grows (across
// positions bounds and ring wraps), for one row and for two rows.
class CudaDraftGraphs : public ::testing::TestWithParam<bool> {};

TEST_P(CudaDraftGraphs, ReplayedDraftStepsEqualDirectSteps) {
  SKIP_WITHOUT_CUDA();
  const bool centroid = GetParam();
  const char* drafter_name = centroid ? "e2b_like_assistant" : "e2b_like_assistant_dense";
  if (!have("e2b_like") || !have(drafter_name)) GTEST_SKIP();
  auto target = gemma4::Gemma4Model::load(golden("e2b_like"), on_cuda());
  auto drafter =
      assistant::AssistantModel::load(golden(drafter_name), target->config(), target->backend());
  ASSERT_EQ(drafter->centroid_head(), centroid);
  assistant::AssistantDrafter source(*target, *drafter);
  Backend& be = target->backend();
  const int vocab = target->config().vocab_size;
  const int64_t H = target->config().hidden_size;
  auto run = [&](bool graphs, int n_rows) {
    target->set_graphs_enabled(graphs);
    std::vector<SequenceKv> kvs;
    for (int r = 0; r < n_rows; ++r) kvs.push_back(target->new_sequence());
    std::vector<std::vector<int32_t>> prompts(static_cast<size_t>(n_rows));
    std::vector<gemma4::ForwardRow> rows;
    for (int r = 0; r < n_rows; ++r) {
      for (int i = 0; i < 5 + 3 * r; ++i) prompts[static_cast<size_t>(r)].push_back(3 + 11 * i + r);
      rows.push_back(
          {.kv = &kvs[static_cast<size_t>(r)], .tokens = prompts[static_cast<size_t>(r)]});
    }
    target->forward(rows);
    std::vector<float> hidden(static_cast<size_t>(n_rows * H), 0.25f);
    std::vector<float> all;
    std::vector<int32_t> next(static_cast<size_t>(n_rows));
    for (int round = 0; round < 60; ++round) {
      std::vector<DraftRow> draft_rows;
      for (int r = 0; r < n_rows; ++r) {
        draft_rows.push_back(
            {.sequence = r,
             .token = 3 + (round * 29 + r) % (vocab - 3),
             .position = static_cast<int32_t>(kvs[static_cast<size_t>(r)].length()),
             .target_kv = &kvs[static_cast<size_t>(r)],
             .target_hidden = hidden.data() + r * H});
      }
      for (int s = 0; s < 4; ++s) {
        const Tensor logits = source.step(s, draft_rows);
        const size_t at = all.size();
        all.resize(at + static_cast<size_t>(logits.numel()));
        be.download(logits, all.data() + at);
      }
      // The target takes one token per row.
      for (int r = 0; r < n_rows; ++r) {
        next[static_cast<size_t>(r)] = 3 + (round * 7 + r) % (vocab - 3);
        rows[static_cast<size_t>(r)] = {.kv = &kvs[static_cast<size_t>(r)],
                                        .tokens = std::span(&next[static_cast<size_t>(r)], 1)};
      }
      target->forward(rows);
    }
    return all;
  };
  for (int n_rows : {1, 2}) {
    const int64_t readbacks_before = be.readback_count();
    const std::vector<float> recorded = run(true, n_rows);
    // One readback per draft step: the test's own download of the logits.
    EXPECT_EQ(be.readback_count() - readbacks_before, 60 * 4) << n_rows << " rows";
    const std::vector<float> direct = run(false, n_rows);
    ASSERT_EQ(recorded.size(), direct.size());
    EXPECT_EQ(std::memcmp(recorded.data(), direct.data(), recorded.size() * sizeof(float)), 0)
        << n_rows << " rows";
  }
  target->set_graphs_enabled(true);
}

INSTANTIATE_TEST_SUITE_P(Heads, CudaDraftGraphs, ::testing::Bool(),
                         [](const auto& info) { return info.param ? "Centroid" : "Dense"; });

// Rule 8 on the device: after warm-up, decode and verify steps (and draft
// steps) make no device allocation.
TEST(CudaSteadyState, DecodeVerifyAndDraftStepsDoNotAllocateDeviceMemory) {
  SKIP_WITHOUT_CUDA();
  if (!have("e2b_like") || !have("e2b_like_assistant")) GTEST_SKIP();
  auto target = gemma4::Gemma4Model::load(golden("e2b_like"), on_cuda());
  auto drafter = assistant::AssistantModel::load(golden("e2b_like_assistant"), target->config(),
                                                 target->backend());
  assistant::AssistantDrafter source(*target, *drafter);
  Backend& be = target->backend();
  constexpr int kRows = 3;
  std::vector<SequenceKv> kvs;
  for (int i = 0; i < kRows; ++i) kvs.push_back(target->new_sequence());
  const std::vector<int32_t> prompt = {5, 9, 17, 33, 2, 71, 40, 8, 99, 12};
  std::vector<gemma4::ForwardRow> rows;
  for (auto& kv : kvs) rows.push_back({.kv = &kv, .tokens = prompt});
  target->forward(rows);
  const std::vector<int32_t> one = {7};
  const std::vector<int32_t> window = {7, 8, 9, 10, 11};
  std::vector<DraftRow> draft_rows(kRows);
  std::vector<float> hidden(static_cast<size_t>(target->config().hidden_size), 0.5f);
  auto step = [&](const std::vector<int32_t>& tokens) {
    for (int i = 0; i < kRows; ++i)
      rows[static_cast<size_t>(i)] = {
          .kv = &kvs[static_cast<size_t>(i)], .tokens = tokens, .all_logits = true};
    target->forward(rows);
    for (auto& kv : kvs) kv.truncate(kv.length() - static_cast<int64_t>(tokens.size()) + 1);
    for (int i = 0; i < kRows; ++i) {
      draft_rows[static_cast<size_t>(i)] = {
          .sequence = i,
          .token = 7,
          .position = static_cast<int32_t>(kvs[static_cast<size_t>(i)].length()),
          .target_kv = &kvs[static_cast<size_t>(i)],
          .target_hidden = hidden.data()};
    }
    for (int s = 0; s < 4; ++s) source.step(s, draft_rows);
  };
  step(window);
  step(one);
  const int64_t before = be.allocation_count();
  for (int i = 0; i < 5; ++i) {
    step(one);
    step(window);
  }
  be.synchronize();
  EXPECT_EQ(be.allocation_count() - before, 0) << "device allocations in steady state";
}

}  // namespace
}  // namespace specula
