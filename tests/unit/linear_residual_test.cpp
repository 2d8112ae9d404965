// SPDX-License-Identifier: Apache-2.0
// CpuBackend::linear_residual: the bits of linear() then add() with the
// residual rows picked by index (or in order), and clear errors for bad
// arguments.
#include <gtest/gtest.h>

#include <cstring>
#include <string>

#include "engine/backend/backends.h"
#include "engine/core/buffer.h"
#include "engine/core/error.h"
#include "tests/unit/test_util.h"

namespace specula {
namespace {

Backend& cpu() {
  return backend_for(Device::cpu());
}

HostTensor random(DType dtype, Shape shape, uint64_t seed, float lo = -1.0f, float hi = 1.0f) {
  HostTensor t(dtype, std::move(shape));
  cpu().fill_uniform(t, seed, lo, hi);
  return t;
}

TEST(LinearResidual, IsLinearThenAddOfTheIndexedRows) {
  for (const DType wt : {DType::kBF16, DType::kF32}) {
    const int64_t M = 4, N = 37, K = 64, R = 6;
    const HostTensor x = random(DType::kF32, {M, K}, 1);
    const HostTensor w = random(wt, {N, K}, 2);
    const HostTensor table = random(DType::kF32, {R, N}, 3, -20.0f, 20.0f);
    HostTensor rows(DType::kI32, {M});
    const int32_t picks[M] = {5, 0, 5, 2};
    std::memcpy(rows.data<int32_t>(), picks, sizeof(picks));

    HostTensor got(DType::kF32, {M, N});
    cpu().linear_residual(x, w, table, rows, got);

    HostTensor product(DType::kF32, {M, N}), gathered(DType::kF32, {M, N}),
        want(DType::kF32, {M, N});
    cpu().linear(x, w, product);
    cpu().gather_rows(table, rows, gathered);
    cpu().add(gathered, product, want);
    EXPECT_EQ(std::memcmp(got.data<float>(), want.data<float>(), sizeof(float) * M * N), 0)
        << dtype_name(wt);

    // Without an index the residual is read row for row.
    HostTensor got_plain(DType::kF32, {M, N});
    cpu().linear_residual(x, w, gathered, Tensor(), got_plain);
    EXPECT_EQ(std::memcmp(got_plain.data<float>(), want.data<float>(), sizeof(float) * M * N), 0)
        << dtype_name(wt);
  }
}

using testing::error_of;

TEST(LinearResidual, RejectsBadArguments) {
  const HostTensor x = random(DType::kF32, {2, 8}, 1);
  const HostTensor w = random(DType::kBF16, {5, 8}, 2);
  const HostTensor table = random(DType::kF32, {3, 5}, 3);
  HostTensor y(DType::kF32, {2, 5});
  HostTensor rows(DType::kI32, {2});
  rows.data<int32_t>()[0] = 0;
  rows.data<int32_t>()[1] = 3;  // past the table's 3 rows
  EXPECT_NE(error_of([&] { cpu().linear_residual(x, w, table, rows, y); }).find("rows"),
            std::string::npos);
  // No index: the residual must have x's rows.
  EXPECT_NE(error_of([&] { cpu().linear_residual(x, w, table, Tensor(), y); }).find("residual"),
            std::string::npos);
  const HostTensor narrow = random(DType::kF32, {2, 4}, 4);
  EXPECT_NE(error_of([&] { cpu().linear_residual(x, w, narrow, Tensor(), y); }).find("columns"),
            std::string::npos);
  // y may not be the residual.
  HostTensor same = random(DType::kF32, {2, 5}, 5);
  EXPECT_NE(error_of([&] { cpu().linear_residual(x, w, same, Tensor(), same); }).find("overlaps"),
            std::string::npos);
}

}  // namespace
}  // namespace specula
