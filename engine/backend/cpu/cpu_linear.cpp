// SPDX-License-Identifier: Apache-2.0
// linear: y = x · wᵀ with f32 activations and f32/bf16/f16 weights, or
// quantized (i8, f8e4m3) weights, computed exactly as the f32 product with the
// dequantized matrix (each weight decode(q) · scale[row], rounded to f32 once).

#include <algorithm>
#include <limits>
#include <utility>

#include "engine/backend/cpu/cpu_backend.h"
#include "engine/ops/op_checks.h"

namespace specula {
namespace cpu {
namespace {

// Weight elements converted per step of the GEMV kernel: a multiple of kLanes so
// chunking does not change the summation order, small enough for the stack.
constexpr int64_t kGemvChunk = 512;
// Few activation rows: the cost is reading w once, so each weight row is
// converted chunk by chunk and dotted with every activation row while hot.
// Parallel over weight rows; every y element is one thread's fixed-order sum.
void gemv_rows(const float* x, int64_t m_rows, const Tensor& w, float* y) {
  const int64_t n = w.dim(0);
  const int64_t k = w.dim(1);
  const DType dtype = w.dtype();
  const size_t elt = dtype_size(dtype);
  const auto* base = static_cast<const char*>(w.data());
  if (dtype == DType::kBF16 || dtype == DType::kF32) {
    // The same sums with the weights widened in registers (dot_rows_reduce).
    parallel_for_each(n, worth_parallel(n * k), [&](int64_t r, int) {
      dot_rows_reduce(base + static_cast<size_t>(r * k) * elt, dtype, x, k, m_rows, k, y + r, n);
    });
    return;
  }
  parallel_for_each(n, worth_parallel(n * k), [&](int64_t r, int) {
    float lanes[kGemvMaxRows][kLanes] = {};
    float converted[kGemvChunk];
    const char* row = base + static_cast<size_t>(r * k) * elt;
    for (int64_t k0 = 0; k0 < k; k0 += kGemvChunk) {
      const int64_t len = std::min(kGemvChunk, k - k0);
      const float* wk;
      if (dtype == DType::kF32) {
        wk = reinterpret_cast<const float*>(row) + k0;
      } else if (is_quantized(dtype)) {
        weight_row_to_f32(w, r, k0, converted, len);
        wk = converted;
      } else {
        to_f32(row + static_cast<size_t>(k0) * elt, dtype, converted, len);
        wk = converted;
      }
      dot_accumulate_rows(x + k0, k, m_rows, wk, len, lanes);
    }
    for (int64_t m = 0; m < m_rows; ++m) y[m * n + r] = reduce_lanes(lanes[m]);
  });
}

// Many activation rows. Every y element is still one fixed-order dot product
// (dot_accumulate over the whole of K, then reduce_lanes), exactly as in
// gemv_rows: a row's result never depends on how many rows share the call.
// Speculation relies on that (decode computes 1 row, verify k + 1 rows, batched
// rows many more, and greedy output must be identical), which is why this path
// does not hand large products to sgemm, whose blocking varies with M.
// Parallel over weight rows: each row is widened once into the thread's slice
// of `scratch` and dotted with every activation row while it is hot.
void dot_rows(const float* x, int64_t m_rows, const Tensor& w, float* y, ScratchPool& scratch) {
  const int64_t n = w.dim(0);
  const int64_t k = w.dim(1);
  const DType dtype = w.dtype();
  const bool widen = dtype != DType::kF32;
  const int team = team_size();
  ScratchPool::Lease lease(scratch, widen ? static_cast<size_t>(team) * static_cast<size_t>(k) : 0);
  float* widened = lease.data();
  parallel_for_each(n, worth_parallel(m_rows * n * k), [&](int64_t r, int slot) {
    const float* wr;
    if (widen) {
      float* buf = widened + static_cast<int64_t>(slot) * k;
      weight_row_to_f32(w, r, 0, buf, k);
      wr = buf;
    } else {
      wr = w.data_as<const float>() + r * k;
    }
    dot_rows_reduce(wr, DType::kF32, x, k, m_rows, k, y + r, n);
  });
}

}  // namespace

void linear_rows(const float* x, int64_t m_rows, const Tensor& w, float* y, ScratchPool& scratch) {
  const int64_t n = w.dim(0);
  const int64_t k = w.dim(1);
  if (m_rows == 0 || n == 0) return;
  if (k == 0) {
    std::fill(y, y + m_rows * n, 0.0f);
    return;
  }
  if (m_rows <= kGemvMaxRows) {
    gemv_rows(x, m_rows, w, y);
  } else {
    dot_rows(x, m_rows, w, y, scratch);
  }
}

}  // namespace cpu

void CpuBackend::linear(const Tensor& x, const Tensor& w, const Tensor& y) {
  constexpr const char* kOp = "linear";
  cpu::check_host(kOp, "x", x);
  cpu::check_host(kOp, "w", w);
  cpu::check_host(kOp, "y", y);
  cpu::check_dtype(kOp, "x", x, DType::kF32);
  cpu::check_weight(kOp, "w", w);
  cpu::check_dtype(kOp, "y", y, DType::kF32);
  cpu::check_rank(kOp, "x", x, 2);
  cpu::check_rank(kOp, "w", w, 2);
  cpu::check_rank(kOp, "y", y, 2);
  if (x.dim(1) != w.dim(1)) {
    fail("linear: x {} and w {} disagree on K ({} vs {})", x.describe(), w.describe(), x.dim(1),
         w.dim(1));
  }
  if (y.dim(0) != x.dim(0) || y.dim(1) != w.dim(0)) {
    fail("linear: y {} must be f32[{}, {}] for x {} and w {}", y.describe(), x.dim(0), w.dim(0),
         x.describe(), w.describe());
  }
  cpu::check_no_alias(kOp, "y", y, "x", x);
  cpu::check_no_alias(kOp, "y", y, "w", w);
  cpu::linear_rows(x.data_as<const float>(), x.dim(0), w, y.data_as<float>(), scratch_);
}

void CpuBackend::linear_residual(const Tensor& x, const Tensor& w, const Tensor& residual,
                                 const Tensor& rows, const Tensor& y) {
  constexpr const char* kOp = "linear_residual";
  for (const auto& [name, t] : {std::pair<const char*, const Tensor*>{"x", &x},
                                {"w", &w},
                                {"residual", &residual},
                                {"y", &y}}) {
    cpu::check_host(kOp, name, *t);
  }
  if (!rows.empty()) cpu::check_host(kOp, "rows", rows);
  cpu::check_weight(kOp, "w", w);
  const ops::LinearResidualDims d = ops::check_linear_residual(kOp, x, w, residual, rows, y);
  if (!rows.empty()) cpu::check_ids_below(kOp, "rows", rows, d.residual_rows);
  // The product first, then residual + product per element: the bits of linear()
  // followed by add(residual rows, product).
  cpu::linear_rows(x.data_as<const float>(), d.rows, w, y.data_as<float>(), scratch_);
  const int32_t* ids = rows.empty() ? nullptr : rows.data_as<const int32_t>();
  const float* res = residual.data_as<const float>();
  float* out = y.data_as<float>();
  for (int64_t m = 0; m < d.rows; ++m) {
    const float* r = res + (ids != nullptr ? ids[m] : m) * d.n;
    float* o = out + m * d.n;
    for (int64_t n = 0; n < d.n; ++n) o[n] = r[n] + o[n];
  }
}

}  // namespace specula
