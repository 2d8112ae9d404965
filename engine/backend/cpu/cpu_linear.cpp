// SPDX-License-Identifier: Apache-2.0
// linear: y = x · wᵀ with f32 activations and f32/bf16/f16 weights.
#include <cblas.h>

#include <algorithm>
#include <limits>

#include "engine/backend/cpu/cpu_backend.h"

namespace specula {
namespace cpu {
namespace {

// Weight elements converted per step of the GEMV kernel: a multiple of kLanes so
// chunking does not change the summation order, small enough for the stack.
constexpr int64_t kGemvChunk = 512;
// Budget for one block of converted weight rows in the sgemm path (~16 MiB).
constexpr int64_t kBlockFloats = int64_t{4} << 20;
constexpr int64_t kMaxBlockRows = 256;
constexpr int64_t kMinBlockRows = 16;

// Few activation rows: the cost is reading w once, so each weight row is
// converted chunk by chunk and dotted with every activation row while hot.
// Parallel over weight rows; every y element is one thread's fixed-order sum.
void gemv_rows(const float* x, int64_t m_rows, const Tensor& w, float* y) {
  const int64_t n = w.dim(0);
  const int64_t k = w.dim(1);
  const DType dtype = w.dtype();
  const size_t elt = dtype_size(dtype);
  const auto* base = static_cast<const char*>(w.data());
#pragma omp parallel for schedule(static) if (worth_parallel(n * k))
  for (int64_t r = 0; r < n; ++r) {
    float lanes[kGemvMaxRows][kLanes] = {};
    float converted[kGemvChunk];
    const char* row = base + static_cast<size_t>(r * k) * elt;
    for (int64_t k0 = 0; k0 < k; k0 += kGemvChunk) {
      const int64_t len = std::min(kGemvChunk, k - k0);
      const float* wk;
      if (dtype == DType::kF32) {
        wk = reinterpret_cast<const float*>(row) + k0;
      } else {
        to_f32(row + static_cast<size_t>(k0) * elt, dtype, converted, len);
        wk = converted;
      }
      for (int64_t m = 0; m < m_rows; ++m) dot_accumulate(x + m * k + k0, wk, len, lanes[m]);
    }
    for (int64_t m = 0; m < m_rows; ++m) y[m * n + r] = reduce_lanes(lanes[m]);
  }
}

// Many activation rows: compute-bound, so hand it to sgemm. bf16/f16 weights are
// widened block by block into the scratch buffer first (in parallel, and outside
// any BLAS call: OpenBLAS must not run inside an OpenMP region).
void gemm_rows(const float* x, int64_t m_rows, const Tensor& w, float* y, ScratchPool& scratch) {
  const int64_t n = w.dim(0);
  const int64_t k = w.dim(1);
  const auto m = static_cast<blasint>(m_rows);
  const auto ldk = static_cast<blasint>(k);
  if (w.dtype() == DType::kF32) {
    cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, m, static_cast<blasint>(n), ldk, 1.0f, x,
                ldk, w.data_as<const float>(), ldk, 0.0f, y, static_cast<blasint>(n));
    return;
  }
  const int64_t block = std::min(n, std::clamp(kBlockFloats / k, kMinBlockRows, kMaxBlockRows));
  ScratchPool::Lease lease(scratch, static_cast<size_t>(block * k));
  float* converted = lease.data();
  const DType dtype = w.dtype();
  const size_t elt = dtype_size(dtype);
  const auto* base = static_cast<const char*>(w.data());
  for (int64_t n0 = 0; n0 < n; n0 += block) {
    const int64_t rows = std::min(block, n - n0);
#pragma omp parallel for schedule(static) if (worth_parallel(rows * k))
    for (int64_t r = 0; r < rows; ++r) {
      to_f32(base + static_cast<size_t>((n0 + r) * k) * elt, dtype, converted + r * k, k);
    }
    cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, m, static_cast<blasint>(rows), ldk, 1.0f,
                x, ldk, converted, ldk, 0.0f, y + n0, static_cast<blasint>(n));
  }
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
    gemm_rows(x, m_rows, w, y, scratch);
  }
}

}  // namespace cpu

void CpuBackend::linear(const Tensor& x, const Tensor& w, const Tensor& y) {
  constexpr const char* kOp = "linear";
  cpu::check_host(kOp, "x", x);
  cpu::check_host(kOp, "w", w);
  cpu::check_host(kOp, "y", y);
  cpu::check_dtype(kOp, "x", x, DType::kF32);
  cpu::check_float(kOp, "w", w);
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
  constexpr int64_t kBlasMax = std::numeric_limits<blasint>::max();
  if (x.dim(0) > kBlasMax || w.dim(0) > kBlasMax || w.dim(1) > kBlasMax) {
    fail("linear: x {} and w {} exceed the BLAS index range", x.describe(), w.describe());
  }
  cpu::check_no_alias(kOp, "y", y, "x", x);
  cpu::check_no_alias(kOp, "y", y, "w", w);
  cpu::linear_rows(x.data_as<const float>(), x.dim(0), w, y.data_as<float>(), scratch_);
}

}  // namespace specula
