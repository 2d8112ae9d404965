// SPDX-License-Identifier: Apache-2.0
// Device taps (ForwardOptions::tap_layers): the tapped hidden states equal
// what `score --layer-hidden` writes (capture_layer_hidden, transformers'
// hidden_states), and asking for taps leaves the forward's outputs unchanged
// bit for bit.
#include <gtest/gtest.h>

#include <cstring>

#include "engine/model/gemma4/gemma4.h"
#include "tests/unit/model/golden_util.h"

namespace specula {
namespace {

TEST(Taps, EqualCapturedHiddenStatesAndChangeNothing) {
  for (const char* name : {"e2b_like", "dense_kev"}) {
    if (!testing::golden_exists(name)) GTEST_SKIP() << name << " missing";
    auto model = gemma4::Gemma4Model::load(testing::golden_dir(name));
    Backend& be = model->backend();
    const int L = model->config().num_hidden_layers;
    const int64_t H = model->config().hidden_size;
    const std::vector<int32_t> a = {5, 17, 33, 2, 90, 41, 7}, b = {3, 8, 12};
    // Two rows, one with all logits, so that taps cover several rows' tokens.
    auto forward = [&](const gemma4::ForwardOptions& options, std::vector<float>* logits,
                       std::vector<HostTensor>* captured) {
      SequenceKv ka = model->new_sequence(), kb = model->new_sequence();
      const gemma4::ForwardRow rows[] = {{.kv = &ka, .tokens = a, .all_logits = true},
                                         {.kv = &kb, .tokens = b, .all_logits = false}};
      const gemma4::ForwardOutput& out = model->forward(rows, options);
      logits->resize(static_cast<size_t>(out.logits.numel()));
      be.download(out.logits, logits->data());
      if (captured) *captured = std::move(const_cast<gemma4::ForwardOutput&>(out).layer_hidden);
    };
    const int64_t M = static_cast<int64_t>(a.size() + b.size());
    std::vector<float> plain, with_taps, ignored;
    forward({}, &plain, nullptr);
    std::vector<HostTensor> captured;
    forward({.capture_layer_hidden = true}, &ignored, &captured);
    ASSERT_EQ(static_cast<int>(captured.size()), L + 1);

    const std::vector<int> layers = {L, 0, 1, L / 2, L - 1};
    DeviceBuffer tap_buf(be, static_cast<size_t>(layers.size() * M * H) * sizeof(float));
    gemma4::ForwardOptions options;
    options.tap_layers = layers;
    options.tap_out = tap_buf.view(DType::kF32, {static_cast<int64_t>(layers.size()), M, H});
    forward(options, &with_taps, nullptr);
    ASSERT_EQ(with_taps.size(), plain.size());
    EXPECT_EQ(std::memcmp(with_taps.data(), plain.data(), plain.size() * sizeof(float)), 0)
        << name << ": taps changed the logits";
    std::vector<float> got(static_cast<size_t>(layers.size() * M * H));
    be.download(options.tap_out, got.data());
    for (size_t k = 0; k < layers.size(); ++k) {
      const float* want = captured[static_cast<size_t>(layers[k])].view().data_as<const float>();
      EXPECT_EQ(
          std::memcmp(got.data() + k * M * H, want, static_cast<size_t>(M * H) * sizeof(float)), 0)
          << name << ": tap of hidden_states[" << layers[k] << "]";
    }
    // Bad taps are refused, naming the layer or the shape.
    options.tap_layers = std::span<const int>(layers.data(), 1);
    EXPECT_THROW(forward(options, &ignored, nullptr), Error);  // tap_out has 5 taps, not 1
    const int too_far[] = {L + 1};
    options.tap_layers = too_far;
    options.tap_out = tap_buf.view(DType::kF32, {1, M, H});
    EXPECT_THROW(forward(options, &ignored, nullptr), Error);
  }
}

}  // namespace
}  // namespace specula
