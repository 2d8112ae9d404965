// SPDX-License-Identifier: Apache-2.0
// logprob_rows on CUDA against the CPU reference: candidate logprobs and the
// top n (ids exactly, values within f32 rounding of the two sums' orders).
#include <gtest/gtest.h>

#include <limits>
#include <vector>

#include "tests/cuda/cuda_test_util.h"

namespace specula::test {
namespace {

TEST(CudaLogprobs, LogprobRowsMatchesTheCpu) {
  SKIP_WITHOUT_CUDA();
  struct Case {
    int64_t R, V, M, C, n;
  };
  uint64_t seed = 1200;
  for (const Case c : {Case{1, 1, 1, 1, 1}, Case{3, 50, 4, 2, 20}, Case{4, 262144, 6, 1, 20},
                       Case{2, 5000, 3, 0, 5}, Case{2, 5000, 3, 2, 0}}) {
    Twin logits(DType::kF32, {c.R, c.V});
    logits.randomize(seed++, -30.0f, 30.0f);
    if (c.V >= 50) {  // ties at the top of row 0: lower id first
      float* h = logits.host.data<float>();
      h[7] = h[3] = h[c.V - 1] = 31.0f;
      logits.push();
    }
    Twin rows(DType::kI32, {c.M});
    Twin ids(DType::kI32, {c.M, c.C});
    for (int64_t m = 0; m < c.M; ++m) {
      rows.host.data<int32_t>()[m] = static_cast<int32_t>((m * 7 + 1) % c.R);
      for (int64_t k = 0; k < c.C; ++k)
        ids.host.data<int32_t>()[m * c.C + k] = static_cast<int32_t>((m * 131 + k * 17) % c.V);
    }
    rows.push();
    ids.push();
    Twin lp(DType::kF32, {c.M, c.C});
    Twin top_ids(DType::kI32, {c.M, c.n});
    Twin top_values(DType::kF32, {c.M, c.n});
    LogprobRowsParams cpu{.logits = logits.host, .rows = rows.host};
    LogprobRowsParams gpu{.logits = logits.dev, .rows = rows.dev};
    if (c.C > 0) {
      cpu.ids = ids.host;
      cpu.logprobs = lp.host;
      gpu.ids = ids.dev;
      gpu.logprobs = lp.dev;
    }
    if (c.n > 0) {
      cpu.top_ids = top_ids.host;
      cpu.top_values = top_values.host;
      gpu.top_ids = top_ids.dev;
      gpu.top_values = top_values.dev;
    }
    cpu_be().logprob_rows(cpu);
    gpu_be().logprob_rows(gpu);
    // Logprobs are O(10) here: 1e-5 relative is well under 1e-4 absolute.
    if (c.C > 0) expect_close(lp.pull(), lp.host, 1e-5f, "logprobs");
    if (c.n > 0) {
      expect_equal_i32(top_ids.pull(), top_ids.host, "top_ids");
      expect_close(top_values.pull(), top_values.host, 1e-5f, "top_values");
    }
  }
  Twin logits(DType::kF32, {2, 8});
  Twin rows(DType::kI32, {2});
  Twin too_many(DType::kI32, {2, 21});
  Twin too_many_v(DType::kF32, {2, 21});
  EXPECT_THROW(gpu_be().logprob_rows({.logits = logits.dev,
                                      .rows = rows.dev,
                                      .top_ids = too_many.dev,
                                      .top_values = too_many_v.dev}),
               Error);
}

}  // namespace
}  // namespace specula::test
