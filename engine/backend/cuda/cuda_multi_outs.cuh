// SPDX-License-Identifier: Apache-2.0
// linear_multi's fused launches, shared by the FMA kernels (cuda_linear.cu)
// and the tensor-core kernels (cuda_linear_mma.cu): up to kMaxMultiOuts
// products of one x in one grid, the concatenation of each output's own grid.
// Included only by .cu files.
#pragma once

#include <climits>
#include <cstdint>
#include <span>

#include "engine/backend/cuda/cuda_linear_mma.h"
#include "engine/core/error.h"

namespace specula::cuda {

inline constexpr int kMaxMultiOuts = 4;

// The outputs of one launch, passed by value (kernel parameter space).
template <typename T>
struct MultiOuts {
  const T* w[kMaxMultiOuts];
  float* y[kMaxMultiOuts];
  int64_t n_cols[kMaxMultiOuts];
  int first_block[kMaxMultiOuts];  // first block of output o; first_block[0] == 0
  int count;                       // outputs in use (1 .. kMaxMultiOuts)
};

// The output block `b` of a multi launch belongs to (the last o with
// first_block[o] <= b), and b's index within that output's own grid.
template <typename T>
struct PickedOutput {
  const T* w;
  float* y;
  int64_t n_cols;
  int local_block;
};

template <typename T>
__device__ __forceinline__ PickedOutput<T> pick_output(const MultiOuts<T>& outs, int b) {
  // Constant indices only: a dynamic index into the parameter struct could
  // make the compiler copy it to local memory.
  PickedOutput<T> p{outs.w[0], outs.y[0], outs.n_cols[0], b};
#pragma unroll
  for (int o = 1; o < kMaxMultiOuts; ++o) {
    if (o < outs.count && b >= outs.first_block[o]) {
      p = {outs.w[o], outs.y[o], outs.n_cols[o], b - outs.first_block[o]};
    }
  }
  return p;
}

// Packs the outputs with n > 0 into launches of at most kMaxMultiOuts outputs
// whose blocks fit the CUDA grid, calling launch(batch, blocks) for each;
// blocks_of(n) is the grid of one output of n columns.
template <typename T, typename BlocksOf, typename Launch>
void launch_multi_batches(std::span<const ProductOut> outs, BlocksOf&& blocks_of, Launch&& launch) {
  MultiOuts<T> batch{};
  int64_t blocks = 0;
  const auto flush = [&] {
    if (batch.count == 0) return;
    launch(batch, blocks);
    batch = MultiOuts<T>{};
    blocks = 0;
  };
  for (const ProductOut& o : outs) {
    if (o.n == 0) continue;
    const int64_t out_blocks = blocks_of(o.n);
    if (out_blocks > INT_MAX) {
      fail("linear_multi: an output of {} columns needs {} blocks, more than the CUDA grid", o.n,
           out_blocks);
    }
    if (batch.count == kMaxMultiOuts || blocks + out_blocks > INT_MAX) flush();
    batch.w[batch.count] = static_cast<const T*>(o.w);
    batch.y[batch.count] = o.y;
    batch.n_cols[batch.count] = o.n;
    batch.first_block[batch.count] = static_cast<int>(blocks);
    ++batch.count;
    blocks += out_blocks;
  }
  flush();
}

}  // namespace specula::cuda
