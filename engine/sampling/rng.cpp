// SPDX-License-Identifier: Apache-2.0
#include "engine/sampling/rng.h"

#include "engine/core/error.h"

namespace specula {
namespace {

constexpr uint64_t rotl(uint64_t x, int k) {
  return (x << k) | (x >> (64 - k));
}

}  // namespace

uint64_t splitmix64_next(uint64_t* state) {
  uint64_t z = (*state += 0x9e3779b97f4a7c15ull);
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  return z ^ (z >> 31);
}

Rng::Rng(uint64_t seed) {
  uint64_t sm = seed;
  for (auto& word : s_) word = splitmix64_next(&sm);
  // splitmix64 is a bijection on its counter, so four consecutive outputs are
  // never all zero; the state is always valid.
}

Rng Rng::from_state(const std::array<uint64_t, 4>& state) {
  SPECULA_CHECK(state[0] | state[1] | state[2] | state[3],
                "Rng::from_state: the all-zero xoshiro256** state is invalid");
  Rng rng;
  rng.s_ = state;
  return rng;
}

uint64_t Rng::next_u64() {
  const uint64_t result = rotl(s_[1] * 5, 7) * 9;
  const uint64_t t = s_[1] << 17;
  s_[2] ^= s_[0];
  s_[3] ^= s_[1];
  s_[1] ^= s_[2];
  s_[0] ^= s_[3];
  s_[2] ^= t;
  s_[3] = rotl(s_[3], 45);
  return result;
}

uint64_t Rng::uniform_bits() {
  return next_u64() >> 11;
}

double Rng::uniform() {
  return static_cast<double>(uniform_bits()) * 0x1.0p-53;
}

}  // namespace specula
