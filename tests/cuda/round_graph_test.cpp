// SPDX-License-Identifier: Apache-2.0
// Whole speculative rounds recorded as one CUDA graph (SPECULA_ROUND_GRAPHS=1,
// kept by a spec::DecodeSession):
// a round's draft steps, verify window, argmaxes or acceptance replay as one
// graph, and give the same tokens as the same rounds run op by op (graphs off)
// and as plain decoding, greedy and sampled, across calls of one session, with
// one readback per round.
#include <gtest/gtest.h>

#include "engine/draft/assistant/assistant_drafter.h"
#include "engine/model/gemma4/gemma4.h"
#include "engine/spec/decoder.h"
#include "tests/cuda/cuda_model_util.h"
#include "tests/cuda/cuda_test_util.h"
#include "tests/unit/spec/sampling_test_util.h"

namespace specula {
namespace {

using test::golden;
using test::have;
using test::on_cuda;

struct Pair {
  const char* target;
  const char* drafter;
};
class CudaRoundGraphs : public ::testing::TestWithParam<Pair> {};

using testing::greedy_requests;

void expect_same_tokens(const std::vector<spec::DecodeResult>& got,
                        const std::vector<spec::DecodeResult>& want, const std::string& what) {
  ASSERT_EQ(got.size(), want.size()) << what;
  for (size_t b = 0; b < got.size(); ++b) {
    EXPECT_EQ(got[b].tokens, want[b].tokens) << what << " row " << b;
  }
}

TEST_P(CudaRoundGraphs, ReplayedRoundsEqualDirectRoundsAndPlainDecoding) {
  SKIP_WITHOUT_CUDA();
  const Pair c = GetParam();
  if (!have(c.target) || !have(c.drafter)) GTEST_SKIP() << "fixtures missing";
  const testing::ScopedEnv round_graphs("SPECULA_ROUND_GRAPHS", true);
  auto target = gemma4::Gemma4Model::load(golden(c.target), on_cuda());
  auto drafter =
      assistant::AssistantDrafter::load(golden(c.drafter), target->config(), target->backend());
  assistant::AssistantDraftSource source(*target, *drafter);
  Backend& be = target->backend();
  const int vocab = target->config().vocab_size;
  for (int batch : {1, 3}) {
    auto reqs = greedy_requests(batch, vocab, 40);
    const auto plain = spec::decode(*target, nullptr, reqs, {});
    for (int k : {1, 3, 6}) {
      const spec::DraftSchedule schedule{.draft_tokens = k};
      target->set_graphs_enabled(false);
      const auto direct = spec::decode(*target, &source, reqs, schedule);
      target->set_graphs_enabled(true);
      spec::DecodeSession session;
      for (int call = 0; call < 2; ++call) {
        const int64_t readbacks = be.readback_count();
        const auto replayed = spec::decode(*target, &source, reqs, schedule, {}, &session);
        int64_t rounds = 0;
        for (const auto& r : replayed) rounds = std::max(rounds, r.stats.rounds);
        const std::string what = fmt::format("batch {} k {} call {}", batch, k, call);
        expect_same_tokens(replayed, direct, what);
        expect_same_tokens(replayed, plain, what);
        EXPECT_EQ(be.readback_count() - readbacks, 1 + rounds) << what;
      }
      // The first call records each round shape on its second sighting; the
      // second call, of the same shapes, replays from its first round on.
      EXPECT_GT(session.round_replays(), 0) << "batch " << batch << " k " << k;
    }
    // Uneven rows and adaptive draft lengths: rounds whose later steps run a
    // strict subset of the rows (gathered tokens and hiddens inside the graph).
    for (int b = 0; b < batch; ++b) reqs[static_cast<size_t>(b)].params.max_tokens = 14 + 5 * b;
    const auto plain_uneven = spec::decode(*target, nullptr, reqs, {});
    const spec::DraftSchedule adaptive{.draft_tokens = 3, .adaptive = true, .max_draft_tokens = 8};
    spec::DecodeSession session;
    for (int call = 0; call < 2; ++call) {
      const auto replayed = spec::decode(*target, &source, reqs, adaptive, {}, &session);
      expect_same_tokens(replayed, plain_uneven, fmt::format("adaptive batch {}", batch));
    }
  }
}

// Sampled rounds (p, q, draws and acceptance on the device) replay as one
// graph too: the same tokens as the same seeds with graphs off.
TEST_P(CudaRoundGraphs, SampledRoundsReplayedEqualDirect) {
  SKIP_WITHOUT_CUDA();
  const Pair c = GetParam();
  if (!have(c.target) || !have(c.drafter)) GTEST_SKIP() << "fixtures missing";
  const testing::ScopedEnv round_graphs("SPECULA_ROUND_GRAPHS", true);
  auto target = gemma4::Gemma4Model::load(golden(c.target), on_cuda());
  auto drafter =
      assistant::AssistantDrafter::load(golden(c.drafter), target->config(), target->backend());
  assistant::AssistantDraftSource source(*target, *drafter);
  const int vocab = target->config().vocab_size;
  for (int batch : {1, 3}) {
    const auto reqs = testing::sampled_requests(batch, vocab, 30);
    for (int k : {2, 5}) {
      const spec::DraftSchedule schedule{.draft_tokens = k};
      target->set_graphs_enabled(false);
      const auto direct = spec::decode(*target, &source, reqs, schedule);
      target->set_graphs_enabled(true);
      spec::DecodeSession session;
      for (int call = 0; call < 2; ++call) {
        const auto replayed = spec::decode(*target, &source, reqs, schedule, {}, &session);
        expect_same_tokens(replayed, direct, fmt::format("sampled batch {} k {}", batch, k));
      }
      EXPECT_GT(session.round_replays(), 0) << "batch " << batch << " k " << k;
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Fixtures, CudaRoundGraphs,
                         ::testing::Values(Pair{"e2b_like", "e2b_like_assistant"},
                                           Pair{"e2b_like", "e2b_like_assistant_dense"},
                                           Pair{"dense_kev", "dense_kev_assistant"}));

}  // namespace
}  // namespace specula
