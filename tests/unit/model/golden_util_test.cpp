// SPDX-License-Identifier: Apache-2.0
// The parity measure itself: a NaN or Inf anywhere fails every tolerance.
#include <gtest/gtest.h>

#include <cmath>
#include <limits>
#include <vector>

#include "engine/core/buffer.h"
#include "tests/unit/model/golden_util.h"

namespace specula::testing {
namespace {

constexpr float kNaN = std::numeric_limits<float>::quiet_NaN();
constexpr float kInf = std::numeric_limits<float>::infinity();
constexpr double kTolerance = 1e-5;  // the tightest bound the parity tests use

double error_of(std::vector<float> got, std::vector<float> want) {
  return relative_error(got.data(), want.data(), static_cast<int64_t>(want.size()));
}

TEST(GoldenUtil, RelativeErrorOfFiniteValues) {
  EXPECT_EQ(error_of({1, 2, 4}, {1, 2, 4}), 0.0);
  EXPECT_DOUBLE_EQ(error_of({1, 2.5f, 4}, {1, 2, 4}), 0.5 / 4);
}

TEST(GoldenUtil, NonFiniteOutputFailsEveryTolerance) {
  EXPECT_FALSE(error_of({kNaN, kNaN, kNaN}, {1, 2, 4}) < kTolerance);  // all NaN
  EXPECT_FALSE(error_of({1, kNaN, 4}, {1, 2, 4}) < kTolerance);
  EXPECT_FALSE(error_of({1, 2, kInf}, {1, 2, 4}) < kTolerance);
  EXPECT_FALSE(error_of({1, 2, -kInf}, {1, 2, 4}) < 1e30);
}

TEST(GoldenUtil, NonFiniteReferenceFailsEveryTolerance) {
  EXPECT_FALSE(error_of({1, 2, 4}, {1, kNaN, 4}) < kTolerance);
  EXPECT_FALSE(error_of({1, 2, 4}, {1, 2, kInf}) < kTolerance);  // would divide to 0
  EXPECT_FALSE(error_of({1, 2, kInf}, {1, 2, kInf}) < kTolerance);
}

TEST(GoldenUtil, TensorOverloadSeesNaN) {
  HostTensor got(DType::kF32, {2, 2}), want(DType::kF32, {2, 2});
  for (int i = 0; i < 4; ++i) {
    got.data<float>()[i] = kNaN;
    want.data<float>()[i] = static_cast<float>(i);
  }
  EXPECT_FALSE(relative_error(got.view(), want.view()) < kTolerance);
}

}  // namespace
}  // namespace specula::testing
