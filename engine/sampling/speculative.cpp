// SPDX-License-Identifier: Apache-2.0
#include "engine/sampling/speculative.h"

#include <algorithm>

#include "engine/core/error.h"
#include "engine/sampling/sampler.h"

namespace specula {

bool accept_draft(std::span<const float> p, std::span<const float> q, int32_t token, double u) {
  if (p.size() != q.size()) {
    fail("accept_draft: target distribution has {} entries, draft distribution {}", p.size(),
         q.size());
  }
  if (token < 0 || static_cast<size_t>(token) >= p.size()) {
    fail("accept_draft: draft token {} is outside the vocabulary [0, {})", token, p.size());
  }
  const double pt = p[static_cast<size_t>(token)];
  const double qt = q[static_cast<size_t>(token)];
  if (!(pt > 0.0)) return false;
  if (!(qt > 0.0)) return true;  // ratio taken as 1: u < 1 always holds
  return u < std::min(1.0, pt / qt);
}

void residual_distribution(std::span<const float> p, std::span<const float> q,
                           std::span<float> out) {
  if (p.size() != q.size() || p.size() != out.size()) {
    fail("residual_distribution: sizes differ (p {}, q {}, out {})", p.size(), q.size(),
         out.size());
  }
  double mass = 0.0;
  for (size_t i = 0; i < p.size(); ++i) {
    const float r = std::max(p[i] - q[i], 0.0f);
    out[i] = r;
    mass += r;
  }
  if (mass <= 1e-12) {
    mass = 0.0;
    for (size_t i = 0; i < p.size(); ++i) {
      out[i] = p[i];
      mass += p[i];
    }
    if (!(mass > 0.0)) fail("residual_distribution: the target distribution has no mass");
  }
  const double inv = 1.0 / mass;
  for (float& x : out) x = static_cast<float>(x * inv);
}

WindowVerdict verify_window(std::span<const int32_t> drafts, const DistributionAt& p,
                            const DistributionAt& q, std::span<const double> u,
                            std::span<float> residual) {
  const auto k = static_cast<int>(drafts.size());
  if (u.size() != drafts.size() + 1) {
    fail("verify_window: {} drafts need {} uniforms, got {}", k, k + 1, u.size());
  }
  for (int n = 0; n < k; ++n) {
    const std::span<const float> pn = p(n);
    const std::span<const float> qn = q(n);
    if (!accept_draft(pn, qn, drafts[static_cast<size_t>(n)], u[static_cast<size_t>(n)])) {
      residual_distribution(pn, qn, residual);
      return {.accepted = n, .next = sample_at(residual, u[static_cast<size_t>(k)])};
    }
  }
  return {.accepted = k, .next = sample_at(p(k), u[static_cast<size_t>(k)])};
}

}  // namespace specula
