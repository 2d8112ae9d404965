// SPDX-License-Identifier: Apache-2.0
// Mixture-of-experts routing and the routed expert FFN (gemma4-architecture.md §6).
#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

#include "engine/backend/cpu/cpu_backend.h"

namespace specula {

void CpuBackend::moe_route(const MoeRouteParams& p) {
  constexpr const char* kOp = "moe_route";
  cpu::check_host(kOp, "logits", p.logits);
  cpu::check_host(kOp, "per_expert_scale", p.per_expert_scale);
  cpu::check_host(kOp, "expert_ids", p.expert_ids);
  cpu::check_host(kOp, "expert_weights", p.expert_weights);
  cpu::check_dtype(kOp, "logits", p.logits, DType::kF32);
  cpu::check_rank(kOp, "logits", p.logits, 2);
  cpu::check_float(kOp, "per_expert_scale", p.per_expert_scale);
  cpu::check_dtype(kOp, "expert_ids", p.expert_ids, DType::kI32);
  cpu::check_rank(kOp, "expert_ids", p.expert_ids, 2);
  cpu::check_dtype(kOp, "expert_weights", p.expert_weights, DType::kF32);
  const int64_t n = p.logits.dim(0);
  const int64_t n_experts = p.logits.dim(1);
  const int64_t top_k = p.expert_ids.dim(1);
  if (p.per_expert_scale.shape() != Shape({n_experts})) {
    fail("moe_route: per_expert_scale {} must be [{}] for logits {}", p.per_expert_scale.describe(),
         n_experts, p.logits.describe());
  }
  if (p.expert_ids.dim(0) != n || top_k < 1 || top_k > n_experts) {
    fail("moe_route: expert_ids {} must be i32[{}, k] with 1 <= k <= {} for logits {}",
         p.expert_ids.describe(), n, n_experts, p.logits.describe());
  }
  cpu::check_same_shape(kOp, "expert_ids", p.expert_ids, "expert_weights", p.expert_weights);
  cpu::check_no_alias(kOp, "expert_ids", p.expert_ids, "logits", p.logits);
  cpu::check_no_alias(kOp, "expert_weights", p.expert_weights, "logits", p.logits);
  cpu::check_no_alias(kOp, "expert_weights", p.expert_weights, "expert_ids", p.expert_ids);
  if (n == 0) return;

  std::vector<float> expert_scale(static_cast<size_t>(n_experts));
  for (int64_t e = 0; e < n_experts; ++e) {
    expert_scale[static_cast<size_t>(e)] = cpu::load_float(p.per_expert_scale, e);
  }
  const float* logits = p.logits.data_as<const float>();
  int32_t* ids = p.expert_ids.data_as<int32_t>();
  float* weights = p.expert_weights.data_as<float>();
  cpu::parallel_for(n, cpu::worth_parallel(n * n_experts * 16), [&](int64_t r0, int64_t r1, int) {
    std::vector<float> prob(static_cast<size_t>(n_experts));
    std::vector<char> taken(static_cast<size_t>(n_experts));
    for (int64_t r = r0; r < r1; ++r) {
      const float* lr = logits + r * n_experts;
      float max_value = -std::numeric_limits<float>::infinity();
      for (int64_t e = 0; e < n_experts; ++e) max_value = std::max(max_value, lr[e]);
      double sum = 0.0;
      for (int64_t e = 0; e < n_experts; ++e) {
        prob[static_cast<size_t>(e)] = std::exp(lr[e] - max_value);
        sum += prob[static_cast<size_t>(e)];
      }
      const auto denom = static_cast<float>(sum);
      for (float& v : prob) v /= denom;
      // Top-k by repeated selection: strict '>' keeps the lower index on ties,
      // and a NaN probability can never break the ordering (no comparator sort).
      std::fill(taken.begin(), taken.end(), 0);
      int32_t* rid = ids + r * top_k;
      float* rw = weights + r * top_k;
      float picked_sum = 0.0f;
      for (int64_t t = 0; t < top_k; ++t) {
        int64_t best = -1;
        for (int64_t e = 0; e < n_experts; ++e) {
          if (taken[static_cast<size_t>(e)]) continue;
          if (best < 0 || prob[static_cast<size_t>(e)] > prob[static_cast<size_t>(best)]) best = e;
        }
        taken[static_cast<size_t>(best)] = 1;
        rid[t] = static_cast<int32_t>(best);
        rw[t] = prob[static_cast<size_t>(best)];
        picked_sum += rw[t];
      }
      for (int64_t t = 0; t < top_k; ++t) {
        rw[t] = (rw[t] / picked_sum) * expert_scale[static_cast<size_t>(rid[t])];
      }
    }
  });
}

void CpuBackend::moe_experts(const MoeExpertsParams& p) {
  constexpr const char* kOp = "moe_experts";
  cpu::check_host(kOp, "x", p.x);
  cpu::check_host(kOp, "expert_ids", p.expert_ids);
  cpu::check_host(kOp, "expert_weights", p.expert_weights);
  cpu::check_host(kOp, "gate_up", p.gate_up);
  cpu::check_host(kOp, "down", p.down);
  cpu::check_host(kOp, "out", p.out);
  const ops::MoeExpertsDims dims = ops::check_moe_experts(p);
  const int64_t n = dims.tokens;
  const int64_t h = dims.hidden;
  const int64_t top_k = dims.top_k;
  const int64_t n_experts = dims.experts;
  const int64_t inter = dims.inter;
  const int64_t two_i = 2 * inter;
  const int32_t* ids = p.expert_ids.data_as<const int32_t>();
  for (int64_t s = 0; s < n * top_k; ++s) {
    if (ids[s] < 0 || ids[s] >= n_experts) {
      fail("moe_experts: expert id {} for token {} (slot {}) is outside [0, {}) of gate_up {}",
           ids[s], s / top_k, s % top_k, n_experts, p.gate_up.describe());
    }
  }
  float* out = p.out.data_as<float>();
  std::fill(out, out + n * h, 0.0f);
  if (n == 0 || h == 0 || top_k == 0) return;

  // Bucket the (token, slot) pairs by expert, tokens ascending within a bucket.
  std::vector<int64_t> start(static_cast<size_t>(n_experts) + 1, 0);
  for (int64_t s = 0; s < n * top_k; ++s) ++start[static_cast<size_t>(ids[s]) + 1];
  for (int64_t e = 0; e < n_experts; ++e) start[e + 1] += start[e];
  std::vector<int64_t> slots(static_cast<size_t>(n * top_k));
  {
    std::vector<int64_t> next(start.begin(), start.end() - 1);
    for (int64_t s = 0; s < n * top_k; ++s) slots[next[ids[s]]++] = s;
  }
  int64_t max_rows = 0;
  for (int64_t e = 0; e < n_experts; ++e) max_rows = std::max(max_rows, start[e + 1] - start[e]);

  const float* x = p.x.data_as<const float>();
  const float* w = p.expert_weights.data_as<const float>();
  std::vector<float> xs(static_cast<size_t>(max_rows * h));
  std::vector<float> gate_up(static_cast<size_t>(max_rows * two_i));
  std::vector<float> act(static_cast<size_t>(max_rows * inter));
  std::vector<float> ys(static_cast<size_t>(max_rows * h));
  // Experts run in ascending id and each adds its weighted output into `out`, so
  // a token's sum is accumulated in ascending expert order, as HF's index_add_.
  for (int64_t e = 0; e < n_experts; ++e) {
    const int64_t rows = start[e + 1] - start[e];
    if (rows == 0) continue;
    const int64_t* es = slots.data() + start[e];
    for (int64_t r = 0; r < rows; ++r) {
      const float* src = x + (es[r] / top_k) * h;
      std::copy(src, src + h, xs.data() + r * h);
    }
    cpu::linear_rows(xs.data(), rows, p.gate_up.row(e), gate_up.data(), scratch_);
    for (int64_t r = 0; r < rows; ++r) {
      const float* g = gate_up.data() + r * two_i;
      float* a = act.data() + r * inter;
      for (int64_t c = 0; c < inter; ++c) a[c] = cpu::gelu_tanh(g[c]) * g[inter + c];
    }
    cpu::linear_rows(act.data(), rows, p.down.row(e), ys.data(), scratch_);
    for (int64_t r = 0; r < rows; ++r) {
      cpu::axpy(w[es[r]], ys.data() + r * h, out + (es[r] / top_k) * h, h);
    }
  }
}

}  // namespace specula
