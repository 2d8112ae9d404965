// SPDX-License-Identifier: Apache-2.0
// Speculative-sampling primitives (Leviathan et al. 2023; Chen et al. 2023):
// a drafted token x ~ q is kept with probability min(1, p(x) / q(x)); on
// rejection the replacement is drawn from norm(max(p - q, 0)). Together these
// emit tokens distributed exactly as p. p and q must both be produced by
// process_logits() with the same SamplingParams (sampler.h).
#pragma once

#include <cstdint>
#include <functional>
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

// What a verify window gives: how many drafts were kept, and the token that
// follows them (the residual's sample at the first rejection, else the bonus
// token drawn from p after the last draft).
struct WindowVerdict {
  int accepted = 0;
  int32_t next = 0;
};

// A distribution over the vocabulary at window row j, f32 [V]; the span must
// stay valid until the next call.
using DistributionAt = std::function<std::span<const float>(int j)>;

// Exact speculative sampling over one verify window: THE definition, which the
// host path and the CPU backend's speculative_accept_rows call and the device
// kernels are tested against. drafts d_0..d_{k-1} (k >= 0; a ragged or pruned
// window is just a shorter one); p(j), j = 0..k, the target's processed
// distribution at window row j (given the history and d_0..d_{j-1}); q(j),
// j < k, the distribution d_j was drafted from (a point mass at d_j for a
// drafter that proposes tokens); u, k + 1 uniforms in [0, 1): u[j] tests d_j
// (accept_draft), u[k] draws the replacement or the bonus token (sample_at).
// Drafts are tested in order and stop at the first rejection; p(j) and q(j)
// are each asked for at most once, in increasing j, so a caller may compute
// them lazily into one workspace. `residual`: scratch of V floats.
WindowVerdict verify_window(std::span<const int32_t> drafts, const DistributionAt& p,
                            const DistributionAt& q, std::span<const double> u,
                            std::span<float> residual);

}  // namespace specula
