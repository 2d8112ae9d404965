// SPDX-License-Identifier: Apache-2.0
// SamplingParams: everything a request says about how its tokens are chosen.
// Field meanings and ranges follow the OpenAI / vLLM request fields of the same
// names; validate() rejects out-of-range values with an Error naming the field.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace specula {

struct SamplingParams {
  // 0 selects greedy decoding (argmax of the penalised logits); > 0 divides
  // the logits before the softmax.
  float temperature = 1.0f;
  // Keep the top_k most likely tokens (every token tied with the k-th is kept,
  // as Hugging Face does); 0 or -1 disables it.
  int32_t top_k = 0;
  // Nucleus: keep the smallest most-likely set whose mass is >= top_p; in (0, 1].
  float top_p = 1.0f;
  // Keep tokens whose probability is >= min_p * (largest probability); in [0, 1].
  float min_p = 0.0f;
  // Hugging Face repetition penalty over prompt + generated tokens: a seen
  // token's logit is divided by it when positive, multiplied when negative. > 0.
  float repetition_penalty = 1.0f;
  // OpenAI penalties over generated tokens only: logit -= presence_penalty
  // (once per distinct token) + frequency_penalty * count. Each in [-2, 2].
  float presence_penalty = 0.0f;
  float frequency_penalty = 0.0f;
  // Seeds the request's Rng: equal seeds and inputs give equal tokens.
  uint64_t seed = 0;
  // Generation stops before the first occurrence of any of these strings
  // (none may be empty) or after any of these token ids.
  std::vector<std::string> stop;
  std::vector<int32_t> stop_token_ids;
  // Upper bound on generated tokens; >= 1.
  int32_t max_tokens = 256;

  bool greedy() const { return temperature == 0.0f; }
  bool has_penalties() const {
    return repetition_penalty != 1.0f || presence_penalty != 0.0f || frequency_penalty != 0.0f;
  }
  bool is_stop_token(int32_t token) const;

  // Throws Error naming the first out-of-range field and its value. When
  // vocab_size > 0, stop_token_ids must also lie in [0, vocab_size).
  void validate(int64_t vocab_size = 0) const;
};

}  // namespace specula
