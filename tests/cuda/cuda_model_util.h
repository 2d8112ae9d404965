// SPDX-License-Identifier: Apache-2.0
// Helpers of the CUDA tests that load models (model_cuda_test.cpp,
// sampling_decode_test.cpp, ...): where the golden fixtures live, whether one
// is there, load options for the GPU, and the losslessness check that
// speculation gives plain decoding's tokens.
#pragma once

#include <gtest/gtest.h>

#include <filesystem>
#include <initializer_list>
#include <span>
#include <string>
#include <vector>

#include "engine/draft/drafter.h"
#include "engine/model/gemma4/gemma4.h"
#include "engine/speculative/decoder.h"

namespace specula::test {

inline std::string golden(const std::string& name) {
  return std::string(SPECULA_SOURCE_DIR) + "/tests/golden/" + name;
}
inline bool have(const std::string& name) {
  return std::filesystem::exists(golden(name) + "/expected.safetensors");
}
inline gemma4::LoadOptions on_cuda() {
  gemma4::LoadOptions o;
  o.device = Device::cuda(0);
  return o;
}

// Greedy `reqs` decoded with `drafter` proposing k tokens, for every k in
// `draft_lengths`, give exactly plain decoding's tokens, row by row. `plain`:
// speculative::decode(target, nullptr, reqs, {}) (callers reuse it). `where`
// names the case in a failure; stops at the first row that differs.
inline void expect_speculation_matches_plain(gemma4::Gemma4Model& target, Drafter& drafter,
                                             std::span<const speculative::DecodeRequest> reqs,
                                             const std::vector<speculative::DecodeResult>& plain,
                                             std::initializer_list<int> draft_lengths,
                                             const std::string& where) {
  for (int k : draft_lengths) {
    const auto specd = speculative::decode(target, &drafter, reqs, {.draft_tokens = k});
    for (size_t b = 0; b < reqs.size(); ++b) {
      ASSERT_EQ(specd[b].tokens, plain[b].tokens)
          << where << ": " << reqs.size() << " rows, k " << k << ", row " << b;
    }
  }
}

}  // namespace specula::test
