// SPDX-License-Identifier: Apache-2.0
// The embedded family's trained DSpark drafter (models/gemma4-tiny-py-dspark):
// it loads against the shipped target (its dspark.json names the target's
// config hash), greedy output with it equals plain decoding on real Python
// prompts at several block cuts and batch sizes, pruned or not, and it is a
// trained drafter, not noise: its first drafts are often accepted.
#include <gtest/gtest.h>

#include <filesystem>
#include <string>
#include <vector>

#include "engine/draft/dspark/dspark_drafter.h"
#include "engine/draft/dspark/dspark_model.h"
#include "engine/speculative/decoder.h"
#include "engine/tokenizer/tokenizer.h"

namespace specula {
namespace {

std::string models_dir() {
  return std::string(SPECULA_SOURCE_DIR) + "/models";
}

// Completion prompts in the corpus's style (none of them is in it verbatim).
const char* const kPrompts[] = {
    "import os\nimport sys\n\n\ndef main(argv):\n    \"\"\"Print every file under the given "
    "directories.\"\"\"\n",
    "class Stack:\n    def __init__(self):\n        self.items = []\n\n    def push(self, item):\n",
    "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n    if n < 2:\n",
    "    def __repr__(self):\n        return '%s(%r)' % (self.__class__.__name__, self.",
    "try:\n    import json\nexcept ImportError:\n    json = None\n\n\ndef load(path):\n",
};

class EmbeddedDSpark : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    const std::string target_dir = models_dir() + "/gemma4-tiny-py";
    const std::string draft_dir = models_dir() + "/gemma4-tiny-py-dspark";
    if (!std::filesystem::exists(target_dir) || !std::filesystem::exists(draft_dir)) return;
    target_ = gemma4::Gemma4Model::load(target_dir).release();
    model_ = dspark::DSparkModel::load(draft_dir, *target_, target_->backend()).release();
    Tokenizer tok = Tokenizer::load(target_dir);
    prompts_ = new std::vector<std::vector<int32_t>>();
    for (const char* p : kPrompts) prompts_->push_back(tok.encode(p, true));
  }
  static void TearDownTestSuite() {
    delete prompts_;
    delete model_;
    delete target_;
  }
  void SetUp() override {
    if (model_ == nullptr) GTEST_SKIP() << "models/gemma4-tiny-py-dspark not present";
  }

  static std::vector<speculative::DecodeRequest> requests(int n, int max_tokens) {
    std::vector<speculative::DecodeRequest> reqs;
    for (int i = 0; i < n; ++i) {
      speculative::DecodeRequest r;
      r.prompt = (*prompts_)[static_cast<size_t>(i) % prompts_->size()];
      r.params.temperature = 0.0f;
      r.params.max_tokens = max_tokens;
      reqs.push_back(std::move(r));
    }
    return reqs;
  }

  static gemma4::Gemma4Model* target_;
  static dspark::DSparkModel* model_;
  static std::vector<std::vector<int32_t>>* prompts_;
};
gemma4::Gemma4Model* EmbeddedDSpark::target_ = nullptr;
dspark::DSparkModel* EmbeddedDSpark::model_ = nullptr;
std::vector<std::vector<int32_t>>* EmbeddedDSpark::prompts_ = nullptr;

TEST_F(EmbeddedDSpark, IsTheSpeculaLayoutWithABlockOfEight) {
  EXPECT_EQ(model_->config().block_size, 8);
  EXPECT_TRUE(model_->has_confidence_head());
}

TEST_F(EmbeddedDSpark, GreedyOutputEqualsPlainDecoding) {
  dspark::DSparkDrafter drafter(*target_, *model_);
  for (int batch : {1, 5}) {
    const auto reqs = requests(batch, 40);
    const auto plain = speculative::decode(*target_, nullptr, reqs, {.draft_tokens = 1});
    for (int k : {2, 5, 8}) {
      const auto got = speculative::decode(*target_, &drafter, reqs, {.draft_tokens = k});
      for (size_t i = 0; i < reqs.size(); ++i)
        EXPECT_EQ(got[i].tokens, plain[i].tokens)
            << "batch " << batch << " k " << k << " prompt " << i;
    }
  }
  EXPECT_EQ(drafter.live_sequences(), 0);
}

// Pruning by the confidence head only shortens what is verified.
TEST_F(EmbeddedDSpark, PrunedOutputEqualsPlainDecoding) {
  dspark::DSparkDrafter drafter(*target_, *model_);
  drafter.set_thresholds(std::vector<float>(8, 0.5f));
  const auto reqs = requests(5, 40);
  const auto plain = speculative::decode(*target_, nullptr, reqs, {.draft_tokens = 1});
  const auto got = speculative::decode(*target_, &drafter, reqs, {.draft_tokens = 8});
  int64_t pruned = 0;
  for (size_t i = 0; i < reqs.size(); ++i) {
    EXPECT_EQ(got[i].tokens, plain[i].tokens) << "prompt " << i;
    pruned += got[i].stats.pruned;
  }
  EXPECT_GT(pruned, 0) << "a threshold of 0.5 cut no draft";
}

// A trained drafter's first draft is often right on code like its training
// data (the shipped one: 87 of 133 here); a random or misaligned one (say,
// taps off by one position) gets almost none. Greedy and deterministic, so the
// count is fixed for the shipped weights; the bound leaves room for a retrain.
TEST_F(EmbeddedDSpark, FirstDraftsAreOftenAccepted) {
  dspark::DSparkDrafter drafter(*target_, *model_);
  const auto reqs = requests(5, 64);
  const auto got = speculative::decode(*target_, &drafter, reqs, {.draft_tokens = 8});
  speculative::DecodeStats all;
  for (const auto& r : got) all.merge(r.stats);
  ASSERT_FALSE(all.drafted_at.empty());
  ASSERT_GT(all.drafted_at[0], 0);
  const double first = static_cast<double>(all.accepted_at[0]) / all.drafted_at[0];
  EXPECT_GT(first, 0.3) << all.accepted_at[0] << " of " << all.drafted_at[0];
}

}  // namespace
}  // namespace specula
