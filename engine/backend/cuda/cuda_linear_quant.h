// SPDX-License-Identifier: Apache-2.0
// Products and embedding lookups of quantized weights (i8, f8e4m3 with
// per-row f32 scales; io/quantize.h) on the GPU (cuda_linear_quant.cu).
// Internal to engine/backend/cuda: CudaBackend::linear (every M, prefill
// included) and embedding call these for quantized weights; linear_multi and
// linear_gelu_mul run their products one by one through linear.
//
// Numerics. A weight element is w = decode(q) · scale[row], one f32 product
// (__fmul_rn), exactly the value the CPU backend dequantizes to. Then
// y[m, n] = Σ_k w[n, k] · x[m, k] in a fixed order: the weight row is cut
// into chunks of 16 elements; lane l of the warp that owns column n
// accumulates chunks l, l + 32, ... in increasing order, each as fmaf in
// element order into one f32 partial sum (the last chunk may be shorter); the
// 32 partial sums are added by a fixed xor tree. One warp computes up to 8
// rows of a column, each the same way whatever M is, whether loads are
// vectorised (16-byte aligned rows, K % 16 == 0) or not: batch-invariant and
// reproducible. A simple GEMV-like kernel for drafters' decode shapes (16-byte
// weight loads, two chunks in flight per lane), not tuned further.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "engine/core/dtype.h"

namespace specula::cuda {

// y f32 [m, n] = x f32 [m, k] · dequantized w [n, k]ᵀ; w holds dtype codes
// (kI8 | kF8E4M3), scales f32 [n]; all device pointers; m, n, k >= 1.
void quant_linear(const float* x, const void* w, DType dtype, const float* scales, float* y,
                  int64_t m, int64_t n, int64_t k, cudaStream_t stream);

// out[i, :] = (decode(table[ids[i], :]) · scales[ids[i]]) · scale (two f32
// products, in that order, as the CPU computes them); a zero row for an id
// outside [0, vocab). table [vocab, h] of dtype codes; out f32 [n, h].
void quant_embedding(const void* table, DType dtype, const float* scales, const int32_t* ids,
                     float scale, float* out, int64_t n, int64_t h, int64_t vocab,
                     cudaStream_t stream);

}  // namespace specula::cuda
