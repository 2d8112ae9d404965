// SPDX-License-Identifier: Apache-2.0
// linear_residual on the GPU: y[m, :] = residual[rows[m], :] + x[m, :] · wᵀ.
//
// Its use is DSpark's head step: a vocabulary-wide product with a short
// reduction (the Markov term W1[prev] · W2ᵀ, K = the Markov rank, N = V)
// added to a row of the block's base logits. As linear() then gather and add
// it is three launches and a [M, V] intermediate; here it is one pass over w.
//
// Fused path (bf16 w, K = 64 · kChunks for kChunks in {1, 2, 4, 8}, 16-byte
// aligned x and w): a warp owns 4 columns at a time, 8 lanes per column. Lane
// g of a column's group loads chunks g, g + 8, ... (8 bf16 each) of the weight
// row once, into registers, and for every row m of x accumulates its chunks in
// increasing order, 8 fmaf in element order each, into one f32 partial sum;
// the 8 partial sums are added by a fixed xor-shuffle tree (4, 2, 1), and the
// group's lane 0 writes residual + sum. The order is fixed by K alone, so
// y[m, :] never depends on M or on the other rows (batch invariance).
//
// Any other shape or weight dtype: linear() into y, then y += residual[rows]
// by a second kernel (linear's bits, then add's).
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>

#include "engine/backend/cuda/cuda_backend.h"
#include "engine/backend/cuda/cuda_device_common.cuh"
#include "engine/backend/cuda/cuda_launch.cuh"
#include "engine/ops/op_checks.h"

namespace specula::cuda {
namespace {

constexpr int kThreads = 256;
constexpr int kGroupLanes = 8;      // lanes per column
constexpr int kColumnsPerWarp = 4;  // 32 / kGroupLanes

// Eight bf16 (one 16-byte load) widened exactly to f32 in element order.
__device__ __forceinline__ void widen_bf16x8(uint4 v, float (&out)[8]) {
  const uint32_t words[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    // Little-endian: the lower-addressed element is the low half.
    out[2 * i] = widen16<DType::kBF16>(words[i] & 0xffffu);
    out[2 * i + 1] = widen16<DType::kBF16>(words[i] >> 16);
  }
}

template <int kChunks>
__global__ void __launch_bounds__(kThreads)
    linear_residual_bf16_kernel(const float* __restrict__ x, const uint16_t* __restrict__ w,
                                const float* __restrict__ residual,
                                const int32_t* __restrict__ rows, float* __restrict__ y,
                                int64_t m_rows, int64_t n_cols) {
  constexpr int64_t K = 64 * kChunks;
  const int lane = static_cast<int>(threadIdx.x & 31);
  const int g = lane & (kGroupLanes - 1);
  const int64_t warp = (static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x) >> 5;
  const int64_t warps = (static_cast<int64_t>(gridDim.x) * blockDim.x) >> 5;
  for (int64_t n0 = warp * kColumnsPerWarp; n0 < n_cols; n0 += warps * kColumnsPerWarp) {
    const int64_t n = n0 + lane / kGroupLanes;
    const bool valid = n < n_cols;
    uint4 raw[kChunks];
#pragma unroll
    for (int i = 0; i < kChunks; ++i) {
      raw[i] =
          valid ? load_stream16(w + n * K + (g + kGroupLanes * i) * 8) : make_uint4(0, 0, 0, 0);
    }
    float wf[kChunks][8];
#pragma unroll
    for (int i = 0; i < kChunks; ++i) widen_bf16x8(raw[i], wf[i]);
    for (int64_t m = 0; m < m_rows; ++m) {
      const float* xm = x + m * K;
      float acc = 0.0f;
#pragma unroll
      for (int i = 0; i < kChunks; ++i) {
        const int64_t k0 = (g + kGroupLanes * i) * 8;
        const float4 a = *reinterpret_cast<const float4*>(xm + k0);
        const float4 b = *reinterpret_cast<const float4*>(xm + k0 + 4);
        acc = fmaf(wf[i][0], a.x, acc);
        acc = fmaf(wf[i][1], a.y, acc);
        acc = fmaf(wf[i][2], a.z, acc);
        acc = fmaf(wf[i][3], a.w, acc);
        acc = fmaf(wf[i][4], b.x, acc);
        acc = fmaf(wf[i][5], b.y, acc);
        acc = fmaf(wf[i][6], b.z, acc);
        acc = fmaf(wf[i][7], b.w, acc);
      }
      acc = __fadd_rn(acc, __shfl_xor_sync(0xffffffffu, acc, 4));
      acc = __fadd_rn(acc, __shfl_xor_sync(0xffffffffu, acc, 2));
      acc = __fadd_rn(acc, __shfl_xor_sync(0xffffffffu, acc, 1));
      if (valid && g == 0) {
        const int64_t r = rows != nullptr ? rows[m] : m;
        y[m * n_cols + n] = __fadd_rn(residual[r * n_cols + n], acc);
      }
    }
  }
}

// y[m, n] = residual[rows[m], n] + y[m, n] (the fallback's second half).
__global__ void add_residual_rows_kernel(const float* __restrict__ residual,
                                         const int32_t* __restrict__ rows, float* __restrict__ y,
                                         int64_t m_rows, int64_t n_cols) {
  const int64_t total = m_rows * n_cols;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < total;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t m = i / n_cols, n = i % n_cols;
    const int64_t r = rows != nullptr ? rows[m] : m;
    y[i] = __fadd_rn(residual[r * n_cols + n], y[i]);
  }
}

bool aligned16(const void* p) {
  return (reinterpret_cast<uintptr_t>(p) & 15u) == 0;
}

template <int kChunks>
void launch_fused(cudaStream_t stream, const float* x, const uint16_t* w, const float* residual,
                  const int32_t* rows, float* y, int64_t m_rows, int64_t n_cols) {
  constexpr int64_t kColumnsPerBlock = (kThreads / 32) * kColumnsPerWarp;
  const int64_t blocks = std::min<int64_t>((n_cols + kColumnsPerBlock - 1) / kColumnsPerBlock,
                                           int64_t{sm_count()} * 64);
  linear_residual_bf16_kernel<kChunks><<<static_cast<unsigned>(blocks), kThreads, 0, stream>>>(
      x, w, residual, rows, y, m_rows, n_cols);
  check_cuda(cudaGetLastError(), "linear_residual_bf16_kernel");
}

}  // namespace

void CudaBackend::linear_residual(const Tensor& x, const Tensor& w, const Tensor& residual,
                                  const Tensor& rows, const Tensor& y) {
  constexpr const char* kOp = "linear_residual";
  check_on(*this, kOp, "x", x);
  check_on(*this, kOp, "w", w);
  check_on(*this, kOp, "residual", residual);
  check_on(*this, kOp, "y", y);
  if (!rows.empty()) check_on(*this, kOp, "rows", rows);
  ops::check_weight(kOp, "w", w);
  const ops::LinearResidualDims d = ops::check_linear_residual(kOp, x, w, residual, rows, y);
  if (d.rows == 0 || d.n == 0) return;
  const int32_t* row_ids = rows.empty() ? nullptr : rows.data_as<const int32_t>();
  const bool fusable = w.dtype() == DType::kBF16 && w.scale_data() == nullptr && d.k % 64 == 0 &&
                       d.k <= 512 && (d.k / 64 & (d.k / 64 - 1)) == 0 && aligned16(x.data()) &&
                       aligned16(w.data());
  if (fusable) {
    OpTimer timer(*this, "linear_residual");
    const auto* xp = x.data_as<const float>();
    const auto* wp = static_cast<const uint16_t*>(w.data());
    const auto* rp = residual.data_as<const float>();
    auto* yp = y.data_as<float>();
    switch (d.k / 64) {
      case 1:
        launch_fused<1>(stream(), xp, wp, rp, row_ids, yp, d.rows, d.n);
        break;
      case 2:
        launch_fused<2>(stream(), xp, wp, rp, row_ids, yp, d.rows, d.n);
        break;
      case 4:
        launch_fused<4>(stream(), xp, wp, rp, row_ids, yp, d.rows, d.n);
        break;
      default:
        launch_fused<8>(stream(), xp, wp, rp, row_ids, yp, d.rows, d.n);
        break;
    }
    return;
  }
  linear(x, w, y);
  OpTimer timer(*this, "linear_residual add");
  const int64_t total = d.rows * d.n;
  const auto blocks =
      static_cast<unsigned>(std::min<int64_t>((total + kThreads - 1) / kThreads, 65535));
  add_residual_rows_kernel<<<blocks, kThreads, 0, stream()>>>(
      residual.data_as<const float>(), row_ids, y.data_as<float>(), d.rows, d.n);
  check_cuda(cudaGetLastError(), "add_residual_rows_kernel");
}

}  // namespace specula::cuda
