// SPDX-License-Identifier: Apache-2.0
// Model helpers of the KV cache dtype tests (kv_dtype_test.cpp, kv_fp8_test.cpp):
// where the embedded family lives, loading a checkpoint with a given cache
// dtype, and the logits of a prompt read through both cache paths.
#pragma once

#include <gtest/gtest.h>

#include <cstdint>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "engine/model/gemma4/gemma4.h"

namespace specula::testing {

inline std::string models_dir() {
  return std::string(SPECULA_SOURCE_DIR) + "/models";
}

// The checkpoint at `dir` on the CPU with cache dtype `dt` (nullopt: the
// checkpoint's default).
inline std::unique_ptr<gemma4::Gemma4Model> load_with(const std::string& dir,
                                                      std::optional<DType> dt) {
  gemma4::LoadOptions o;
  o.kv_dtype = dt;
  return gemma4::Gemma4Model::load(dir, o);
}

// Logits of every position of a prompt prefilled in one forward (the gathered
// sliding path), then of `decode_steps` single-token decode steps (the
// in-place path): f32 [ids.size(), V] rows concatenated.
inline std::vector<float> prompt_logits(gemma4::Gemma4Model& m, const std::vector<int32_t>& ids,
                                        int decode_steps) {
  SequenceKv kv = m.new_sequence();
  std::vector<float> all;
  auto keep = [&](const Tensor& logits) {
    const size_t at = all.size();
    all.resize(at + static_cast<size_t>(logits.numel()));
    m.backend().download(logits, all.data() + at);
  };
  const std::span<const int32_t> prompt(ids.data(), ids.size() - decode_steps);
  const gemma4::ForwardRow row{.kv = &kv, .tokens = prompt, .all_logits = true};
  keep(m.forward(std::span(&row, 1)).logits);
  for (size_t i = prompt.size(); i < ids.size(); ++i) {
    const gemma4::ForwardRow step{.kv = &kv, .tokens = std::span(&ids[i], 1)};
    keep(m.forward(std::span(&step, 1)).logits);
  }
  EXPECT_EQ(static_cast<int64_t>(all.size()),
            static_cast<int64_t>(ids.size()) * m.config().vocab_size);
  return all;
}

}  // namespace specula::testing
