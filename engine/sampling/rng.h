// SPDX-License-Identifier: Apache-2.0
// Rng: a seeded, portable random stream (xoshiro256**, state seeded by
// splitmix64). Written here rather than taken from <random> because the
// standard distributions (uniform_real_distribution, ...) may return different
// values on different standard libraries; these bit-exact streams make a seeded
// run reproducible on every platform and across CPU/GPU code paths.
#pragma once

#include <array>
#include <cstdint>

namespace specula {

// splitmix64: advances *state by the golden gamma and returns the mixed value.
// Used to expand one 64-bit seed into xoshiro's 256-bit state.
uint64_t splitmix64_next(uint64_t* state);

class Rng {
 public:
  // The state is four successive splitmix64 outputs from `seed`.
  explicit Rng(uint64_t seed = 0);
  // A generator with an explicit state (tests compare against reference
  // vectors). The all-zero state is invalid (the stream would stay zero).
  static Rng from_state(const std::array<uint64_t, 4>& state);

  // The next raw 64-bit output of xoshiro256**.
  uint64_t next_u64();
  // Uniform double in [0, 1): the top 53 bits of next_u64() scaled by 2^-53,
  // so every value is an exact multiple of 2^-53 and 1.0 never occurs.
  double uniform();
  // The integer behind uniform(): the top 53 bits of next_u64(), so that
  // uniform() == uniform_bits() · 2^-53 exactly. What the device sampling ops
  // take (Backend::sample_rows), since a double need not survive every device.
  uint64_t uniform_bits();

  const std::array<uint64_t, 4>& state() const { return s_; }

 private:
  std::array<uint64_t, 4> s_{};
};

}  // namespace specula
