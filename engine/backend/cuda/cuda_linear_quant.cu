// SPDX-License-Identifier: Apache-2.0
// Quantized-weight linear and embedding: see cuda_linear_quant.h.
#include "engine/backend/cuda/cuda_linear_quant.h"

#include <cuda_runtime.h>

#include <algorithm>
#include <climits>

#include "engine/backend/cuda/cuda_backend.h"
#include "engine/backend/cuda/cuda_device_common.cuh"

namespace specula::cuda {
namespace {

constexpr int kQuantWarps = 4;  // columns per block (one per warp)
constexpr int kQuantThreads = kQuantWarps * 32;
constexpr int kQuantRows = 8;    // activation rows per warp and pass over the weights
constexpr int kQuantChunk = 16;  // weight elements per lane step: part of the numerics
constexpr unsigned kFullMask = 0xffffffffu;

// The code's value, exactly as the host's decode (int8 value; e4m3_to_f32).
template <DType kDt>
__device__ __forceinline__ float decode(uint32_t code) {
  if constexpr (kDt == DType::kI8) {
    return static_cast<float>(static_cast<int8_t>(static_cast<uint8_t>(code)));
  } else {
    return e4m3_bits_to_f32(code);
  }
}

// The weights of chunk `c` of row `wr` (K elements) as f32: decode(q) · s,
// elements past K as 0 (never used). kVec: one 16-byte load (the row and the
// chunk 16-byte aligned, K % kQuantChunk == 0); else one byte at a time. Both
// give the same values.
template <DType kDt, bool kVec>
__device__ __forceinline__ void load_weights(const uint8_t* wr, int k, int c, float s,
                                             float (&wf)[kQuantChunk]) {
  const int64_t k0 = static_cast<int64_t>(c) * kQuantChunk;
  if constexpr (kVec) {
    const uint4 v = __ldg(reinterpret_cast<const uint4*>(wr + k0));
    const uint32_t words[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
    for (int j = 0; j < kQuantChunk; ++j)
      wf[j] = __fmul_rn(decode<kDt>(words[j / 4] >> (8 * (j % 4))), s);
  } else {
    const int count = min(kQuantChunk, static_cast<int>(k - k0));
#pragma unroll
    for (int j = 0; j < kQuantChunk; ++j)
      wf[j] = j < count ? __fmul_rn(decode<kDt>(__ldg(wr + k0 + j)), s) : 0.0f;
  }
}

// acc[g] += wf[j] · x[m0 + g, k0 + j] for the chunk's elements, one fmaf at a
// time in j order, for the block's `rows` rows: a row's arithmetic is the same
// whatever `rows` is. kVec (x 16-byte aligned, K % kQuantChunk == 0): x is read
// four floats a load, which changes only how x arrives, never the fmaf order
// (scalar loads made the load units, not the weights, the limit at 8 rows).
template <bool kVec>
__device__ __forceinline__ void accumulate(const float* x, int k, int m0, int rows, int c,
                                           const float (&wf)[kQuantChunk],
                                           float (&acc)[kQuantRows]) {
  const int64_t k0 = static_cast<int64_t>(c) * kQuantChunk;
  const int count = min(kQuantChunk, static_cast<int>(k - k0));
#pragma unroll
  for (int g = 0; g < kQuantRows; ++g) {
    if (g >= rows) break;
    const float* xr = x + static_cast<int64_t>(m0 + g) * k + k0;
    if constexpr (kVec) {
#pragma unroll
      for (int q = 0; q < kQuantChunk / 4; ++q) {
        const float4 v = *reinterpret_cast<const float4*>(xr + 4 * q);
        acc[g] = fmaf(wf[4 * q], v.x, acc[g]);
        acc[g] = fmaf(wf[4 * q + 1], v.y, acc[g]);
        acc[g] = fmaf(wf[4 * q + 2], v.z, acc[g]);
        acc[g] = fmaf(wf[4 * q + 3], v.w, acc[g]);
      }
    } else {
#pragma unroll
      for (int j = 0; j < kQuantChunk; ++j) {
        if (j < count) acc[g] = fmaf(wf[j], xr[j], acc[g]);
      }
    }
  }
}

// Grid: x over column blocks of kQuantWarps columns, y over groups of
// kQuantRows activation rows. Warp w of block b owns column b·kQuantWarps + w.
template <DType kDt, bool kVec>
__global__ void __launch_bounds__(kQuantThreads)
    quant_linear_kernel(const float* x, const uint8_t* __restrict__ w,
                        const float* __restrict__ scales, float* y, int m, int n, int k) {
  const int col = static_cast<int>(blockIdx.x) * kQuantWarps + static_cast<int>(threadIdx.x >> 5);
  const int lane = static_cast<int>(threadIdx.x & 31u);
  if (col >= n) return;  // warp-uniform; no block barrier
  const int m0 = static_cast<int>(blockIdx.y) * kQuantRows;
  const int rows = min(kQuantRows, m - m0);
  const uint8_t* wr = w + static_cast<int64_t>(col) * k;
  const float s = scales[col];
  float acc[kQuantRows];
#pragma unroll
  for (int g = 0; g < kQuantRows; ++g) acc[g] = 0.0f;
  const int n_chunks = (k + kQuantChunk - 1) / kQuantChunk;
  // Lane `lane` takes chunks lane, lane + 32, ... in increasing order; two
  // are loaded before either is used (more bytes in flight), which changes
  // only when the loads issue, never the order of the fmaf.
  int c = lane;
  for (; c + 32 < n_chunks; c += 64) {
    float wa[kQuantChunk], wb[kQuantChunk];
    load_weights<kDt, kVec>(wr, k, c, s, wa);
    load_weights<kDt, kVec>(wr, k, c + 32, s, wb);
    accumulate<kVec>(x, k, m0, rows, c, wa, acc);
    accumulate<kVec>(x, k, m0, rows, c + 32, wb, acc);
  }
  for (; c < n_chunks; c += 32) {
    float wa[kQuantChunk];
    load_weights<kDt, kVec>(wr, k, c, s, wa);
    accumulate<kVec>(x, k, m0, rows, c, wa, acc);
  }
#pragma unroll
  for (int g = 0; g < kQuantRows; ++g) {
    float v = acc[g];
#pragma unroll
    for (int offset = 16; offset > 0; offset >>= 1) v += __shfl_xor_sync(kFullMask, v, offset);
    if (lane == 0 && g < rows) y[static_cast<int64_t>(m0 + g) * n + col] = v;
  }
}

template <DType kDt>
__global__ void quant_embedding_kernel(const uint8_t* __restrict__ table,
                                       const float* __restrict__ scales,
                                       const int32_t* __restrict__ ids, float scale,
                                       float* __restrict__ out, int64_t n, int64_t h,
                                       int64_t vocab) {
  for (int64_t row = blockIdx.y; row < n; row += gridDim.y) {
    const int64_t id = ids[row];
    const bool valid = id >= 0 && id < vocab;
    const uint8_t* src = table + (valid ? id : 0) * h;
    const float s = scales[valid ? id : 0];
    float* dst = out + row * h;
    for (int64_t j = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; j < h;
         j += static_cast<int64_t>(gridDim.x) * blockDim.x) {
      dst[j] = valid ? __fmul_rn(__fmul_rn(decode<kDt>(src[j]), s), scale) : 0.0f;
    }
  }
}

template <typename F>
void with_quant_dtype(DType dtype, F&& f) {
  switch (dtype) {
    case DType::kI8:
      return f(std::integral_constant<DType, DType::kI8>{});
    case DType::kF8E4M3:
      return f(std::integral_constant<DType, DType::kF8E4M3>{});
    default:
      fail("quantized kernels: {} is not a quantized dtype", dtype_name(dtype));
  }
}

}  // namespace

void quant_linear(const float* x, const void* w, DType dtype, const float* scales, float* y,
                  int64_t m, int64_t n, int64_t k, cudaStream_t stream) {
  const int64_t col_blocks = (n + kQuantWarps - 1) / kQuantWarps;
  const int64_t row_groups = (m + kQuantRows - 1) / kQuantRows;
  if (col_blocks > INT_MAX || row_groups > 65535 || k > INT_MAX - kQuantChunk) {
    fail("linear: a quantized product of {} x {} x {} exceeds the kernel's grid", m, n, k);
  }
  const dim3 grid(static_cast<unsigned>(col_blocks), static_cast<unsigned>(row_groups));
  // Vector loads need K % 16 == 0 and 16-byte aligned w and x; the bits are the same either way.
  const bool vec = k % kQuantChunk == 0 && (reinterpret_cast<uintptr_t>(w) & 15u) == 0 &&
                   (reinterpret_cast<uintptr_t>(x) & 15u) == 0;
  const auto* codes = static_cast<const uint8_t*>(w);
  with_quant_dtype(dtype, [&](auto tag) {
    constexpr DType kDt = decltype(tag)::value;
    if (vec) {
      quant_linear_kernel<kDt, true><<<grid, kQuantThreads, 0, stream>>>(
          x, codes, scales, y, static_cast<int>(m), static_cast<int>(n), static_cast<int>(k));
    } else {
      quant_linear_kernel<kDt, false><<<grid, kQuantThreads, 0, stream>>>(
          x, codes, scales, y, static_cast<int>(m), static_cast<int>(n), static_cast<int>(k));
    }
  });
  check_cuda(cudaGetLastError(), "quant_linear_kernel");
}

void quant_embedding(const void* table, DType dtype, const float* scales, const int32_t* ids,
                     float scale, float* out, int64_t n, int64_t h, int64_t vocab,
                     cudaStream_t stream) {
  constexpr int kThreads = 256;
  const dim3 grid(static_cast<unsigned>(std::min<int64_t>(blocks_for(h, kThreads), 64)),
                  static_cast<unsigned>(std::min<int64_t>(n, 65535)));
  // A plain launch like the float embedding (cuda_embedding.cu): it waits for
  // everything queued before it (attention_with_inputs' ordering promise).
  with_quant_dtype(dtype, [&](auto tag) {
    constexpr DType kDt = decltype(tag)::value;
    quant_embedding_kernel<kDt><<<grid, kThreads, 0, stream>>>(
        static_cast<const uint8_t*>(table), scales, ids, scale, out, n, h, vocab);
  });
  check_cuda(cudaGetLastError(), "quant_embedding_kernel");
}

}  // namespace specula::cuda
