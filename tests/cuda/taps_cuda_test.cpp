// SPDX-License-Identifier: Apache-2.0
// Device taps on CUDA: recorded and replayed steps (CUDA graphs) fill the tap
// buffer with exactly what capture_layer_hidden downloads, and taps leave
// the logits unchanged bit for bit.
#include <gtest/gtest.h>

#include <cstring>

#include "engine/model/gemma4/gemma4.h"
#include "tests/cuda/cuda_model_util.h"
#include "tests/cuda/cuda_test_util.h"

namespace specula {
namespace {

TEST(CudaTaps, ReplayedStepsTapWhatCaptureDownloads) {
  SKIP_WITHOUT_CUDA();
  for (const char* name : {"e2b_like", "e2b_like_bf16", "dense_kev"}) {
    if (!test::have(name)) continue;
    auto model = gemma4::Gemma4Model::load(test::golden(name), test::on_cuda());
    Backend& be = model->backend();
    const int L = model->config().num_hidden_layers;
    const int64_t H = model->config().hidden_size;
    const std::vector<int32_t> a = {5, 17, 33, 2, 90}, b = {3};
    const int64_t M = 6;
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
    std::vector<float> plain, with_taps, ignored;
    for (int i = 0; i < 3; ++i) forward({}, &plain, nullptr);  // recorded, then replayed
    std::vector<HostTensor> captured;
    forward({.capture_layer_hidden = true}, &ignored, &captured);
    ASSERT_EQ(static_cast<int>(captured.size()), L + 1);
    const std::vector<int> layers = {1, L - 1, L};
    DeviceBuffer tap_buf(be, static_cast<size_t>(layers.size() * M * H) * sizeof(float));
    gemma4::ForwardOptions options;
    options.tap_layers = layers;
    options.tap_out = tap_buf.view(DType::kF32, {static_cast<int64_t>(layers.size()), M, H});
    const int64_t replays_before = model->graph_replays();
    std::vector<float> got(static_cast<size_t>(layers.size() * M * H));
    for (int i = 0; i < 3; ++i) {
      std::vector<float> zeros(got.size(), 0.0f);
      be.upload(zeros.data(), options.tap_out);
      forward(options, &with_taps, nullptr);
      EXPECT_EQ(std::memcmp(with_taps.data(), plain.data(), plain.size() * sizeof(float)), 0)
          << name << " call " << i << ": taps changed the logits";
      be.download(options.tap_out, got.data());
      for (size_t k = 0; k < layers.size(); ++k) {
        const float* want = captured[static_cast<size_t>(layers[k])].view().data_as<const float>();
        EXPECT_EQ(
            std::memcmp(got.data() + k * M * H, want, static_cast<size_t>(M * H) * sizeof(float)),
            0)
            << name << " call " << i << ": tap of hidden_states[" << layers[k] << "]";
      }
    }
    EXPECT_GE(model->graph_replays() - replays_before, 1) << name << ": no tapped step replayed";
  }
}

}  // namespace
}  // namespace specula
