// SPDX-License-Identifier: Apache-2.0
// Shared by the CPU backend tests (tests/unit/cpu_backend_*_test.cpp) and the
// CUDA cross-backend tests (tests/cuda/attention_test.cpp): the check that a
// call throws an Error naming given parts, and builders of attention inputs.
// Backend-neutral: nothing here needs CUDA, so the CPU test binary includes it.
#pragma once

#include <gtest/gtest.h>

#include <cstdint>
#include <string>
#include <vector>

#include "engine/core/error.h"
#include "engine/ops/backend.h"

namespace specula::testing {

// Runs `f`, expects an Error whose message contains every string in `parts`
// (parts must not be empty).
template <typename F>
inline void expect_error(F f, const std::vector<std::string>& parts) {
  try {
    f();
    ADD_FAILURE() << "expected an Error mentioning " << parts.front();
  } catch (const Error& e) {
    const std::string msg = e.what();
    for (const auto& p : parts)
      EXPECT_NE(msg.find(p), std::string::npos) << "'" << p << "' not in: " << msg;
  }
}

// AttentionParams over the given tensors (host or device views, not owned):
// q, out f32 [S, H, D]; k, v [T, Hkv, D]; positions i32 [S]. The fields not
// named here (ring_keys, positions_bound, ...) keep their defaults.
inline AttentionParams attention_params(const Tensor& q, const Tensor& k, const Tensor& v,
                                        const Tensor& out, const Tensor& positions, int64_t k_pos0,
                                        bool causal, int window, float scale) {
  return AttentionParams{.q = q,
                         .k = k,
                         .v = v,
                         .out = out,
                         .q_positions = positions,
                         .k_pos0 = k_pos0,
                         .causal = causal,
                         .window = window,
                         .scale = scale};
}

// The positions of the last s of t keys that start at position k_pos0
// (k_pos0 + t - s, ..., k_pos0 + t - 1): a verify window or prefill chunk at
// the end of the cache.
inline std::vector<int32_t> last_positions(int64_t s, int64_t t, int64_t k_pos0 = 0) {
  std::vector<int32_t> positions;
  for (int64_t i = 0; i < s; ++i) positions.push_back(static_cast<int32_t>(k_pos0 + t - s + i));
  return positions;
}

}  // namespace specula::testing
