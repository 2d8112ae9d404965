// SPDX-License-Identifier: Apache-2.0
// The step limits `specula bench --micro` measures against (apps/cli/step_limits.h):
// the attention flops against a brute-force count of visible keys, forward
// flops' composition, and the limit max(memory time, compute time).
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>

#include "apps/cli/step_limits.h"
#include "engine/model/gemma4/presets.h"

namespace specula::cli {
namespace {

// Σ over layers and queries of 4·Nh·D·(keys the query sees), counted key by key.
double attention_flops_brute(const gemma4::Gemma4Config& c, int64_t first, int64_t tokens) {
  double flops = 0;
  for (const gemma4::LayerSpec& l : c.layers) {
    for (int64_t p = first; p < first + tokens; ++p) {
      int64_t keys = 0;
      for (int64_t k = 0; k <= p; ++k) {
        const bool in_window = l.type != gemma4::LayerType::kSliding || k > p - c.sliding_window;
        keys += in_window ? 1 : 0;
      }
      flops += 4.0 * c.num_attention_heads * l.head_dim * static_cast<double>(keys);
    }
  }
  return flops;
}

TEST(StepLimits, AttentionFlopsCountEveryVisibleKey) {
  for (const char* preset : {"e2b", "31b", "26b-a4b"}) {
    gemma4::Gemma4Config c = gemma4::gemma4_preset(preset);
    c.sliding_window = 16;  // small, so that the brute force stays quick
    for (const auto& [first, tokens] :
         {std::pair<int64_t, int64_t>{0, 1}, {0, 40}, {5, 5}, {15, 3}, {16, 1}, {100, 9}}) {
      const double want = attention_flops_brute(c, first, tokens);
      EXPECT_DOUBLE_EQ(attention_flops(c, first, tokens), want)
          << preset << " first " << first << " tokens " << tokens;
    }
  }
}

TEST(StepLimits, ForwardFlopsAddProductsLogitsAndAttentionPerRow) {
  const gemma4::Gemma4Config c = gemma4::gemma4_preset("31b");
  const double params = linear_params_per_token(c);
  EXPECT_GT(params, 25e9);  // the 31B shape: ~30 billion parameters a token multiplies by
  EXPECT_LT(params, 33e9);
  const double head = 2.0 * c.vocab_size * c.hidden_size;
  const double one = forward_flops(c, 1, 512, 1, 1);
  EXPECT_DOUBLE_EQ(one, 2 * params + head + attention_flops(c, 512, 1));
  EXPECT_DOUBLE_EQ(forward_flops(c, 64, 512, 1, 1), 64 * one);
  EXPECT_DOUBLE_EQ(forward_flops(c, 8, 512, 5, 5),
                   8 * (10 * params + 5 * head + attention_flops(c, 512, 5)));
  EXPECT_DOUBLE_EQ(prefill_flops(c, 4096), forward_flops(c, 1, 0, 4096, 1));
}

TEST(StepLimits, KvBytesFollowTheCacheDtype) {
  const gemma4::Gemma4Config c = gemma4::gemma4_preset("31b");
  const int64_t f32 = kv_bytes_read(c, 512, DType::kF32);
  EXPECT_EQ(kv_bytes_read(c, 512, DType::kBF16) * 2, f32);
  // fp8: a byte an element plus one f32 scale a (row, kv head).
  EXPECT_GT(kv_bytes_read(c, 512, DType::kF8E4M3) * 4, f32);
  EXPECT_LT(kv_bytes_read(c, 512, DType::kF8E4M3) * 3, f32);
  // Past the window only the full layers read more.
  gemma4::Gemma4Config only_full = c;
  std::erase_if(only_full.layers,
                [](const gemma4::LayerSpec& l) { return l.type == gemma4::LayerType::kSliding; });
  ASSERT_FALSE(only_full.layers.empty());
  ASSERT_LT(only_full.layers.size(), c.layers.size());
  EXPECT_EQ(kv_bytes_read(c, c.sliding_window + 100, DType::kBF16) -
                kv_bytes_read(c, c.sliding_window, DType::kBF16),
            kv_bytes_read(only_full, 100, DType::kBF16));
}

TEST(StepLimits, TheLimitIsTheSlowerOfMemoryAndCompute) {
  // 4 GB at 4 TB/s: 1 ms; 0.5 TFLOP at 1 PFLOP/s: 0.5 ms: memory bound.
  StepLimit s = step_limit(4e9, 0.5e12, 4e12, 1e15);
  EXPECT_DOUBLE_EQ(s.seconds, 1e-3);
  EXPECT_EQ(s.bound, "memory");
  EXPECT_DOUBLE_EQ(s.fraction(2e-3), 0.5);
  s = step_limit(4e9, 3e12, 4e12, 1e15);
  EXPECT_DOUBLE_EQ(s.seconds, 3e-3);
  EXPECT_EQ(s.bound, "compute");
  EXPECT_DOUBLE_EQ(s.compute_seconds, 3e-3);
  EXPECT_DOUBLE_EQ(s.memory_seconds, 1e-3);
}

}  // namespace
}  // namespace specula::cli
