// SPDX-License-Identifier: Apache-2.0
#include "engine/sampling/sampler.h"

#include <algorithm>
#include <cmath>
#include <functional>
#include <limits>

#include "engine/core/error.h"

namespace specula {
namespace {

constexpr float kNegInf = -std::numeric_limits<float>::infinity();

// Ranks token ids by weight, larger first; equal weights by lower id first, so
// the order (and therefore every truncation) is deterministic.
struct ByWeightDesc {
  const float* w;
  bool operator()(int32_t a, int32_t b) const { return w[a] > w[b] || (w[a] == w[b] && a < b); }
};

// Number of leading tokens (in ByWeightDesc order) that top-p keeps: the
// smallest prefix whose weight reaches `target` (= top_p * total weight).
// Reorders `ids` so that this prefix comes first, sorted. Only a growing head
// of the candidates is ever sorted, so a nucleus of a few hundred tokens out of
// a 262k vocabulary costs a few linear selection passes, not a full sort.
size_t nucleus_size(std::vector<int32_t>& ids, const float* w, double target) {
  const size_t n = ids.size();
  const ByWeightDesc order{w};
  size_t m = std::min<size_t>(n, 64);
  while (true) {
    if (m < n)
      std::nth_element(ids.begin(), ids.begin() + static_cast<ptrdiff_t>(m), ids.end(), order);
    double head_mass = 0.0;
    for (size_t j = 0; j < m; ++j) head_mass += w[ids[j]];
    if (head_mass >= target || m == n) {
      std::sort(ids.begin(), ids.begin() + static_cast<ptrdiff_t>(m), order);
      size_t keep = 0;
      double before = 0.0;
      // Keep a token while the mass strictly above it is still short of top_p.
      while (keep < m && before < target) before += w[ids[keep++]];
      return std::max<size_t>(keep, 1);
    }
    m = std::min(n, m * 8);
  }
}

int32_t argmax_lowest(const float* x, int64_t n) {
  int32_t best = 0;
  for (int64_t i = 1; i < n; ++i) {
    if (x[i] > x[best]) best = static_cast<int32_t>(i);
  }
  return best;
}

}  // namespace

SamplingWorkspace::SamplingWorkspace(int64_t vocab_size) : vocab_size_(vocab_size) {
  if (vocab_size <= 0 || vocab_size > std::numeric_limits<int32_t>::max()) {
    fail("SamplingWorkspace: vocab_size = {} is out of range (1 .. 2^31-1)", vocab_size);
  }
  const auto v = static_cast<size_t>(vocab_size);
  logits_.resize(v);
  probs_.resize(v);
  scratch_.resize(v);
  support_.reserve(v);
  counts_.assign(v, 0);
  seen_.assign(v, 0);
}

size_t SamplingWorkspace::capacity_bytes() const {
  return logits_.capacity() * sizeof(float) + probs_.capacity() * sizeof(float) +
         scratch_.capacity() * sizeof(float) + support_.capacity() * sizeof(int32_t) +
         counts_.capacity() * sizeof(int32_t) + seen_.capacity() +
         touched_.capacity() * sizeof(int32_t);
}

void SamplingWorkspace::load_penalised(std::span<const float> logits, const TokenHistory& history,
                                       const SamplingParams& params) {
  if (static_cast<int64_t>(logits.size()) != vocab_size_) {
    fail("sampling: logits have {} entries but the vocabulary has {}", logits.size(), vocab_size_);
  }
  bool any_finite = false;
  for (size_t i = 0; i < logits.size(); ++i) {
    const float x = logits[i];
    if (std::isnan(x) || x == std::numeric_limits<float>::infinity()) {
      fail("sampling: logits[{}] = {} (logits must be finite, or -inf for a masked token)", i, x);
    }
    any_finite |= (x != kNegInf);
    logits_[i] = x;
  }
  if (!any_finite) fail("sampling: all {} logits are -inf, no token can be chosen", vocab_size_);
  if (history.num_prompt > history.tokens.size()) {
    fail("sampling: token history has {} tokens but claims a prompt of {}", history.tokens.size(),
         history.num_prompt);
  }
  if (!params.has_penalties()) return;

  // Gather distinct tokens (all of them for repetition) and generated counts.
  touched_.clear();
  for (size_t i = 0; i < history.tokens.size(); ++i) {
    const int32_t t = history.tokens[i];
    if (t < 0 || t >= vocab_size_) {
      // Undo the partial marks so the workspace stays clean for the next call.
      for (int32_t u : touched_) seen_[u] = 0, counts_[u] = 0;
      touched_.clear();
      fail("sampling: token history[{}] = {} is outside the vocabulary [0, {})", i, t, vocab_size_);
    }
    if (!seen_[t]) {
      seen_[t] = 1;
      touched_.push_back(t);
    }
    if (i >= history.num_prompt) ++counts_[t];
  }
  for (int32_t t : touched_) {
    logits_[t] = penalised_logit(logits_[t], counts_[t], params.repetition_penalty,
                                 params.presence_penalty, params.frequency_penalty);
    seen_[t] = 0;
    counts_[t] = 0;
  }
}

std::span<const float> process_logits(std::span<const float> logits, const TokenHistory& history,
                                      const SamplingParams& params, SamplingWorkspace& ws) {
  ws.load_penalised(logits, history, params);
  const int64_t v = ws.vocab_size_;
  const float* l = ws.logits_.data();
  float* p = ws.probs_.data();
  auto& support = ws.support_;
  support.clear();

  if (params.greedy()) {
    const int32_t best = argmax_lowest(l, v);
    std::fill(ws.probs_.begin(), ws.probs_.end(), 0.0f);
    p[best] = 1.0f;
    support.push_back(best);
    return ws.probs_;
  }

  const float max_logit = l[argmax_lowest(l, v)];
  // Top-k threshold: the k-th largest logit; everything tied with it survives.
  float kth = kNegInf;
  if (params.top_k > 0 && params.top_k < v) {
    std::copy(l, l + v, ws.scratch_.begin());
    const auto nth = ws.scratch_.begin() + (params.top_k - 1);
    std::nth_element(ws.scratch_.begin(), nth, ws.scratch_.end(), std::greater<float>());
    kth = *nth;
  }

  // Unnormalised softmax weights exp((l - max) / T); the argmax gets exactly 1.
  const float temperature = params.temperature;
  double total = 0.0;
  for (int64_t i = 0; i < v; ++i) {
    float w = 0.0f;
    if (l[i] >= kth && l[i] != kNegInf) w = std::exp((l[i] - max_logit) / temperature);
    p[i] = w;
    if (w > 0.0f) {
      support.push_back(static_cast<int32_t>(i));
      total += w;
    }
  }

  if (params.top_p < 1.0f) {
    const size_t keep = nucleus_size(support, p, static_cast<double>(params.top_p) * total);
    for (size_t j = keep; j < support.size(); ++j) p[support[j]] = 0.0f;
    support.resize(keep);
    total = 0.0;
    for (int32_t t : support) total += p[t];
  }

  if (params.min_p > 0.0f) {
    // p_i >= min_p * p_max  <=>  w_i >= min_p, because the largest weight is 1.
    size_t out = 0;
    total = 0.0;
    for (int32_t t : support) {
      if (p[t] >= params.min_p) {
        support[out++] = t;
        total += p[t];
      } else {
        p[t] = 0.0f;
      }
    }
    support.resize(out);
  }

  const double inv_total = 1.0 / total;
  for (int32_t t : support) p[t] = static_cast<float>(p[t] * inv_total);
  return ws.probs_;
}

int32_t greedy_token(std::span<const float> logits, const TokenHistory& history,
                     const SamplingParams& params, SamplingWorkspace& ws) {
  ws.load_penalised(logits, history, params);
  return argmax_lowest(ws.logits_.data(), ws.vocab_size_);
}

int32_t sample(std::span<const float> probs, Rng& rng) {
  return sample_at(probs, rng.uniform());
}

int32_t sample_at(std::span<const float> probs, double u) {
  if (!(u >= 0.0 && u < 1.0)) fail("sample: the uniform {} is outside [0, 1)", u);
  double total = 0.0;
  for (size_t i = 0; i < probs.size(); ++i) {
    const float x = probs[i];
    if (!(x >= 0.0f) || std::isinf(x)) {
      fail("sample: probs[{}] = {} (probabilities must be finite and >= 0)", i, x);
    }
    total += x;
  }
  if (!(total > 0.0)) fail("sample: the distribution over {} tokens has no mass", probs.size());
  const double target = u * total;
  double running = 0.0;
  int32_t last = -1;
  for (size_t i = 0; i < probs.size(); ++i) {
    if (probs[i] > 0.0f) {
      running += probs[i];
      last = static_cast<int32_t>(i);
      if (running > target) return last;
    }
  }
  return last;  // only reachable through rounding at the very end of the CDF
}

int32_t sample_token(std::span<const float> logits, const TokenHistory& history,
                     const SamplingParams& params, SamplingWorkspace& ws, Rng& rng) {
  if (params.greedy()) return greedy_token(logits, history, params, ws);
  return sample(process_logits(logits, history, params, ws), rng);
}

}  // namespace specula
