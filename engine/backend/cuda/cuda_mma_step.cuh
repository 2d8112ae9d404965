// SPDX-License-Identifier: Apache-2.0
// The tensor-core step every bf16-weight product shares (cuda_linear_mma.cu,
// cuda_linear_tiled.cu): the fragment layout of one m16n8k16 over 32 K
// elements, and where a lane's accumulator entries land. Kernels that feed
// mma_step the same weights and split activations for the same K step get the
// same bits (the numerics are in cuda_linear_mma.h). Included only by .cu files.
#pragma once

#include <cuda_bf16.h>

#include <cstdint>

namespace specula::cuda::mma {

__device__ __forceinline__ uint32_t as_bits(__nv_bfloat162 v) {
  return *reinterpret_cast<const uint32_t*>(&v);
}

// Eight activations as three bf16x2 words each: pair p holds elements 2p, 2p+1.
struct SplitX {
  uint32_t hi[4], mid[4], lo[4];
};

// d += A · B for one m16n8k16 (bf16 in, f32 accumulate).
__device__ __forceinline__ void mma_bf16(float (&d)[4], uint32_t a0, uint32_t a1, uint32_t a2,
                                         uint32_t a3, uint32_t b0, uint32_t b1) {
  asm("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, "
      "{%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

// One step of one (weight tile, row tile): w_lo/w_hi are the lane's 8 weights
// of rows g and g + 8, x its 8 activations of row g, split. The fixed order:
// fragment half 0 (words 0, 1) then half 1 (words 2, 3), each hi, mid, lo.
__device__ __forceinline__ void mma_step(float (&acc)[4], const uint4& w_lo, const uint4& w_hi,
                                         const SplitX& x) {
  mma_bf16(acc, w_lo.x, w_hi.x, w_lo.y, w_hi.y, x.hi[0], x.hi[1]);
  mma_bf16(acc, w_lo.x, w_hi.x, w_lo.y, w_hi.y, x.mid[0], x.mid[1]);
  mma_bf16(acc, w_lo.x, w_hi.x, w_lo.y, w_hi.y, x.lo[0], x.lo[1]);
  mma_bf16(acc, w_lo.z, w_hi.z, w_lo.w, w_hi.w, x.hi[2], x.hi[3]);
  mma_bf16(acc, w_lo.z, w_hi.z, w_lo.w, w_hi.w, x.mid[2], x.mid[3]);
  mma_bf16(acc, w_lo.z, w_hi.z, w_lo.w, w_hi.w, x.lo[2], x.lo[3]);
}

// Where entry i of a lane's accumulator lands: column offset within the 16-row
// weight tile and row offset within the 8-row activation tile.
__device__ __forceinline__ int entry_col(int i, int lane) {
  return (lane >> 2) + 8 * (i >> 1);
}
__device__ __forceinline__ int entry_row(int i, int lane) {
  return 2 * (lane & 3) + (i & 1);
}

}  // namespace specula::cuda::mma
