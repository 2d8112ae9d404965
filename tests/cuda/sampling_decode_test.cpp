// SPDX-License-Identifier: Apache-2.0
// Sampled decoding on CUDA with the whole pipeline on the device (p, q, the
// draws and the acceptance as backend ops): the same tokens as sampling the
// same logits on the host, at every draft length and batch size; the second
// token distributed as the target's (chi-square against the CPU model's exact
// marginal); one readback per round.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdlib>
#include <filesystem>

#include "engine/draft/assistant/assistant_drafter.h"
#include "engine/model/gemma4/gemma4.h"
#include "engine/sampling/sampler.h"
#include "engine/speculative/decoder.h"
#include "tests/cuda/cuda_model_util.h"
#include "tests/cuda/cuda_test_util.h"
#include "tests/unit/speculative/sampling_test_util.h"

namespace specula {
namespace {

using test::golden;
using test::have;
using test::on_cuda;

struct Pair {
  const char* target;
  const char* drafter;
};
class CudaDeviceSampling : public ::testing::TestWithParam<Pair> {};

// The host path reads the same device logits back and samples them with the
// same uniforms; the device's p and q may differ from the host's by an ulp, so
// a token could differ only where a uniform falls within ~1e-7 of a boundary
// of the CDF (none does in these seeded runs).
TEST_P(CudaDeviceSampling, SameTokensAsHostSampling) {
  SKIP_WITHOUT_CUDA();
  const Pair c = GetParam();
  if (!have(c.target) || !have(c.drafter)) GTEST_SKIP() << "fixtures missing";
  auto target = gemma4::Gemma4Model::load(golden(c.target), on_cuda());
  auto drafter =
      assistant::AssistantModel::load(golden(c.drafter), target->config(), target->backend());
  assistant::AssistantDrafter source(*target, *drafter);
  const int vocab = target->config().vocab_size;
  int64_t drafted = 0, accepted = 0;
  for (int batch : {1, 3, 8}) {
    const auto reqs = testing::sampled_requests(batch, vocab, 20);
    for (int k = 0; k <= 8; ++k) {
      Drafter* d = k == 0 ? nullptr : &source;
      const speculative::DraftSchedule schedule{.draft_tokens = std::max(k, 1)};
      std::vector<speculative::DecodeResult> host;
      {
        host = speculative::decode(*target, d, reqs, schedule, {}, {.host_sampling = true});
      }
      const int64_t before = target->backend().readback_count();
      const auto device = speculative::decode(*target, d, reqs, schedule);
      int64_t rounds = 0;
      for (const auto& r : device) rounds = std::max(rounds, r.stats.rounds);
      EXPECT_EQ(target->backend().readback_count() - before, 1 + rounds)
          << "one readback per round (and one for the prefill); batch " << batch << " k " << k;
      for (int b = 0; b < batch; ++b) {
        ASSERT_EQ(device[static_cast<size_t>(b)].tokens, host[static_cast<size_t>(b)].tokens)
            << "batch " << batch << " k " << k << " row " << b;
        drafted += device[static_cast<size_t>(b)].stats.drafted;
        accepted += device[static_cast<size_t>(b)].stats.accepted;
      }
    }
  }
  std::printf("[ cuda sampling ] %s: %lld of %lld drafts accepted\n", c.drafter,
              static_cast<long long>(accepted), static_cast<long long>(drafted));
  EXPECT_GT(accepted, 0);
  EXPECT_LT(accepted, drafted);
}

INSTANTIATE_TEST_SUITE_P(Fixtures, CudaDeviceSampling,
                         ::testing::Values(Pair{"e2b_like", "e2b_like_assistant"},
                                           Pair{"dense_kev", "dense_kev_assistant"}));

// P(t2) = Σ_t1 p(t1 | prompt) p(t2 | prompt, t1) on the CPU model.
std::vector<double> exact_second_token(gemma4::Gemma4Model& target,
                                       const std::vector<int32_t>& prompt,
                                       const SamplingParams& params) {
  const int64_t V = target.config().vocab_size;
  SamplingWorkspace ws(V);
  auto probs_after = [&](const std::vector<int32_t>& ctx) {
    SequenceKv kv = target.new_sequence();
    gemma4::ForwardRow row{.kv = &kv, .tokens = ctx};
    const auto& out = target.forward(std::span(&row, 1));
    auto p =
        process_logits(out.logits.f32(), {.tokens = ctx, .num_prompt = prompt.size()}, params, ws);
    return std::vector<double>(p.begin(), p.end());
  };
  const std::vector<double> p1 = probs_after(prompt);
  std::vector<double> marginal(static_cast<size_t>(V), 0.0);
  for (int32_t t1 = 0; t1 < V; ++t1) {
    if (p1[static_cast<size_t>(t1)] == 0) continue;
    std::vector<int32_t> ctx = prompt;
    ctx.push_back(t1);
    const std::vector<double> p2 = probs_after(ctx);
    for (int64_t v = 0; v < V; ++v)
      marginal[static_cast<size_t>(v)] += p1[static_cast<size_t>(t1)] * p2[static_cast<size_t>(v)];
  }
  return marginal;
}

// Without a drafter, rows with penalties sample on the device too
// (apply_penalties_rows): the same tokens as the host path, one readback per
// step.
TEST(CudaDeviceSamplingPenalties, SameTokensAsHostSampling) {
  SKIP_WITHOUT_CUDA();
  if (!have("e2b_like")) GTEST_SKIP();
  auto target = gemma4::Gemma4Model::load(golden("e2b_like"), on_cuda());
  const int vocab = target->config().vocab_size;
  constexpr int kTokens = 20;
  for (int batch : {1, 3, 8}) {
    const auto reqs = testing::penalised_requests(batch, vocab, kTokens);
    std::vector<speculative::DecodeResult> host;
    {
      host = speculative::decode(*target, nullptr, reqs, {}, {}, {.host_sampling = true});
    }
    const int64_t before = target->backend().readback_count();
    const auto device = speculative::decode(*target, nullptr, reqs, {});
    EXPECT_EQ(target->backend().readback_count() - before, kTokens) << "batch " << batch;
    for (int b = 0; b < batch; ++b) {
      ASSERT_EQ(device[static_cast<size_t>(b)].tokens, host[static_cast<size_t>(b)].tokens)
          << "batch " << batch << " row " << b;
    }
  }
}

// With a drafter, rows with penalties sample on the device as well (each draft
// step and window row penalised for the history plus the drafts before it):
// the same tokens as the host path, one readback per round; greedy rows with
// penalties emit what they emit without speculation.
TEST(CudaDeviceSamplingPenalties, WithADrafterSameTokensAsHostSampling) {
  SKIP_WITHOUT_CUDA();
  if (!have("e2b_like") || !have("e2b_like_assistant")) GTEST_SKIP();
  auto target = gemma4::Gemma4Model::load(golden("e2b_like"), on_cuda());
  auto drafter = assistant::AssistantModel::load(golden("e2b_like_assistant"), target->config(),
                                                   target->backend());
  assistant::AssistantDrafter source(*target, *drafter);
  const int vocab = target->config().vocab_size;
  constexpr int kTokens = 20;
  int64_t drafted = 0, accepted = 0;
  for (int batch : {1, 3, 8}) {
    const auto reqs = testing::penalised_requests(batch, vocab, kTokens);
    const auto plain = speculative::decode(*target, nullptr, reqs, {});
    for (int k : {1, 3, 8}) {
      const speculative::DraftSchedule schedule{.draft_tokens = k};
      std::vector<speculative::DecodeResult> host;
      {
        host = speculative::decode(*target, &source, reqs, schedule, {}, {.host_sampling = true});
      }
      const int64_t before = target->backend().readback_count();
      const auto device = speculative::decode(*target, &source, reqs, schedule);
      int64_t rounds = 0;
      for (const auto& r : device) rounds = std::max(rounds, r.stats.rounds);
      EXPECT_EQ(target->backend().readback_count() - before, 1 + rounds)
          << "batch " << batch << " k " << k;
      for (int b = 0; b < batch; ++b) {
        const auto i = static_cast<size_t>(b);
        ASSERT_EQ(device[i].tokens, host[i].tokens)
            << "batch " << batch << " k " << k << " row " << b;
        if (reqs[i].params.greedy()) {
          EXPECT_EQ(device[i].tokens, plain[i].tokens) << "batch " << batch << " k " << k;
        }
        if (reqs[i].params.has_penalties()) {
          drafted += device[i].stats.drafted;
          accepted += device[i].stats.accepted;
        }
      }
    }
  }
  EXPECT_GT(accepted, 0);
  EXPECT_LT(accepted, drafted);
}

TEST(CudaDeviceSamplingDistribution, SecondTokenFollowsTheTargetDistribution) {
  SKIP_WITHOUT_CUDA();
  if (!have("e2b_like") || !have("e2b_like_assistant")) GTEST_SKIP();
  auto gpu = gemma4::Gemma4Model::load(golden("e2b_like"), on_cuda());
  auto cpu = gemma4::Gemma4Model::load(golden("e2b_like"));
  auto drafter = assistant::AssistantModel::load(golden("e2b_like_assistant"), gpu->config(),
                                                   gpu->backend());
  assistant::AssistantDrafter source(*gpu, *drafter);
  const std::vector<int32_t> prompt = {5, 17, 33, 2, 90, 41, 7};
  for (float top_p : {1.0f, 0.9f}) {
    SamplingParams params;
    params.temperature = 1.0f;
    params.top_p = top_p;
    params.max_tokens = 3;  // the second token comes from a round of one draft
    const std::vector<double> expected = exact_second_token(*cpu, prompt, params);
    const int draws = 4000, batch = 200;
    std::vector<int64_t> counts(expected.size(), 0);
    int64_t drafted = 0, accepted = 0;
    for (int start = 0; start < draws; start += batch) {
      std::vector<speculative::DecodeRequest> reqs;
      for (int i = 0; i < batch; ++i) {
        speculative::DecodeRequest r{.prompt = prompt, .params = params};
        r.params.seed = static_cast<uint64_t>(5000 + start + i);
        reqs.push_back(r);
      }
      for (const auto& res : speculative::decode(*gpu, &source, reqs, {.draft_tokens = 2})) {
        ASSERT_EQ(res.tokens.size(), 3u);
        ++counts[static_cast<size_t>(res.tokens[1])];
        drafted += res.stats.drafted;
        accepted += res.stats.accepted;
      }
    }
    const auto [chi2, limit, dof] = testing::chi_square(expected, counts, draws);  // fixed seeds
    std::printf("[ cuda sampling ] top_p=%.2f chi2=%.1f dof=%d limit=%.1f acceptance=%.3f\n", top_p,
                chi2, dof, limit, drafted ? static_cast<double>(accepted) / drafted : 0.0);
    EXPECT_GT(accepted, 0);
    EXPECT_LT(accepted, drafted);
    EXPECT_LT(chi2, limit);
  }
}

}  // namespace
}  // namespace specula
