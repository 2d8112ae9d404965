// SPDX-License-Identifier: Apache-2.0
// DSpark parity with PyTorch (docs/dspark.md, "Golden fixtures"): for each
// fixture folder (tests/golden/dspark: specula layout; tests/golden/dspark_deepspec:
// DeepSpec's own modeling code), the target's taps of the fixture's sequence
// are committed context by context, and every round's base logits, block
// logits (Markov bias along the greedy chain), confidences (after σ) and
// greedy drafts must match within 1e-5. Skips while a fixture is absent.
#include <gtest/gtest.h>

#include <cmath>
#include <vector>

#include "engine/draft/dspark/dspark_drafter.h"
#include "engine/io/safetensors.h"
#include "tests/unit/model/golden_util.h"

namespace specula {
namespace {

constexpr double kTolerance = 1e-5;

void check_fixture(const std::string& name) {
  const std::string dir = testing::golden_dir(name);
  if (!testing::golden_exists(name)) {
    GTEST_SKIP() << "golden fixture " << dir
                 << " is absent (tools/golden/make_dspark_golden.py writes it)";
  }
  auto target = gemma4::Gemma4Model::load(testing::golden_dir("dense_kev"));
  auto model = dspark::DSparkModel::load(dir, *target, target->backend());
  const dspark::DSparkConfig& c = model->config();
  const int64_t G = c.block_size, V = target->config().vocab_size;
  const int64_t H = target->config().hidden_size;
  const auto m = static_cast<int64_t>(c.taps.size());

  const io::SafetensorsFile expected(dir + "/expected.safetensors");
  const std::vector<int32_t> sequence = testing::to_ids(expected.get("sequence"));
  const std::vector<int32_t> contexts = testing::to_ids(expected.get("contexts"));
  const Tensor base = expected.get("base_logits");
  const Tensor block = expected.get("block_logits");
  const Tensor conf = expected.get("confidences");
  const std::vector<int32_t> drafts = testing::to_ids(expected.get("draft_tokens"));
  const auto R = static_cast<int64_t>(contexts.size());
  ASSERT_EQ(base.shape(), (Shape{R, G, V}));
  ASSERT_EQ(block.shape(), (Shape{R, G, V}));
  ASSERT_EQ(conf.shape(), (Shape{R, G}));
  ASSERT_EQ(static_cast<int64_t>(drafts.size()), R * G);
  ASSERT_LT(contexts.back(), static_cast<int32_t>(sequence.size()));

  // The target's taps of the whole sequence, in one forward.
  const auto N = static_cast<int64_t>(sequence.size());
  std::vector<float> tap_buf(static_cast<size_t>(m * N * H));
  const Tensor taps(tap_buf.data(), DType::kF32, {m, N, H});
  {
    SequenceKv kv = target->new_sequence();
    const gemma4::ForwardRow row{.kv = &kv, .tokens = sequence, .all_logits = false};
    gemma4::ForwardOptions o;
    o.tap_layers = c.taps;
    o.tap_out = taps;
    target->forward(std::span(&row, 1), o);
  }

  SequenceKv ctx = model->new_context();
  int64_t committed = 0;
  for (int64_t r = 0; r < R; ++r) {
    const int64_t t = contexts[static_cast<size_t>(r)];
    ASSERT_GT(t, committed) << "contexts must increase";
    const dspark::ContextPiece p{.kv = &ctx,
                                 .position = committed,
                                 .count = static_cast<int>(t - committed),
                                 .tap_row = committed};
    model->commit_context(std::span(&p, 1), taps);
    committed = t;
    int32_t anchor = sequence[static_cast<size_t>(t)];
    SequenceKv* rows[1] = {&ctx};
    model->run_block(rows, Tensor(&anchor, DType::kI32, {1}));
    const Tensor U = model->base_logits();
    EXPECT_LE(testing::relative_error(U.data_as<const float>(),
                                      base.data_as<const float>() + r * G * V, G * V),
              kTolerance)
        << name << " round " << r << ": base_logits";
    int32_t prev = anchor;
    for (int64_t k = 0; k < G; ++k) {
      float c_logit = NAN;
      const int32_t u_row = static_cast<int32_t>(k);
      const Tensor logits =
          model->head_step(static_cast<int>(k), std::span(&u_row, 1),
                           Tensor(&prev, DType::kI32, {1}), Tensor(&c_logit, DType::kF32, {1}));
      EXPECT_LE(testing::relative_error(logits.data_as<const float>(),
                                        block.data_as<const float>() + (r * G + k) * V, V),
                kTolerance)
          << name << " round " << r << " position " << k << ": block_logits";
      if (model->has_confidence_head()) {
        const float got = 1.0f / (1.0f + std::exp(-c_logit));
        const float want = conf.data_as<const float>()[r * G + k];
        EXPECT_TRUE(std::isfinite(got)) << name << " round " << r << " position " << k;
        EXPECT_LE(std::fabs(static_cast<double>(got) - want), kTolerance)
            << name << " round " << r << " position " << k << ": confidence " << got << " vs "
            << want;
      }
      // Greedy: the argmax (lowest id on ties), as the engine's argmax_rows.
      const float* row = logits.data_as<const float>();
      int32_t best = 0;
      for (int32_t v = 1; v < V; ++v)
        if (row[v] > row[best]) best = v;
      EXPECT_EQ(best, drafts[static_cast<size_t>(r * G + k)])
          << name << " round " << r << " position " << k << ": draft token";
      prev = drafts[static_cast<size_t>(r * G + k)];  // follow the reference chain
    }
  }
}

TEST(DSparkGolden, SpeculaLayoutMatchesPyTorch) {
  check_fixture("dspark");
}
TEST(DSparkGolden, DeepSpecLayoutMatchesDeepSpec) {
  check_fixture("dspark_deepspec");
}

}  // namespace
}  // namespace specula
