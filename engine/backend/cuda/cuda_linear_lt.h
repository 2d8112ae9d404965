// SPDX-License-Identifier: Apache-2.0
// The cuBLASLt products of CudaBackend::linear (cuda_linear_lt.cu). Internal to
// engine/backend/cuda.
#pragma once

#include "engine/backend/cuda/cuda_backend.h"

namespace specula::cuda {

// y f32 [M, N] = x f32 [M, K] · w [N, K]ᵀ (f32|bf16|f16) through cuBLASLt on bf16
// copies of x (and of w when it is not bf16), f32 accumulation, queued on
// be.stream(); arguments already checked by linear(). Returns true, or false
// (having queued nothing) when cuBLASLt has no algorithm for the shape.
// Deterministic per shape but not batch-invariant. Uses be's lt_workspace_,
// x_bf16_ and w_bf16_ scratch.
bool linear_lt(CudaBackend& be, const Tensor& x, const Tensor& w, const Tensor& y);

}  // namespace specula::cuda
