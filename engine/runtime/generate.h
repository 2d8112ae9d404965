// SPDX-License-Identifier: Apache-2.0
// Plain (non-speculative) generation on one sequence: prefill the prompt, then
// decode one token per target forward.
#pragma once

#include <cstdint>
#include <functional>
#include <span>
#include <string>
#include <vector>

#include "engine/model/gemma4/gemma4.h"

namespace specula {

struct GenerateOptions {
  int max_tokens = 32;                  // new tokens at most
  std::vector<int32_t> stop_token_ids;  // generation ends after emitting one of these
  // Called with each new token as soon as it is known; return false to stop.
  std::function<bool(int32_t)> on_token;
};

struct GenerateStats {
  int64_t prompt_tokens = 0;
  int64_t generated_tokens = 0;
  int64_t target_forwards = 0;
  double prefill_seconds = 0;
  double decode_seconds = 0;  // after the first token
  double prefill_tokens_per_second() const;
  double decode_tokens_per_second() const;  // (generated - 1) / decode_seconds
};

struct GenerateResult {
  std::vector<int32_t> tokens;  // new tokens only
  std::string finish_reason;    // "length", "stop" or "callback"
  GenerateStats stats;
};

// Greedy decoding (argmax, lowest id on ties). The prompt must be non-empty and
// prompt + max_tokens must fit the model's context; errors say which is wrong.
GenerateResult generate_greedy(gemma4::Gemma4Model& model, std::span<const int32_t> prompt,
                               const GenerateOptions& options);

}  // namespace specula
