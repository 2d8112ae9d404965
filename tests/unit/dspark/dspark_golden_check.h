// SPDX-License-Identifier: Apache-2.0
// The DSpark golden parity check (docs/dspark.md, "Golden fixtures"), shared by
// the CPU test (tests/unit/dspark_golden_test.cpp) and the CUDA one
// (tests/cuda/dspark_cuda_test.cpp): the dense_kev target, placed by the given
// load options, taps the fixture's sequence in one forward; its contexts are
// committed one after another into one context cache, and every round's base
// logits, block logits (the Markov bias along the reference's greedy chain),
// confidences (after σ) and greedy drafts must match PyTorch's within 1e-5.
// Inputs and outputs travel through device buffers, so the check runs
// unchanged on every backend. Skips while the fixture is absent.
#pragma once

#include <gtest/gtest.h>

#include <cmath>
#include <string>
#include <vector>

#include "engine/draft/dspark/dspark_model.h"
#include "engine/io/safetensors.h"
#include "tests/unit/model/golden_util.h"

namespace specula::testing {

inline constexpr double kDSparkGoldenTolerance = 1e-5;

inline void check_dspark_fixture(const std::string& name, const gemma4::LoadOptions& options = {}) {
  const std::string dir = golden_dir(name);
  if (!golden_exists(name)) {
    GTEST_SKIP() << "golden fixture " << dir
                 << " is absent (tools/golden/make_dspark_golden.py writes it)";
  }
  auto target = gemma4::Gemma4Model::load(golden_dir("dense_kev"), options);
  Backend& be = target->backend();
  auto model = dspark::DSparkModel::load(dir, *target, be);
  const dspark::DSparkConfig& c = model->config();
  const int64_t G = c.block_size, V = target->config().vocab_size;
  const int64_t H = target->config().hidden_size;
  const auto m = static_cast<int64_t>(c.taps.size());
  const std::string where = name + " on " + be.device().str();

  const io::SafetensorsFile expected(dir + "/expected.safetensors");
  const std::vector<int32_t> sequence = to_ids(expected.get("sequence"));
  const std::vector<int32_t> contexts = to_ids(expected.get("contexts"));
  const Tensor base = expected.get("base_logits");
  const Tensor block = expected.get("block_logits");
  const Tensor conf = expected.get("confidences");
  const std::vector<int32_t> drafts = to_ids(expected.get("draft_tokens"));
  const auto R = static_cast<int64_t>(contexts.size());
  ASSERT_EQ(base.shape(), (Shape{R, G, V}));
  ASSERT_EQ(block.shape(), (Shape{R, G, V}));
  ASSERT_EQ(conf.shape(), (Shape{R, G}));
  ASSERT_EQ(static_cast<int64_t>(drafts.size()), R * G);
  ASSERT_LT(contexts.back(), static_cast<int32_t>(sequence.size()));

  // The target's taps of the whole sequence, in one forward, on the device.
  const auto N = static_cast<int64_t>(sequence.size());
  DeviceBuffer tap_buf(be, static_cast<size_t>(m * N * H) * sizeof(float));
  const Tensor taps = tap_buf.view(DType::kF32, {m, N, H});
  {
    SequenceKv kv = target->new_sequence();
    const gemma4::ForwardRow row{.kv = &kv, .tokens = sequence, .all_logits = false};
    gemma4::ForwardOptions o;
    o.tap_layers = c.taps;
    o.tap_out = taps;
    target->forward(std::span(&row, 1), o);
  }
  // One token (anchor or previous draft) and one confidence logit, on the device.
  DeviceBuffer io_buf(be, 2 * sizeof(float));
  const Tensor token = io_buf.view(DType::kI32, {1});
  const Tensor c_logit(static_cast<float*>(io_buf.data()) + 1, DType::kF32, {1}, be.device());
  std::vector<float> got(static_cast<size_t>(G * V));

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
    const int32_t anchor = sequence[static_cast<size_t>(t)];
    be.upload(&anchor, token);
    SequenceKv* rows[1] = {&ctx};
    model->run_block(rows, token);
    be.download(model->base_logits(), got.data());
    EXPECT_LE(relative_error(got.data(), base.data_as<const float>() + r * G * V, G * V),
              kDSparkGoldenTolerance)
        << where << " round " << r << ": base_logits";
    int32_t prev = anchor;
    for (int64_t k = 0; k < G; ++k) {
      const int32_t u_row = static_cast<int32_t>(k);
      be.upload(&prev, token);
      const Tensor logits = model->head_step(static_cast<int>(k), std::span(&u_row, 1), token,
                                             model->has_confidence_head() ? c_logit : Tensor());
      be.download(logits, got.data());
      EXPECT_LE(relative_error(got.data(), block.data_as<const float>() + (r * G + k) * V, V),
                kDSparkGoldenTolerance)
          << where << " round " << r << " position " << k << ": block_logits";
      if (model->has_confidence_head()) {
        float logit = NAN;
        be.download(c_logit, &logit);
        const float sig = 1.0f / (1.0f + std::exp(-logit));
        const float want = conf.data_as<const float>()[r * G + k];
        EXPECT_TRUE(std::isfinite(sig)) << where << " round " << r << " position " << k;
        EXPECT_LE(std::fabs(static_cast<double>(sig) - want), kDSparkGoldenTolerance)
            << where << " round " << r << " position " << k << ": confidence " << sig << " vs "
            << want;
      }
      // Greedy: the argmax (lowest id on ties), as the engine's argmax_rows.
      int32_t best = 0;
      for (int32_t v = 1; v < V; ++v)
        if (got[static_cast<size_t>(v)] > got[static_cast<size_t>(best)]) best = v;
      EXPECT_EQ(best, drafts[static_cast<size_t>(r * G + k)])
          << where << " round " << r << " position " << k << ": draft token";
      prev = drafts[static_cast<size_t>(r * G + k)];  // follow the reference chain
    }
  }
}

}  // namespace specula::testing
