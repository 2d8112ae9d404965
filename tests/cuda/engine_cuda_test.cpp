// SPDX-License-Identifier: Apache-2.0
// The engine under load on CUDA: requests arriving and leaving at random
// steps, some cancelled, at several chunk budgets, each get exactly the tokens
// they get alone (no drafter, the assistant, ngram): decode steps, verify
// windows and batched rows are batch invariant, and prefill goes in pieces
// fixed in absolute position, each its own forward.
#include <gtest/gtest.h>

#include <filesystem>

#include "engine/draft/assistant/assistant_drafter.h"
#include "engine/draft/ngram/ngram_drafter.h"
#include "engine/speculative/engine.h"
#include "tests/cuda/cuda_model_util.h"
#include "tests/cuda/cuda_test_util.h"
#include "tests/unit/speculative/engine_test_util.h"

namespace specula {
namespace {

const std::string kModels = std::string(SPECULA_SOURCE_DIR) + "/models";

// The embedded target and its assistant on the GPU (the caller checked that
// the models are there), with the assistant's drafter.
struct EmbeddedFamily {
  std::unique_ptr<gemma4::Gemma4Model> target =
      gemma4::Gemma4Model::load(kModels + "/gemma4-tiny-py", test::on_cuda());
  std::unique_ptr<assistant::AssistantModel> drafter = assistant::AssistantModel::load(
      kModels + "/gemma4-tiny-py-assistant", target->config(), target->backend());
  assistant::AssistantDrafter source{*target, *drafter};
};

struct Case {
  const char* drafter;
  int64_t budget;
};
class CudaEngineUnderLoad : public ::testing::TestWithParam<Case> {};

TEST_P(CudaEngineUnderLoad, EveryRequestGetsItsTokensAlone) {
  SKIP_WITHOUT_CUDA();
  if (!std::filesystem::exists(kModels + "/gemma4-tiny-py-assistant")) GTEST_SKIP();
  EmbeddedFamily family;
  gemma4::Gemma4Model* target = family.target.get();
  assistant::AssistantDrafter& source = family.source;
  ngram::NgramDrafter ngram(target->config().vocab_size, {});
  const std::string name = GetParam().drafter;
  Drafter* d = name == "assistant" ? static_cast<Drafter*>(&source)
               : name == "ngram"   ? static_cast<Drafter*>(&ngram)
                                   : nullptr;
  const speculative::DraftSchedule schedule{.draft_tokens = 3};
  const auto reqs = testing::mixed_requests(10, static_cast<int>(target->config().vocab_size), 7);
  std::vector<speculative::DecodeResult> alone;
  for (const auto& r : reqs) {
    alone.push_back(speculative::decode(*target, d, std::span(&r, 1), schedule).front());
  }
  // Short pieces too: prompts cross piece boundaries at different steps.
  for (int64_t chunk : {int64_t{16}, int64_t{512}}) {
    speculative::Engine engine(*target, d,
                               {.schedule = schedule,
                                .max_rows = 4,
                                .max_batch_tokens = GetParam().budget,
                                .prefill_chunk = chunk});
    if (chunk == 512) {
      testing::expect_alone_tokens_under_load(engine, reqs, alone, 4);
    } else {
      // Other piece boundaries give other prefill bits on CUDA: compare with
      // the same pieces alone.
      std::vector<speculative::DecodeResult> alone16;
      speculative::Engine single(*target, d,
                                 {.schedule = schedule, .max_rows = 1, .prefill_chunk = chunk});
      for (const auto& r : reqs)
        alone16.push_back(speculative::decode(single, std::span(&r, 1)).front());
      testing::expect_alone_tokens_under_load(engine, reqs, alone16, 4);
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Schedules, CudaEngineUnderLoad,
                         ::testing::Values(Case{"none", 16}, Case{"none", 4096},
                                           Case{"assistant", 16}, Case{"assistant", 64},
                                           Case{"assistant", 4096}, Case{"ngram", 64}),
                         [](const auto& info) {
                           return std::string(info.param.drafter) + "_budget" +
                                  std::to_string(info.param.budget);
                         });

// The kernel choices under measurement (backends.h: the tiled products, the
// raw bf16 staging of attention) change no token: 32 requests decoded
// together with the assistant (32-row decode steps, 128-row verify windows,
// past the tiled products' 24 rows) get, with both choices on, the tokens each
// gets alone with the default kernels.
TEST(CudaKernelChoicesEngine, BatchedTokensEqualTheDefaultKernelsAlone) {
  SKIP_WITHOUT_CUDA();
  if (!std::filesystem::exists(kModels + "/gemma4-tiny-py-assistant")) GTEST_SKIP();
  EmbeddedFamily family;
  gemma4::Gemma4Model* target = family.target.get();
  assistant::AssistantDrafter& source = family.source;
  const speculative::DraftSchedule schedule{.draft_tokens = 3};
  const auto reqs = testing::mixed_requests(32, static_cast<int>(target->config().vocab_size), 11);
  std::vector<speculative::DecodeResult> alone;
  for (const auto& r : reqs) {
    alone.push_back(speculative::decode(*target, &source, std::span(&r, 1), schedule).front());
  }
  const test::ScopedKernelChoices on({.tiled_products = true, .raw_kv_staging = true});
  const auto together = speculative::decode(*target, &source, reqs, schedule);
  ASSERT_EQ(together.size(), alone.size());
  for (size_t i = 0; i < reqs.size(); ++i) {
    EXPECT_EQ(together[i].tokens, alone[i].tokens) << "request " << i;
  }
}

}  // namespace
}  // namespace specula
