// SPDX-License-Identifier: Apache-2.0
// Batch-invariant products with bf16 weights on the tensor cores
// (cuda_linear_mma.cu). Internal to engine/backend/cuda: CudaBackend::linear,
// linear_multi and linear_gelu_mul call these for bf16 weights and
// 1 <= M <= kInvariantRows; f32 and f16 weights keep the FMA kernels of
// cuda_linear.cu.
//
// Numerics of y[m, n] = Σ_k w[n, k] · x[m, k] (x, y f32; w bf16):
// - x is split exactly, once per call by a small kernel, into three bf16 terms
//   x = hi + mid + lo (hi = bf16(x), mid = bf16(x - hi), lo = bf16(x - hi -
//   mid); three 8-bit significands hold f32's 24), so every product w · term is
//   exact and nothing of x is rounded away (an infinite or NaN x is carried by
//   hi alone).
// - K is cut into steps of 32, and the steps into mma_k_split(N) contiguous
//   ranges, one per warp of a block (of a cluster of blocks, for decode
//   products of few tiles): a function of N and K only, so fixed per weight
//   matrix. A warp adds its steps in increasing order into f32 accumulators
//   with mma.m16n8k16 (16 weight rows as A, up to 8 activation rows as B), two
//   mma per step and term in a fixed order; the ranges' partial sums are then
//   added in range order.
// - A row's result thus depends on N, K, its own x row and the weights only,
//   never on M, on which slot of which tile the row occupies, or on the
//   alignment of the operands (misaligned rows and K tails take element loads
//   with zero fill, which adds exact zeros): batch-invariant and
//   bit-reproducible.
#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>
#include <span>

namespace specula::cuda {

// Products wider than this split K over 4 warps, the others over 8: wide
// products have blocks enough to fill the GPU, and longer per-warp ranges
// stream better (measured on an H200: the 262,144-column LM head 3.78 -> 4.08
// TB/s; the 5,376-column ones lost 10-20% with 4). 16,384 columns take 8: the
// 31B full-attention q_proj then shares its k_proj's split, so the two run as
// one linear_multi launch instead of two (31B decode step on an H200, same
// run: 17.58-17.65 -> 17.48-17.49 ms).
inline constexpr int64_t kWideColumns = 16384;

// Warps per block that split K for a product of N columns: part of the
// numerics (see above).
int mma_k_split(int64_t n_cols);

// One output of a fused linear_multi launch (either product path):
// y f32 [M, n] = x · w[n, K]ᵀ, w of the launch's weight dtype.
struct ProductOut {
  const void* w;
  float* y;
  int64_t n;
};

// Bytes of the x_split scratch the calls below need for x [m, k]: x split once
// into its three bf16 terms (6 bytes per element), which every block of the
// product then reads instead of splitting x again.
size_t mma_split_bytes(int64_t m, int64_t k);

// y f32 [m, n] = x f32 [m, k] · w bf16 [n, k]ᵀ; m, n, k >= 1 and below 2^31 - 64
// (the caller checks); x_split: device scratch of mma_split_bytes(m, k) bytes.
// Queued on `stream`: a split kernel, then the product. split_ready: x_split
// already holds x's split (its producer wrote it), so no split kernel runs.
void mma_linear(const float* x, void* x_split, bool split_ready, const void* w, float* y, int64_t m,
                int64_t n, int64_t k, cudaStream_t stream);

// Every outs[i] as mma_linear would write it, x split once for all of them, in
// as few launches as the grid allows (the caller checks shapes and aliasing).
void mma_linear_multi(const float* x, void* x_split, bool split_ready,
                      std::span<const ProductOut> outs, int64_t m, int64_t k, cudaStream_t stream);

// gate f32 [m, n] = gelu_tanh(x · w_gateᵀ) ⊙ (x · w_upᵀ), each product with the
// bits mma_linear writes and the gelu_mul op's epilogue, __fmul_rn(gelu(g), u).
// out_split (null: none): also write gate's split there (mma_split_bytes(m, n)
// bytes), for the product that reads gate next.
void mma_linear_gelu_mul(const float* x, void* x_split, bool split_ready, void* out_split,
                         const void* w_gate, const void* w_up, float* gate, int64_t m, int64_t n,
                         int64_t k, cudaStream_t stream);

}  // namespace specula::cuda
