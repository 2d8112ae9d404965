// SPDX-License-Identifier: Apache-2.0
// The counter-based uniform values behind Backend::fill_uniform. constexpr so
// that host and device code (nvcc --expt-relaxed-constexpr) share one
// definition; the arithmetic is exact in double, so every backend rounds the
// same value to f32.
#pragma once

#include <cstdint>

namespace specula {

constexpr uint64_t mix64(uint64_t z) {
  z += 0x9e3779b97f4a7c15ull;
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  return z ^ (z >> 31);
}

// Element `index` of the stream `seed`: uniform in [lo, hi) with 24 random bits.
constexpr float uniform_at(uint64_t seed, uint64_t index, float lo, float hi) {
  const uint64_t z = mix64(mix64(seed) ^ (index * 0xd1342543de82ef95ull));
  const double u = static_cast<double>(z >> 40) * (1.0 / 16777216.0);
  return static_cast<float>(static_cast<double>(lo) +
                            (static_cast<double>(hi) - static_cast<double>(lo)) * u);
}

}  // namespace specula
