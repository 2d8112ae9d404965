// SPDX-License-Identifier: Apache-2.0
// Logits -> probabilities -> token. One pipeline serves plain decoding and
// speculative verification: the target's p and the drafter's q must both come
// out of process_logits() with the same SamplingParams, or rejection sampling
// no longer reproduces the target distribution.
//
// Order of operations (the Hugging Face / vLLM convention):
//   1. penalties on the raw logits
//        repetition (HF): for every token in prompt + generated,
//                         logit > 0 ? logit / r : logit * r
//        presence/frequency (OpenAI): for every token in the generated part,
//                         logit -= presence + frequency * count
//   2. temperature:  logit / T   (T == 0: greedy, a one-hot distribution at the
//                    argmax of the penalised logits, lowest index on ties)
//   3. top-k:        keep logits >= the k-th largest (ties with it are kept)
//   4. top-p:        on the softmax of what top-k kept, keep the smallest set of
//                    most likely tokens whose mass is >= top_p (the token that
//                    crosses top_p is kept; equal probabilities are ranked by
//                    lower token id first; at least one token always remains)
//   5. min-p:        keep tokens with p >= min_p * p_max
//   6. renormalise the survivors to sum to 1.
// Tokens whose logit is -inf (masked) get probability 0. NaN or +inf logits
// are rejected with an Error.
#pragma once

#include <cstdint>
#include <limits>
#include <span>
#include <vector>

#include "engine/sampling/rng.h"
#include "engine/sampling/sampling_params.h"

namespace specula {

// The tokens a sequence has seen so far: tokens[0, num_prompt) is the prompt,
// the rest was generated. Repetition penalty looks at all of them, presence and
// frequency penalties at the generated part only (as vLLM does).
struct TokenHistory {
  std::span<const int32_t> tokens;
  size_t num_prompt = 0;
};

// Scratch memory for one vocabulary size, reused across steps so that
// processing a step allocates nothing once the workspace has seen the longest
// history (the per-vocabulary buffers are allocated in the constructor).
// Not thread-safe: one workspace per concurrent caller.
class SamplingWorkspace {
 public:
  explicit SamplingWorkspace(int64_t vocab_size);
  SamplingWorkspace(const SamplingWorkspace&) = delete;
  SamplingWorkspace& operator=(const SamplingWorkspace&) = delete;
  SamplingWorkspace(SamplingWorkspace&&) noexcept = default;
  SamplingWorkspace& operator=(SamplingWorkspace&&) noexcept = default;

  int64_t vocab_size() const { return vocab_size_; }
  // Penalised logits of the last call (f32 [V]).
  std::span<const float> penalised_logits() const { return logits_; }
  // Probabilities of the last process_logits call (f32 [V], sums to 1).
  std::span<const float> probs() const { return probs_; }
  // Token ids with non-zero probability after the last process_logits call,
  // in no particular order.
  std::span<const int32_t> support() const { return support_; }
  // Bytes currently reserved by the workspace (tests use it to check that
  // steady-state steps do not grow it).
  size_t capacity_bytes() const;

 private:
  friend std::span<const float> process_logits(std::span<const float>, const TokenHistory&,
                                               const SamplingParams&, SamplingWorkspace&);
  friend int32_t greedy_token(std::span<const float>, const TokenHistory&, const SamplingParams&,
                              SamplingWorkspace&);
  void load_penalised(std::span<const float> logits, const TokenHistory& history,
                      const SamplingParams& params);

  int64_t vocab_size_ = 0;
  std::vector<float> logits_;     // f32 [V] penalised logits
  std::vector<float> probs_;      // f32 [V] output distribution
  std::vector<float> scratch_;    // f32 [V] top-k selection
  std::vector<int32_t> support_;  // candidate / surviving token ids
  std::vector<int32_t> counts_;   // i32 [V] generated-token counts (zero between calls)
  std::vector<uint8_t> seen_;     // u8 [V] token-seen flags (zero between calls)
  std::vector<int32_t> touched_;  // distinct tokens of the history
};

// Step 1 for one token the history holds: its logit x after the repetition
// penalty (a seen token; -inf stays -inf) and, when it was generated
// `generated` (> 0) times, the presence and frequency penalties. The one
// definition the host pipeline and Backend::apply_penalties_rows share.
inline float penalised_logit(float x, int32_t generated, float repetition, float presence,
                             float frequency) {
  if (repetition != 1.0f && x != -std::numeric_limits<float>::infinity()) {
    x = x > 0.0f ? x / repetition : x * repetition;
  }
  if (generated > 0) x -= presence + frequency * static_cast<float>(generated);
  return x;
}

// Runs the pipeline above and returns the distribution (a view of ws.probs(),
// valid until the next call on `ws`). logits: f32 [V] with V = ws.vocab_size().
// params must be valid (SamplingParams::validate); history ids must be in [0, V).
std::span<const float> process_logits(std::span<const float> logits, const TokenHistory& history,
                                      const SamplingParams& params, SamplingWorkspace& ws);

// Greedy choice: argmax of the penalised logits, lowest index on ties
// (temperature and truncation do not change the argmax).
int32_t greedy_token(std::span<const float> logits, const TokenHistory& history,
                     const SamplingParams& params, SamplingWorkspace& ws);

// Draws one token from `probs` (f32 [V], non-negative, positive sum) by inverse
// CDF with one rng.uniform(): the first index whose running sum exceeds u * sum.
// A token of probability 0 is never returned.
int32_t sample(std::span<const float> probs, Rng& rng);
// sample() with the uniform given: u in [0, 1) replaces rng.uniform().
int32_t sample_at(std::span<const float> probs, double u);

// Greedy when params.greedy(), else process_logits + sample.
int32_t sample_token(std::span<const float> logits, const TokenHistory& history,
                     const SamplingParams& params, SamplingWorkspace& ws, Rng& rng);

}  // namespace specula
