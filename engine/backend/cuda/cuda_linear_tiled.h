// SPDX-License-Identifier: Apache-2.0
// Tiled tensor-core products with bf16 weights for batches of rows
// (cuda_linear_tiled.cu): the bits of cuda_linear_mma.h's kernels, with the
// weights and split activations of each K step shared by a block through
// shared memory. Internal to engine/backend/cuda: mma_linear, mma_linear_multi
// and mma_linear_gelu_mul take them for products tiled_path() admits.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

namespace specula::cuda {

// Fewest rows that take the tiled kernels (a block computes 64 rows, so
// fewer waste most of its tensor-core work; below this the row-tile kernels
// of cuda_linear_mma.cu run). Changes no bits either way.
inline constexpr int64_t kTiledMinRows = 24;

// Whether a product of m rows of length k with weights w takes the tiled
// kernels: CudaKernelChoices::tiled_products (backends.h) is on, m >= kTiledMinRows, 16-byte
// aligned w and k a multiple of 32 (whole steps, so no step needs checked loads).
bool tiled_path(const void* w, int64_t m, int64_t k);

// y f32 [m, n] = x · w bf16 [n, k]ᵀ from x's split (x_split: mma_split_bytes(m,
// k) bytes, already written), the bits of mma_linear. Queued on `stream` as a
// programmatic dependent. The caller checked tiled_path and the shapes.
void tiled_linear(const void* x_split, const void* w, float* y, int64_t m, int64_t n, int64_t k,
                  cudaStream_t stream);

// gate f32 [m, n] = gelu_tanh(x · w_gateᵀ) ⊙ (x · w_upᵀ), the bits of
// mma_linear_gelu_mul; out_split (null: none) also gets gate's split.
void tiled_gelu_mul(const void* x_split, const void* w_gate, const void* w_up, float* gate,
                    void* out_split, int64_t m, int64_t n, int64_t k, cudaStream_t stream);

}  // namespace specula::cuda
