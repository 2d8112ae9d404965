// SPDX-License-Identifier: Apache-2.0
#include "apps/cli/step_limits.h"

#include <algorithm>

#include "engine/kv/kv_cache.h"

namespace specula::cli {

double linear_params_per_token(const gemma4::Gemma4Config& c) {
  const double H = c.hidden_size, P = c.hidden_size_per_layer_input;
  double n = c.has_ple() ? H * c.num_hidden_layers * P : 0;
  for (const gemma4::LayerSpec& l : c.layers) {
    const double D = l.head_dim, q = static_cast<double>(c.num_attention_heads) * D;
    n += 2 * q * H;  // q_proj, o_proj
    if (!l.kv_shared) n += (l.k_eq_v ? 1 : 2) * static_cast<double>(l.n_kv_heads) * D * H;
    n += 3 * H * l.intermediate_size;
    if (c.has_ple()) n += 2 * H * P;
    if (c.enable_moe_block) {
      n += static_cast<double>(c.num_experts) * H +
           static_cast<double>(c.top_k_experts) * 3 * H * c.moe_intermediate_size;
    }
  }
  return n;
}

int64_t kv_bytes_read(const gemma4::Gemma4Config& c, int64_t len, DType dtype) {
  int64_t bytes = 0;
  for (const gemma4::LayerSpec& l : c.layers) {
    const int64_t rows =
        l.type == gemma4::LayerType::kSliding ? std::min<int64_t>(c.sliding_window, len) : len;
    bytes += rows * l.n_kv_heads * kv_head_row_bytes(dtype, l.head_dim) * 2;
  }
  return bytes;
}

namespace {
// Σ_{p=0}^{m-1} min(w, p + 1): the keys queries at positions 0 .. m - 1 see
// (w = 0: no window).
double visible_keys_below(double m, double w) {
  if (w <= 0 || m <= w) return m * (m + 1) / 2;
  return w * (w + 1) / 2 + (m - w) * w;
}
}  // namespace

double attention_flops(const gemma4::Gemma4Config& c, int64_t first, int64_t tokens) {
  double flops = 0;
  const double a = static_cast<double>(first), b = static_cast<double>(first + tokens);
  for (const gemma4::LayerSpec& l : c.layers) {
    const double w = l.type == gemma4::LayerType::kSliding ? c.sliding_window : 0;
    flops += 4.0 * c.num_attention_heads * l.head_dim *
             (visible_keys_below(b, w) - visible_keys_below(a, w));
  }
  return flops;
}

double forward_flops(const gemma4::Gemma4Config& c, int64_t rows, int64_t len, int64_t tokens,
                     int64_t logits) {
  const double per_row = 2.0 * static_cast<double>(tokens) * linear_params_per_token(c) +
                         2.0 * static_cast<double>(logits) * c.vocab_size * c.hidden_size +
                         attention_flops(c, len, tokens);
  return static_cast<double>(rows) * per_row;
}

double prefill_flops(const gemma4::Gemma4Config& c, int64_t n) {
  return forward_flops(c, 1, 0, n, 1);
}

StepLimit step_limit(double bytes, double flops, double bytes_per_second, double flops_per_second) {
  StepLimit s;
  s.memory_seconds = bytes / bytes_per_second;
  s.compute_seconds = flops / flops_per_second;
  s.seconds = std::max(s.memory_seconds, s.compute_seconds);
  s.bound = s.compute_seconds > s.memory_seconds ? "compute" : "memory";
  return s;
}

}  // namespace specula::cli
