// SPDX-License-Identifier: Apache-2.0
// Helpers shared by the golden-parity tests: fixture paths and error measures.
#pragma once

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <string>
#include <vector>

#include "engine/core/tensor.h"

namespace specula::testing {

inline std::string golden_dir(const std::string& name) {
  return std::string(SPECULA_SOURCE_DIR) + "/tests/golden/" + name;
}

inline bool golden_exists(const std::string& name) {
  return std::filesystem::exists(golden_dir(name) + "/expected.safetensors");
}

// max |a - b| / max |b| over n floats: the relative error the parity tests
// bound. A NaN or Inf on either side gives +inf, which no tolerance accepts
// (std::max alone would skip a NaN and let an all-NaN output pass).
inline double relative_error(const float* x, const float* y, int64_t n) {
  double max_diff = 0, max_ref = 1e-30;
  for (int64_t i = 0; i < n; ++i) {
    if (!std::isfinite(x[i]) || !std::isfinite(y[i])) return INFINITY;
    max_diff = std::max(max_diff, std::fabs(static_cast<double>(x[i]) - y[i]));
    max_ref = std::max(max_ref, std::fabs(static_cast<double>(y[i])));
  }
  return max_diff / max_ref;
}

inline double relative_error(const Tensor& a, const Tensor& b) {
  EXPECT_EQ(a.numel(), b.numel()) << a.describe() << " vs " << b.describe();
  return relative_error(a.data_as<const float>(), b.data_as<const float>(),
                        std::min(a.numel(), b.numel()));
}

inline std::vector<int32_t> to_ids(const Tensor& t) {
  auto s = t.i32();
  return {s.begin(), s.end()};
}

}  // namespace specula::testing
