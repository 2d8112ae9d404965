// SPDX-License-Identifier: Apache-2.0
// The exact three-term bf16 split of f32 activations (x = hi + mid + lo, every
// bit kept) and its x_split layout: what the tensor-core products read, and
// what a producer (rms_norm_add_norm) may write for the product after it so
// that no split kernel runs in between. Included only by .cu files.
#pragma once

#include <cuda_bf16.h>

#include <cstdint>

namespace specula::cuda {

// K elements per tensor-core step; x_split rows hold whole steps.
inline constexpr int kSplitStepK = 32;

// Chunks of 8 elements per x_split row: whole steps of 32 elements, so that
// the 4 chunks a step reads always lie in the row (those past K are zero).
__host__ __device__ constexpr int64_t split_chunks(int64_t k_dim) {
  return (k_dim + kSplitStepK - 1) / kSplitStepK * (kSplitStepK / 8);
}

// The remainder x - part, or 0 when it is NaN (x infinite or NaN: hi alone then
// carries x, as the product with an f32 x would). A finite x beyond bf16's
// largest finite value (> 3.39e38) would still come out NaN.
__device__ __forceinline__ float split_remainder(float x, float part) {
  const float r = __fsub_rn(x, part);
  return r == r ? r : 0.0f;
}

// One activation's three terms, element by element (the pairwise bf16x2
// conversions of the products round each half exactly like this).
struct SplitTerms {
  __nv_bfloat16 hi, mid, lo;
};
__device__ __forceinline__ SplitTerms split_one(float v) {
  const __nv_bfloat16 hi = __float2bfloat16_rn(v);
  const float r = split_remainder(v, __bfloat162float(hi));
  const __nv_bfloat16 mid = __float2bfloat16_rn(r);
  const __nv_bfloat16 lo = __float2bfloat16_rn(__fsub_rn(r, __bfloat162float(mid)));
  return {hi, mid, lo};
}

// x_split layout: row m, chunk c (elements 8c .. 8c + 7; zero past K) is three
// consecutive 16-byte words at x_split + (m · chunks + c) · 3: hi, mid, lo.
// Writes element e of row m (v = 0 for the zero padding past K).
__device__ __forceinline__ void store_split(__nv_bfloat16* x_split, int64_t chunks, int64_t m,
                                            int64_t e, float v) {
  const SplitTerms s = split_one(v);
  __nv_bfloat16* chunk = x_split + ((m * chunks + e / 8) * 3) * 8 + e % 8;
  chunk[0] = s.hi;
  chunk[8] = s.mid;
  chunk[16] = s.lo;
}

}  // namespace specula::cuda
