// SPDX-License-Identifier: Apache-2.0
// Row-wise and element-wise ops: embedding, rms_norm, activations, arithmetic,
// soft-capping, argmax and softmax.
#include <algorithm>
#include <cmath>
#include <limits>
#include <numeric>
#include <optional>
#include <vector>

#include "engine/backend/cpu/cpu_backend.h"

namespace specula {
namespace {

// Checks for an element-wise op whose f32 output may be exactly its f32 input.
void check_unary(const char* op, const Tensor& x, const Tensor& out) {
  cpu::check_host(op, "x", x);
  cpu::check_host(op, "out", out);
  cpu::check_dtype(op, "x", x, DType::kF32);
  cpu::check_dtype(op, "out", out, DType::kF32);
  cpu::check_same_shape(op, "x", x, "out", out);
  cpu::check_exact_alias(op, "out", out, "x", x);
}

void check_binary(const char* op, const char* a_name, const Tensor& a, const char* b_name,
                  const Tensor& b, const Tensor& out) {
  cpu::check_host(op, a_name, a);
  cpu::check_host(op, b_name, b);
  cpu::check_host(op, "out", out);
  cpu::check_dtype(op, a_name, a, DType::kF32);
  cpu::check_dtype(op, b_name, b, DType::kF32);
  cpu::check_dtype(op, "out", out, DType::kF32);
  cpu::check_same_shape(op, a_name, a, b_name, b);
  cpu::check_same_shape(op, a_name, a, "out", out);
  cpu::check_exact_alias(op, "out", out, a_name, a);
  cpu::check_exact_alias(op, "out", out, b_name, b);
}

// out[i] = f(x[i]); `cost` is a rough per-element weight for the parallel cut-off.
template <typename F>
void map_unary(const Tensor& x, const Tensor& out, int64_t cost, F f) {
  const float* in = x.data_as<const float>();
  float* o = out.data_as<float>();
  const int64_t n = x.numel();
  cpu::parallel_for_each(n, cpu::worth_parallel(n * cost),
                         [&](int64_t i, int) { o[i] = f(in[i]); });
}

template <typename F>
void map_binary(const Tensor& a, const Tensor& b, const Tensor& out, int64_t cost, F f) {
  const float* pa = a.data_as<const float>();
  const float* pb = b.data_as<const float>();
  float* o = out.data_as<float>();
  const int64_t n = a.numel();
  cpu::parallel_for_each(n, cpu::worth_parallel(n * cost),
                         [&](int64_t i, int) { o[i] = f(pa[i], pb[i]); });
}

// Rough relative cost of one tanh against one add, for the parallel cut-off.
constexpr int64_t kTanhCost = 16;

}  // namespace

void CpuBackend::embedding(const Tensor& table, const Tensor& ids, float scale, const Tensor& out) {
  constexpr const char* kOp = "embedding";
  cpu::check_host(kOp, "table", table);
  cpu::check_host(kOp, "ids", ids);
  cpu::check_host(kOp, "out", out);
  cpu::check_weight(kOp, "table", table);
  cpu::check_rank(kOp, "table", table, 2);
  cpu::check_dtype(kOp, "ids", ids, DType::kI32);
  cpu::check_rank(kOp, "ids", ids, 1);
  cpu::check_dtype(kOp, "out", out, DType::kF32);
  const int64_t n = ids.dim(0);
  const int64_t vocab = table.dim(0);
  const int64_t h = table.dim(1);
  if (out.shape() != Shape({n, h})) {
    fail("embedding: out {} must be f32[{}, {}] for ids {} and table {}", out.describe(), n, h,
         ids.describe(), table.describe());
  }
  cpu::check_no_alias(kOp, "out", out, "table", table);
  cpu::check_no_alias(kOp, "out", out, "ids", ids);
  const int32_t* id = ids.data_as<const int32_t>();
  // Validate every id before writing anything, so a bad request leaves out untouched.
  for (int64_t i = 0; i < n; ++i) {
    if (id[i] < 0 || id[i] >= vocab) {
      fail("embedding: token id {} (at index {}) is outside the vocabulary [0, {}) of table {}",
           id[i], i, vocab, table.describe());
    }
  }
  float* o = out.data_as<float>();
  cpu::parallel_for_each(n, cpu::worth_parallel(n * h), [&](int64_t i, int) {
    float* row = o + i * h;
    cpu::weight_row_to_f32(table, id[i], 0, row, h);
    for (int64_t j = 0; j < h; ++j) row[j] *= scale;
  });
}

void CpuBackend::rms_norm(const Tensor& x, const Tensor& weight, float eps, const Tensor& out) {
  constexpr const char* kOp = "rms_norm";
  check_unary(kOp, x, out);
  if (x.rank() < 1) fail("rms_norm: x must have rank >= 1, got {}", x.describe());
  const int64_t d = x.dim(-1);
  if (d == 0 || x.numel() == 0) return;
  // bf16/f16 weights are widened into the backend's reusable scratch (no
  // allocation per call: rms_norm runs several times per layer and step).
  std::optional<cpu::ScratchPool::Lease> converted;
  const float* w = nullptr;
  if (!weight.empty()) {
    cpu::check_host(kOp, "weight", weight);
    cpu::check_float(kOp, "weight", weight);
    if (weight.rank() != 1 || weight.dim(0) != d) {
      fail("rms_norm: weight {} must be [{}] to match the last dimension of x {}",
           weight.describe(), d, x.describe());
    }
    if (weight.dtype() == DType::kF32) {
      w = weight.data_as<const float>();
    } else {
      converted.emplace(scratch_, static_cast<size_t>(d));
      cpu::to_f32(weight.data(), weight.dtype(), converted->data(), d);
      w = converted->data();
    }
  }
  const int64_t rows = x.numel() / d;
  const float* in = x.data_as<const float>();
  float* o = out.data_as<float>();
  cpu::parallel_for_each(rows, cpu::worth_parallel(rows * d), [&](int64_t r, int) {
    const float* xr = in + r * d;
    float* orow = o + r * d;
    // The mean of squares is summed in double (8 lanes so it vectorises) and
    // rounded once: a faithful f32 mean even for wide rows.
    constexpr int kSumLanes = 8;
    double lanes[kSumLanes] = {};
    int64_t j = 0;
    for (; j + kSumLanes <= d; j += kSumLanes) {
      for (int l = 0; l < kSumLanes; ++l) {
        const double v = xr[j + l];
        lanes[l] += v * v;
      }
    }
    for (; j < d; ++j) lanes[j % kSumLanes] += static_cast<double>(xr[j]) * xr[j];
    double sum = 0.0;
    for (double v : lanes) sum += v;
    const float mean = static_cast<float>(sum / static_cast<double>(d));
    const float inv = std::pow(mean + eps, -0.5f);
    if (w != nullptr) {
      for (int64_t c = 0; c < d; ++c) orow[c] = (xr[c] * inv) * w[c];
    } else {
      for (int64_t c = 0; c < d; ++c) orow[c] = xr[c] * inv;
    }
  });
}

void CpuBackend::gelu_mul(const Tensor& gate, const Tensor& up, const Tensor& out) {
  check_binary("gelu_mul", "gate", gate, "up", up, out);
  map_binary(gate, up, out, kTanhCost, [](float g, float u) { return cpu::gelu_tanh(g) * u; });
}

void CpuBackend::gelu(const Tensor& x, const Tensor& out) {
  check_unary("gelu", x, out);
  map_unary(x, out, kTanhCost, [](float v) { return cpu::gelu_tanh(v); });
}

void CpuBackend::add(const Tensor& a, const Tensor& b, const Tensor& out) {
  check_binary("add", "a", a, "b", b, out);
  map_binary(a, b, out, 1, [](float u, float v) { return u + v; });
}

void CpuBackend::mul(const Tensor& a, const Tensor& b, const Tensor& out) {
  check_binary("mul", "a", a, "b", b, out);
  map_binary(a, b, out, 1, [](float u, float v) { return u * v; });
}

void CpuBackend::scale(const Tensor& x, float s, const Tensor& out) {
  check_unary("scale", x, out);
  map_unary(x, out, 1, [s](float v) { return v * s; });
}

void CpuBackend::softcap(const Tensor& x, float cap, const Tensor& out) {
  check_unary("softcap", x, out);
  if (!(cap > 0.0f) || !std::isfinite(cap)) {
    fail("softcap: cap must be a positive finite number, got {} (x {})", cap, x.describe());
  }
  // Same operation order as HF: divide, tanh, multiply.
  map_unary(x, out, kTanhCost, [cap](float v) { return std::tanh(v / cap) * cap; });
}

void CpuBackend::top_k_rows(const Tensor& x, const Tensor& out) {
  constexpr const char* kOp = "top_k_rows";
  cpu::check_host(kOp, "x", x);
  cpu::check_host(kOp, "out", out);
  const ops::TopKDims d = ops::check_top_k_rows(kOp, x, out);
  const float* in = x.data_as<const float>();
  int32_t* o = out.data_as<int32_t>();
  cpu::parallel_for_each(d.rows, cpu::worth_parallel(d.rows * d.n), [&](int64_t r, int) {
    const float* row = in + r * d.n;
    // Per-thread scratch, grown only: steady-state steps allocate nothing.
    thread_local std::vector<int32_t> order;
    order.resize(static_cast<size_t>(d.n));
    std::iota(order.begin(), order.end(), 0);
    // A strict weak order: NaN above every number, then larger first, then lower index.
    auto before = [row](int32_t a, int32_t b) {
      const float va = row[a], vb = row[b];
      const bool na = std::isnan(va), nb = std::isnan(vb);
      if (na != nb) return na;
      if (!na && va != vb) return va > vb;
      return a < b;
    };
    std::partial_sort(order.begin(), order.begin() + d.k, order.end(), before);
    std::copy(order.begin(), order.begin() + d.k, o + r * d.k);
  });
}

void CpuBackend::fill_scatter_rows(const Tensor& values, const Tensor& ids, const Tensor& out) {
  constexpr const char* kOp = "fill_scatter_rows";
  cpu::check_host(kOp, "values", values);
  cpu::check_host(kOp, "ids", ids);
  cpu::check_host(kOp, "out", out);
  const ops::FillScatterDims d = ops::check_fill_scatter_rows(kOp, values, ids, out);
  const float* v = values.data_as<const float>();
  const int32_t* id = ids.data_as<const int32_t>();
  float* o = out.data_as<float>();
  cpu::check_ids_below(kOp, "ids", ids, d.width);
  for (int64_t r = 0; r < d.rows; ++r) {
    const float* vr = v + r * d.n;
    float smallest = std::numeric_limits<float>::infinity();
    for (int64_t j = 0; j < d.n; ++j) {
      if (vr[j] < smallest) smallest = vr[j];  // false for NaN: skipped
    }
    float* orow = o + r * d.width;
    std::fill(orow, orow + d.width, smallest - 1.0f);
    for (int64_t j = 0; j < d.n; ++j) orow[id[r * d.n + j]] = vr[j];
  }
}

void CpuBackend::argmax_rows(const Tensor& x, const Tensor& out) {
  constexpr const char* kOp = "argmax_rows";
  cpu::check_host(kOp, "x", x);
  cpu::check_host(kOp, "out", out);
  cpu::check_dtype(kOp, "x", x, DType::kF32);
  cpu::check_rank(kOp, "x", x, 2);
  cpu::check_dtype(kOp, "out", out, DType::kI32);
  if (out.shape() != Shape({x.dim(0)})) {
    fail("argmax_rows: out {} must be i32[{}] for x {}", out.describe(), x.dim(0), x.describe());
  }
  const int64_t m = x.dim(0);
  const int64_t n = x.dim(1);
  if (m == 0) return;
  if (n == 0) fail("argmax_rows: x {} has empty rows; there is no largest element", x.describe());
  if (n > std::numeric_limits<int32_t>::max()) {
    fail("argmax_rows: x {} rows are too long for i32 indices", x.describe());
  }
  const float* in = x.data_as<const float>();
  int32_t* o = out.data_as<int32_t>();
  cpu::parallel_for_each(m, cpu::worth_parallel(m * n), [&](int64_t r, int) {
    const float* row = in + r * n;
    int64_t best = 0;
    float best_value = row[0];
    if (!std::isnan(best_value)) {
      for (int64_t j = 1; j < n; ++j) {
        const float v = row[j];
        if (std::isnan(v)) {
          best = j;
          break;
        }
        if (v > best_value) {  // strict: ties keep the lower index
          best = j;
          best_value = v;
        }
      }
    }
    o[r] = static_cast<int32_t>(best);
  });
}

void CpuBackend::softmax_rows(const Tensor& x, const Tensor& out) {
  check_unary("softmax_rows", x, out);
  if (x.rank() < 1) fail("softmax_rows: x must have rank >= 1, got {}", x.describe());
  const int64_t n = x.dim(-1);
  if (n == 0 || x.numel() == 0) return;
  const int64_t rows = x.numel() / n;
  const float* in = x.data_as<const float>();
  float* o = out.data_as<float>();
  cpu::parallel_for_each(rows, cpu::worth_parallel(rows * n * kTanhCost), [&](int64_t r, int) {
    const float* xr = in + r * n;
    float* orow = o + r * n;
    float max_value = -std::numeric_limits<float>::infinity();
    for (int64_t j = 0; j < n; ++j) max_value = std::max(max_value, xr[j]);
    if (max_value == -std::numeric_limits<float>::infinity()) {
      std::fill(orow, orow + n, 0.0f);
      return;
    }
    double sum = 0.0;  // double: long rows (a whole vocabulary) lose nothing to the sum
    for (int64_t j = 0; j < n; ++j) {
      orow[j] = std::exp(xr[j] - max_value);
      sum += orow[j];
    }
    const auto denom = static_cast<float>(sum);
    for (int64_t j = 0; j < n; ++j) orow[j] /= denom;
  });
}

}  // namespace specula
