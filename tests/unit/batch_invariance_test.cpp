// SPDX-License-Identifier: Apache-2.0
// Speculation is exact only if a row's result does not depend on which other
// rows share its forward: decode (1 row), verify (k + 1 rows) and batched rows
// must compute bit-identical values for the same input row. These tests pin
// that property for the ops whose work is shared across rows.
#include <gtest/gtest.h>

#include <cstring>
#include <random>

#include "engine/backend/backends.h"
#include "engine/core/buffer.h"

namespace specula {
namespace {

HostTensor random_tensor(DType dtype, Shape shape, uint32_t seed) {
  HostTensor t(dtype, shape);
  std::mt19937 gen(seed);
  std::normal_distribution<float> dist(0.0f, 1.0f);
  for (int64_t i = 0; i < t.numel(); ++i) {
    const float v = dist(gen);
    if (dtype == DType::kF32) t.data<float>()[i] = v;
    if (dtype == DType::kBF16) t.data<uint16_t>()[i] = f32_to_bf16(v);
  }
  return t;
}

class LinearBatchInvariance : public ::testing::TestWithParam<DType> {};

TEST_P(LinearBatchInvariance, RowResultsDoNotDependOnTheBatch) {
  Backend& be = backend_for(Device::cpu());
  const int64_t K = 300, N = 77;
  HostTensor w = random_tensor(GetParam(), {N, K}, 7);
  HostTensor x = random_tensor(DType::kF32, {64, K}, 11);
  HostTensor y_all(DType::kF32, {64, N});
  be.linear(x, w, y_all);
  for (int64_t m : {1, 2, 5, 8, 9, 17, 33}) {
    HostTensor y(DType::kF32, {m, N});
    // The last row of the first m rows, computed in a batch of m.
    be.linear(x.view().slice_rows(0, m), w, y);
    EXPECT_EQ(
        std::memcmp(y.view().row(m - 1).data(), y_all.view().row(m - 1).data(), N * sizeof(float)),
        0)
        << "row " << m - 1 << " differs between a batch of " << m << " and a batch of 64";
  }
}

INSTANTIATE_TEST_SUITE_P(Dtypes, LinearBatchInvariance,
                         ::testing::Values(DType::kF32, DType::kBF16));

}  // namespace
}  // namespace specula
