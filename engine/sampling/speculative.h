// SPDX-License-Identifier: Apache-2.0
// Speculative-sampling primitives (Leviathan et al. 2023; Chen et al. 2023):
// a drafted token x ~ q is kept with probability min(1, p(x) / q(x)); on
// rejection the replacement is drawn from norm(max(p - q, 0)). Together these
// emit tokens distributed exactly as p. p and q must both be produced by
// process_logits() with the same SamplingParams (sampler.h).
#pragma once

#include <cstdint>
#include <span>

namespace specula {

// Accept test for draft token `token` given the target distribution p and the
// draft distribution q (f32 [V] each) and a uniform u in [0, 1):
// accept iff u < min(1, p[token] / q[token]).
// q[token] == 0 means the drafter could not have sampled the token (e.g. it was
// proposed greedily or under other truncation); the ratio is then taken as 1,
// except that a token the target gives probability 0 is never accepted, so the
// emitted tokens stay inside the support of p.
bool accept_draft(std::span<const float> p, std::span<const float> q, int32_t token, double u);

// out = normalize(max(p - q, 0)) (f32 [V]; `out` may alias neither p nor q).
// When the residual mass is <= 1e-12 (q covers p, as when p == q) the result is
// p itself, renormalised. Throws Error on size mismatch or when p has no mass.
void residual_distribution(std::span<const float> p, std::span<const float> q,
                           std::span<float> out);

}  // namespace specula
