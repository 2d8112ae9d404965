// SPDX-License-Identifier: Apache-2.0
// The tiled bf16 products (engine/backend/cuda/cuda_linear_tiled.cu), which
// batches of kTiledMinRows rows and more take: every row must have the bits of
// the same row multiplied alone (the decode path) and of the row-tile kernels
// just below the threshold, for linear, linear_multi and linear_gelu_mul, with
// K split 8 and 4 ways (N past kWideColumns), with K shorter than the K split
// (empty ranges), partial column blocks and partial 64-row groups.
#include <gtest/gtest.h>

#include <cstring>
#include <string>
#include <vector>

#include "engine/backend/cuda/cuda_backend.h"
#include "engine/backend/cuda/cuda_linear_tiled.h"
#include "tests/cuda/cuda_test_util.h"

namespace specula::test {
namespace {

// x [1, K]: row r of x.
Twin row_of(const Twin& x, int64_t r) {
  const int64_t k = x.host.shape().dim(1);
  Twin x1(DType::kF32, {1, k});
  std::memcpy(x1.host.data<float>(), x.host.data<float>() + r * k,
              static_cast<size_t>(k) * sizeof(float));
  x1.push();
  return x1;
}

struct TiledCase {
  int64_t n, k;
};

class CudaLinearTiled : public ::testing::TestWithParam<TiledCase> {};

TEST_P(CudaLinearTiled, RowsHaveTheirOneRowBits) {
  SKIP_WITHOUT_CUDA();
  const ScopedKernelChoices tiled({.tiled_products = true});
  const auto [n, k] = GetParam();
  Twin w(DType::kBF16, {n, k});
  w.randomize(81, -0.5f, 0.5f);
  Twin w2(DType::kBF16, {n / 2 + 3, k});
  w2.randomize(82, -0.5f, 0.5f);
  Twin w_up(DType::kBF16, {n, k});
  w_up.randomize(83, -0.5f, 0.5f);
  const int64_t n2 = n / 2 + 3;
  for (int64_t m : {cuda::kTiledMinRows - 1, cuda::kTiledMinRows, int64_t{64}, int64_t{65},
                    int64_t{130}, int64_t{256}}) {
    Twin x(DType::kF32, {m, k});
    x.randomize(static_cast<uint64_t>(900 + m));
    Twin y = poisoned_output({m, n});
    gpu_be().linear(x.dev, w.dev, y.dev);
    Twin q = poisoned_output({m, n});
    Twin q2 = poisoned_output({m, n2});
    gpu_be().linear_multi(x.dev, std::vector<LinearOut>{{w.dev, q.dev}, {w2.dev, q2.dev}});
    Twin gate = poisoned_output({m, n});
    Twin up = poisoned_output({m, n});
    gpu_be().linear_gelu_mul(x.dev, w.dev, w_up.dev, gate.dev, up.dev);
    const HostTensor y_all = y.pull(), q_all = q.pull(), q2_all = q2.pull(), g_all = gate.pull();

    // The whole product against the CPU once per shape (f32 sums in another order).
    if (m == 64) {
      HostTensor want(DType::kF32, {m, n});
      cpu_be().linear(x.host, w.host, want);
      expect_close(y_all, want, 1e-5f, "tiled linear against the CPU");
    }
    for (int64_t r : {int64_t{0}, m / 2, m - 1}) {
      const Twin x1 = row_of(x, r);
      Twin y1 = poisoned_output({1, n});
      gpu_be().linear(x1.dev, w.dev, y1.dev);
      Twin y2 = poisoned_output({1, n2});
      gpu_be().linear(x1.dev, w2.dev, y2.dev);
      Twin g1 = poisoned_output({1, n});
      Twin u1 = poisoned_output({1, n});
      gpu_be().linear_gelu_mul(x1.dev, w.dev, w_up.dev, g1.dev, u1.dev);
      const HostTensor one = y1.pull(), one2 = y2.pull(), g_one = g1.pull();
      const std::string where = "row " + std::to_string(r) + " of " + std::to_string(m) + " (N " +
                                std::to_string(n) + ", K " + std::to_string(k) + ")";
      EXPECT_TRUE(same_bits(y_all.data<float>() + r * n, one.data<float>(), n))
          << where << ": linear";
      EXPECT_TRUE(same_bits(q_all.data<float>() + r * n, one.data<float>(), n))
          << where << ": linear_multi output 0";
      EXPECT_TRUE(same_bits(q2_all.data<float>() + r * n2, one2.data<float>(), n2))
          << where << ": linear_multi output 1";
      EXPECT_TRUE(same_bits(g_all.data<float>() + r * n, g_one.data<float>(), n))
          << where << ": linear_gelu_mul";
    }
  }
}

INSTANTIATE_TEST_SUITE_P(
    Shapes, CudaLinearTiled,
    ::testing::Values(TiledCase{97, 2816},    // K split 8, partial column blocks
                      TiledCase{256, 96},     // 3 steps over 8 ranges: empty ranges fold zeros
                      TiledCase{16400, 128},  // K split 4 (N > kWideColumns), 4 steps
                      TiledCase{16390, 64}),  // K split 4 with 2 steps: empty ranges
    [](const ::testing::TestParamInfo<TiledCase>& info) {
      return "N" + std::to_string(info.param.n) + "_K" + std::to_string(info.param.k);
    });

// Sign of zero: a row of zeros times weights gives +0 or -0 per output
// depending on the summation, and the tiled fold must give the row-tile
// kernels' signs (the first range's sum is the total; adding +0 to -0 would
// turn it into +0).
TEST(CudaLinearTiledZeros, SignedZerosMatchTheOneRowCall) {
  SKIP_WITHOUT_CUDA();
  const ScopedKernelChoices tiled({.tiled_products = true});
  const int64_t m = 40, n = 64, k = 256;
  Twin w(DType::kBF16, {n, k});
  w.randomize(91, -0.5f, 0.5f);
  Twin x(DType::kF32, {m, k});
  float* xv = x.host.data<float>();
  for (int64_t i = 0; i < m * k; ++i) xv[i] = (i / k) % 2 == 0 ? -0.0f : 0.0f;
  x.push();
  Twin y = poisoned_output({m, n});
  gpu_be().linear(x.dev, w.dev, y.dev);
  const HostTensor all = y.pull();
  for (int64_t r : {int64_t{0}, int64_t{1}, int64_t{39}}) {
    const Twin x1 = row_of(x, r);
    Twin y1 = poisoned_output({1, n});
    gpu_be().linear(x1.dev, w.dev, y1.dev);
    EXPECT_TRUE(same_bits(all.data<float>() + r * n, y1.pull().data<float>(), n)) << "row " << r;
  }
}

}  // namespace
}  // namespace specula::test
