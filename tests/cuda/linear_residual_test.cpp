// SPDX-License-Identifier: Apache-2.0
// CudaBackend::linear_residual against the CPU reference: the fused bf16 path
// (K = 64, 128, 256, 512; DSpark's Markov head shape) and the fallback
// (f32 weights, K off the fused sizes), with and without a row index, one
// row and many; bit-exact batch invariance (a row's output alone equals the
// same row among others), and argument errors.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <vector>

#include "engine/backend/cuda/cuda_backend.h"
#include "tests/cuda/cuda_test_util.h"

namespace specula::test {
namespace {

struct ResidualCase {
  DType w_dtype;
  int64_t m, n, k;
  bool indexed;  // residual rows picked by index from a larger table
};

// The run of one case on a backend pair: y = residual[rows] + x·wᵀ.
struct ResidualRun {
  Twin x, w, residual, rows, y;
  int64_t table_rows;
  ResidualRun(const ResidualCase& c, uint64_t seed)
      : x(DType::kF32, {c.m, c.k}),
        w(c.w_dtype, {c.n, c.k}),
        residual(DType::kF32, {c.indexed ? c.m + 5 : c.m, c.n}),
        rows(DType::kI32, {c.m}),
        y(DType::kF32, {c.m, c.n}),
        table_rows(c.indexed ? c.m + 5 : c.m) {
    x.randomize(seed);
    w.randomize(seed + 1);
    residual.randomize(seed + 2, -30.0f, 30.0f);
    for (int64_t i = 0; i < c.m; ++i)
      rows.host.data<int32_t>()[i] = static_cast<int32_t>((7 * i + 3) % table_rows);
    rows.push();
    for (int64_t i = 0; i < y.host.numel(); ++i) y.host.data<float>()[i] = NAN;
    y.push();
  }
};

class CudaLinearResidual : public ::testing::TestWithParam<ResidualCase> {};

TEST_P(CudaLinearResidual, MatchesCpuAndIsBatchInvariant) {
  SKIP_WITHOUT_CUDA();
  const ResidualCase c = GetParam();
  ResidualRun r(c, 40 + static_cast<uint64_t>(c.k));
  const Tensor cpu_rows = c.indexed ? r.rows.host.view() : Tensor();
  const Tensor gpu_rows = c.indexed ? r.rows.dev : Tensor();
  HostTensor want(DType::kF32, {c.m, c.n});
  cpu_be().linear_residual(r.x.host, r.w.host, r.residual.host, cpu_rows, want);
  gpu_be().linear_residual(r.x.dev, r.w.dev, r.residual.dev, gpu_rows, r.y.dev);
  const HostTensor got = r.y.pull();
  // f32 accumulation on both sides; only the order of the sum differs.
  expect_close(got, want, 1e-5f, "linear_residual");

  // Each row alone (a one-row call; indexed: a one-row index) gives the bits it had among all.
  for (const int64_t m : {int64_t{0}, c.m / 2, c.m - 1}) {
    Twin one(DType::kF32, {1, c.n});
    const Tensor x1 = r.x.dev.slice_rows(m, m + 1);
    if (c.indexed) {
      gpu_be().linear_residual(x1, r.w.dev, r.residual.dev, r.rows.dev.slice_rows(m, m + 1),
                               one.dev);
    } else {
      gpu_be().linear_residual(x1, r.w.dev, r.residual.dev.slice_rows(m, m + 1), Tensor(), one.dev);
    }
    const HostTensor alone = one.pull();
    ASSERT_EQ(std::memcmp(alone.view().data(), got.data<float>() + m * c.n,
                          static_cast<size_t>(c.n) * sizeof(float)),
              0)
        << "row " << m << " of " << c.m << " differs when computed alone";
  }
}

INSTANTIATE_TEST_SUITE_P(
    Shapes, CudaLinearResidual,
    ::testing::Values(ResidualCase{DType::kBF16, 1, 4099, 256, false},  // Markov head, batch 1
                      ResidualCase{DType::kBF16, 9, 1000, 256, true},   // batched rows by index
                      ResidualCase{DType::kBF16, 3, 37, 64, true},
                      ResidualCase{DType::kBF16, 2, 515, 128, false},
                      ResidualCase{DType::kBF16, 17, 33, 512, true},
                      ResidualCase{DType::kBF16, 4, 1, 256, true},   // the confidence term: N = 1
                      ResidualCase{DType::kBF16, 2, 300, 96, true},  // K off the fused sizes
                      ResidualCase{DType::kF32, 5, 700, 256, true},
                      ResidualCase{DType::kF32, 1, 64, 100, false}));

TEST(CudaLinearResidualErrors, NamesTheBadArgument) {
  SKIP_WITHOUT_CUDA();
  Twin x(DType::kF32, {2, 64}), w(DType::kBF16, {10, 64}), res(DType::kF32, {3, 10}),
      y(DType::kF32, {2, 10});
  try {
    gpu_be().linear_residual(x.dev, w.dev, res.dev, Tensor(), y.dev);
    FAIL() << "a 3-row residual without rows for 2 rows of x was accepted";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("residual"), std::string::npos) << e.what();
  }
}

}  // namespace
}  // namespace specula::test
