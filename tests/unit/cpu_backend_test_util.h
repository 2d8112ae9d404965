// SPDX-License-Identifier: Apache-2.0
// Shared by the CPU backend tests (cpu_backend_test.cpp,
// cpu_backend_attention_test.cpp, cpu_backend_elementwise_test.cpp): exact
// decodes and builders of host tensors, the tolerance check, and the
// CpuBackendTest fixture (a CPU backend and a seeded generator); with
// op_test_util.h (expect_error, attention inputs), which the CUDA tests share.
// Each test file opens its anonymous namespace with `using namespace testing;`
// (specula::testing, the unit tests' helper namespace).
//
// Tolerance: an f32 result passes when |got - ref| <= 1e-5 · (|ref| + rms(ref)),
// i.e. 1e-5 relative, with the tensor's RMS as the floor so elements that cancel
// to near zero are judged on the tensor's scale. Inputs in bf16/f16 are decoded
// exactly, so they share the f32 tolerance.
#pragma once

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <memory>
#include <numbers>
#include <random>
#include <string>
#include <vector>

#include "engine/backend/backends.h"
#include "engine/core/buffer.h"
#include "tests/unit/op_test_util.h"

namespace specula::testing {

inline constexpr double kRtol = 1e-5;
inline constexpr float kInf = std::numeric_limits<float>::infinity();

// Exact decode of any float tensor (f32/bf16/f16) to double.
inline std::vector<double> to_double(const Tensor& t) {
  std::vector<double> v(static_cast<size_t>(t.numel()));
  for (int64_t i = 0; i < t.numel(); ++i) {
    switch (t.dtype()) {
      case DType::kF32:
        v[i] = t.data_as<const float>()[i];
        break;
      case DType::kBF16:
        v[i] = bf16_to_f32(t.data_as<const uint16_t>()[i]);
        break;
      case DType::kF16:
        v[i] = f16_to_f32(t.data_as<const uint16_t>()[i]);
        break;
      default:
        ADD_FAILURE() << "to_double: not a float tensor " << t.describe();
    }
  }
  return v;
}

inline HostTensor make_float(DType dtype, Shape shape, const std::vector<float>& values) {
  HostTensor t(dtype, shape);
  EXPECT_EQ(static_cast<int64_t>(values.size()), t.numel());
  for (size_t i = 0; i < values.size(); ++i) {
    switch (dtype) {
      case DType::kF32:
        t.data<float>()[i] = values[i];
        break;
      case DType::kBF16:
        t.data<uint16_t>()[i] = f32_to_bf16(values[i]);
        break;
      case DType::kF16:
        t.data<uint16_t>()[i] = f32_to_f16(values[i]);
        break;
      default:
        ADD_FAILURE() << "make_float: not a float dtype";
    }
  }
  return t;
}

inline HostTensor make_i32(Shape shape, const std::vector<int32_t>& values) {
  HostTensor t(DType::kI32, shape);
  EXPECT_EQ(static_cast<int64_t>(values.size()), t.numel());
  std::copy(values.begin(), values.end(), t.data<int32_t>());
  return t;
}

// Asserts the tolerance stated at the top of the file; reports the worst element.
inline void expect_close(const Tensor& got, const std::vector<double>& ref, const std::string& what,
                         double rtol = kRtol) {
  ASSERT_EQ(got.dtype(), DType::kF32) << what;
  ASSERT_EQ(static_cast<size_t>(got.numel()), ref.size()) << what;
  double sq = 0.0;
  for (double r : ref) sq += r * r;
  const double rms = ref.empty() ? 0.0 : std::sqrt(sq / static_cast<double>(ref.size()));
  const float* g = got.data_as<const float>();
  int64_t bad = 0;
  int64_t worst = -1;
  double worst_ratio = 0.0;
  for (size_t i = 0; i < ref.size(); ++i) {
    const double err = std::abs(static_cast<double>(g[i]) - ref[i]);
    const double allowed = rtol * (std::abs(ref[i]) + rms);
    const double ratio = allowed > 0 ? err / allowed : (err > 0 ? kInf : 0.0);
    if (!(err <= allowed)) ++bad;  // also catches NaN
    if (!(ratio <= worst_ratio)) {
      worst_ratio = ratio;
      worst = static_cast<int64_t>(i);
    }
  }
  EXPECT_EQ(bad, 0) << what << ": " << bad << " of " << ref.size()
                    << " elements out of tolerance; worst at " << worst << ": got "
                    << (worst >= 0 ? g[worst] : 0.0f) << ", want "
                    << (worst >= 0 ? ref[worst] : 0.0);
}

inline void expect_bitwise_equal(const float* a, const float* b, int64_t n,
                                 const std::string& what) {
  for (int64_t i = 0; i < n; ++i) {
    ASSERT_EQ(a[i], b[i]) << what << " differs at element " << i;
  }
}

inline double gelu_ref(double x) {
  return 0.5 * x *
         (1.0 + std::tanh(std::sqrt(2.0 / std::numbers::pi) * (x + 0.044715 * x * x * x)));
}

class CpuBackendTest : public ::testing::Test {
 protected:
  std::vector<float> random_values(int64_t n, float lo = -1.0f, float hi = 1.0f) {
    std::uniform_real_distribution<float> dist(lo, hi);
    std::vector<float> v(static_cast<size_t>(n));
    for (float& x : v) x = dist(rng_);
    return v;
  }
  HostTensor random(DType dtype, Shape shape, float lo = -1.0f, float hi = 1.0f) {
    return make_float(dtype, shape, random_values(shape.numel(), lo, hi));
  }
  HostTensor random(Shape shape, float lo = -1.0f, float hi = 1.0f) {
    return random(DType::kF32, shape, lo, hi);
  }

  std::unique_ptr<Backend> backend_owner_ = make_cpu_backend();
  Backend& be_ = *backend_owner_;
  std::mt19937 rng_{20240611};
};

// Whether a and b hold the same bytes.
inline bool same_bits(const HostTensor& a, const HostTensor& b) {
  return a.view().nbytes() == b.view().nbytes() &&
         std::memcmp(a.view().data(), b.view().data(), a.view().nbytes()) == 0;
}

// A copy of t (same dtype, shape and bytes).
inline HostTensor clone(const HostTensor& t) {
  HostTensor c(t.dtype(), t.shape());
  std::memcpy(c.view().data(), t.view().data(), t.view().nbytes());
  return c;
}

}  // namespace specula::testing
