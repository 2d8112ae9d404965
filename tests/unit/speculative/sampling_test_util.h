// SPDX-License-Identifier: Apache-2.0
// Helpers of the decoding tests on either backend (tests/unit/speculative,
// tests/cuda): greedy requests and
// requests of mixed sampling settings over the same prompts, and Pearson's
// chi-square against an exact distribution.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <vector>

#include "engine/speculative/decoder.h"

namespace specula::testing {

// Prompt i of n: 2 + (i·7) mod 19 tokens (some longer than the fixtures'
// sliding window of 4), ids spread over [3, vocab).
inline std::vector<int32_t> test_prompt(int i, int vocab) {
  std::vector<int32_t> p;
  const int len = 2 + (i * 7) % 19;
  for (int j = 0; j < len; ++j) p.push_back(3 + (i * 31 + j * 17) % (vocab - 3));
  return p;
}

// n greedy requests (test_prompt) of max_tokens each.
inline std::vector<speculative::DecodeRequest> greedy_requests(int n, int vocab, int max_tokens) {
  std::vector<speculative::DecodeRequest> reqs;
  for (int i = 0; i < n; ++i) {
    speculative::DecodeRequest r;
    r.prompt = test_prompt(i, vocab);
    r.params.temperature = 0;
    r.params.max_tokens = max_tokens;
    reqs.push_back(r);
  }
  return reqs;
}

// n requests with prompts of several lengths and mixed settings (temperature,
// top-k, top-p, min-p; every fifth greedy), each with its own seed.
inline std::vector<speculative::DecodeRequest> sampled_requests(int n, int vocab, int max_tokens) {
  std::vector<speculative::DecodeRequest> reqs;
  for (int i = 0; i < n; ++i) {
    speculative::DecodeRequest r;
    r.prompt = test_prompt(i, vocab);
    SamplingParams& p = r.params;
    p.max_tokens = max_tokens;
    p.seed = 7 + 13 * static_cast<uint64_t>(i);
    switch (i % 5) {
      case 0:
        p.temperature = 0.8f;
        p.top_p = 0.9f;
        break;
      case 1:
        p.temperature = 1.0f;
        break;
      case 2:
        p.temperature = 0.6f;
        p.top_k = 20;
        p.min_p = 0.02f;
        break;
      case 3:
        p.temperature = 0.0f;
        break;
      default:
        p.temperature = 1.3f;
        p.top_k = 5;
        p.top_p = 0.7f;
        break;
    }
    reqs.push_back(r);
  }
  return reqs;
}

// sampled_requests with repetition, presence and frequency penalties on two
// rows of three (greedy or sampled), none on the rest, and no stop tokens, so
// every row runs all max_tokens.
inline std::vector<speculative::DecodeRequest> penalised_requests(int n, int vocab, int max_tokens) {
  auto reqs = sampled_requests(n, vocab, max_tokens);
  for (int i = 0; i < n; ++i) {
    SamplingParams& p = reqs[static_cast<size_t>(i)].params;
    p.stop_token_ids.clear();
    if (i % 3 == 1) continue;              // a row without penalties beside them
    if (i % 2 == 0) p.temperature = 0.0f;  // greedy with penalties
    p.repetition_penalty = 1.0f + 0.25f * static_cast<float>(1 + i % 3);
    p.presence_penalty = 0.5f;
    p.frequency_penalty = 0.75f;
  }
  return reqs;
}

// Pearson's chi-square of `counts` (draws in all) against probabilities
// `expected`, over the bins expecting at least 5 (the rest pooled), with the
// 99.9% quantile of its distribution (Wilson-Hilferty).
struct ChiSquare {
  double chi2 = 0, limit = 0;
  int dof = 0;
};
inline ChiSquare chi_square(const std::vector<double>& expected, const std::vector<int64_t>& counts,
                            int draws) {
  double chi2 = 0, pooled_e = 0, pooled_o = 0;
  int dof = -1;
  for (size_t v = 0; v < expected.size(); ++v) {
    const double e = expected[v] * draws;
    if (e >= 5) {
      chi2 += (counts[v] - e) * (counts[v] - e) / e;
      ++dof;
    } else {
      pooled_e += e;
      pooled_o += static_cast<double>(counts[v]);
    }
  }
  if (pooled_e >= 5) {
    chi2 += (pooled_o - pooled_e) * (pooled_o - pooled_e) / pooled_e;
    ++dof;
  }
  const double z = 3.09;
  const double k = std::max(dof, 1);
  return {chi2, k * std::pow(1 - 2 / (9 * k) + z * std::sqrt(2 / (9 * k)), 3), dof};
}

}  // namespace specula::testing
