// SPDX-License-Identifier: Apache-2.0
// Shared helpers of the lab tests: a seeded random source whose values are the
// same on every standard library (std::*_distribution is not specified bit for
// bit), and a scratch folder per test.
#pragma once

#include <unistd.h>

#include <cmath>
#include <cstdint>
#include <filesystem>
#include <string>
#include <vector>

#include "engine/lab/calibration.h"

namespace specula::lab::testing {

// SplitMix64 (Steele, Lea, Flood 2014): tiny, and fully specified here.
class Rng {
 public:
  explicit Rng(uint64_t seed) : state_(seed) {}
  uint64_t next() {
    uint64_t z = (state_ += 0x9e3779b97f4a7c15ULL);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ULL;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebULL;
    return z ^ (z >> 31);
  }
  // Uniform in [0, 1) with 53 random bits.
  double uniform() { return static_cast<double>(next() >> 11) * 0x1.0p-53; }
  double uniform(double lo, double hi) { return lo + (hi - lo) * uniform(); }

 private:
  uint64_t state_;
};

// Rounds of a drafter whose confidence head is miscalibrated by known
// temperatures: at each position the true conditional acceptance is p =
// σ(z), z uniform in [z_lo, z_hi], and the head reports c = σ(T_k · z), so
// σ(logit(c) / T_k) = p exactly; the round accepts drafts while a Bernoulli(p)
// at each position succeeds.
inline std::vector<DraftRound> miscalibrated_rounds(int count, const std::vector<double>& temps,
                                                    uint64_t seed, double z_lo = -1.0,
                                                    double z_hi = 3.0) {
  Rng rng(seed);
  std::vector<DraftRound> rounds(count);
  for (DraftRound& round : rounds) {
    bool alive = true;
    for (double t : temps) {
      const double z = rng.uniform(z_lo, z_hi);
      const double p = 1.0 / (1.0 + std::exp(-z));
      round.confidences.push_back(1.0 / (1.0 + std::exp(-t * z)));
      alive = alive && rng.uniform() < p;
      round.accepted += alive ? 1 : 0;
    }
  }
  return rounds;
}

// A fresh folder under the system's temporary directory, removed on scope exit.
class ScratchDir {
 public:
  explicit ScratchDir(const std::string& tag)
      : path_(std::filesystem::temp_directory_path() /
              ("specula_lab_" + tag + "_" + std::to_string(::getpid()))) {
    std::filesystem::remove_all(path_);
    std::filesystem::create_directories(path_);
  }
  ~ScratchDir() {
    std::error_code ec;
    std::filesystem::remove_all(path_, ec);
  }
  ScratchDir(const ScratchDir&) = delete;
  ScratchDir& operator=(const ScratchDir&) = delete;
  std::string file(const std::string& name) const { return (path_ / name).string(); }

 private:
  std::filesystem::path path_;
};

}  // namespace specula::lab::testing
