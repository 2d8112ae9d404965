// SPDX-License-Identifier: Apache-2.0
// Tiled bf16-weight products for batches of rows (cuda_linear_tiled.h), with
// the numerics of cuda_linear_mma.h.
//
// Why a second kernel: the row-tile kernels of cuda_linear_mma.cu give each
// warp one of the KS K ranges of a 32-column x 32-row tile, so every warp reads
// its own x_split (6 bytes an element, three times the weights' bytes) and a
// block shares nothing through shared memory. At 64 rows (31B on an H200) the
// gate/up product read 2.8 GB of x_split from L2 a call against 0.46 GB of
// weights, and the step's products ran 5x slower than their weights stream.
//
// Here a block of 8 warps owns 128 weight rows x 64 activation rows and walks
// every K step once: each step's weights [128 x 32] and split activations
// [64 x 32 x 3 terms] are copied into shared memory (cp.async, kStages deep)
// and read by all warps; warp (wn, wm) computes weight tiles {2wn, 2wn + 1} x
// row tiles 4wm .. 4wm + 3 with mma_step, the fragments each lane would load
// from global memory in the row-tile kernels. The K ranges of mma_k_split(N)
// are walked in order: a range's steps accumulate into zeroed registers, and
// at its end the range sum is folded into the total (the first range's sum is
// the total, later ones are added), which is what the row-tile kernels'
// combine computes (sum_of: red[0] + red[1] + ... in range order). Empty
// ranges (K shorter than KS steps) fold their zeros too. So a row's bits are
// those of every other path.
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <climits>
#include <cstdint>

#include "engine/backend/cuda/cuda_backend.h"
#include "engine/backend/cuda/cuda_device_common.cuh"
#include "engine/backend/cuda/cuda_launch.cuh"
#include "engine/backend/cuda/cuda_linear_mma.h"
#include "engine/backend/cuda/cuda_linear_tiled.h"
#include "engine/backend/cuda/cuda_mma_step.cuh"
#include "engine/backend/cuda/cuda_split.cuh"

namespace specula::cuda {
namespace {

using bf16 = __nv_bfloat16;

constexpr int kStepK = kSplitStepK;          // K elements a step covers
constexpr int kChunksPerStep = kStepK / 8;   // x_split chunks a step covers
constexpr int kWarpsN = 4;                   // warps along the weight rows
constexpr int kWarpsM = 2;                   // warps along the activation rows
constexpr int kThreads = kWarpsN * kWarpsM * 32;
constexpr int kWarpTiles = 2;                // 16-row weight tiles per warp
constexpr int kWarpRowTiles = 4;             // 8-row activation tiles per warp
constexpr int kBlockW = kWarpsN * kWarpTiles * 16;     // 128 weight rows a block
constexpr int kBlockM = kWarpsM * kWarpRowTiles * 8;   // 64 activation rows a block
constexpr int kStages = 4;                   // steps in flight (see the loop's group count)
// One stage: the weights [kBlockW][32] bf16 (64 bytes a row), then the split
// activations [kBlockM][4 chunks][3 words] (192 bytes a row).
constexpr int kWRowBytes = kStepK * 2;
constexpr int kXRowBytes = kChunksPerStep * 3 * 16;
constexpr int kStageBytes = kBlockW * kWRowBytes + kBlockM * kXRowBytes;  // 20 KB
constexpr size_t kSmemBytes = size_t{kStages} * kStageBytes;              // 80 KB
// 16-byte copies per thread and stage.
constexpr int kWCopies = kBlockW * (kWRowBytes / 16) / kThreads;  // 2
constexpr int kXCopies = kBlockM * (kXRowBytes / 16) / kThreads;  // 3
static_assert(kWCopies * kThreads == kBlockW * (kWRowBytes / 16), "whole weight copies");
static_assert(kXCopies * kThreads == kBlockM * (kXRowBytes / 16), "whole activation copies");

// Which product the block computes. kGelu: gate = gelu_tanh(x · w_gateᵀ) ⊙
// (x · w_upᵀ); weight rows 0..63 of the block are 64 gate columns and 64..127
// the same up columns, and warp wn's tiles are gate and up of the same 16
// columns. Otherwise y = x · wᵀ over 128 columns, warp wn's tiles 32wn..32wn+31.
struct TiledArgs {
  const uint4* x_split;  // [m_rows][split_chunks(k)][3] words
  const bf16* w;         // [n_cols, k] (the gate's, with kGelu)
  const bf16* w_up;      // [n_cols, k] with kGelu, else unused
  float* y;              // [m_rows, n_cols]
  bf16* out_split;       // kGelu: gate's split (null: none), else unused
  int64_t m_rows, n_cols, k_dim;
  int k_split;           // mma_k_split(n_cols): the K ranges
  int row_groups;        // ceil(m_rows / kBlockM)
};

// Output columns a block covers.
template <bool kGelu>
constexpr int block_cols() {
  return kGelu ? kBlockW / 2 : kBlockW;
}

// The global row of w (or w_up) behind weight row r (0..127) of the block whose
// first output column is n0, clamped to the last column (computed, never written).
template <bool kGelu>
__device__ __forceinline__ const bf16* weight_row(const TiledArgs& a, int64_t n0, int r) {
  if constexpr (kGelu) {
    const bf16* w = r < kBlockW / 2 ? a.w : a.w_up;
    const int64_t col = min(n0 + (r % (kBlockW / 2)), a.n_cols - 1);
    return w + col * a.k_dim;
  } else {
    return a.w + min(n0 + r, a.n_cols - 1) * a.k_dim;
  }
}

// The block's first weight row of warp wn's tile c.
template <bool kGelu>
__device__ __forceinline__ int tile_row0(int wn, int c) {
  return kGelu ? c * (kBlockW / 2) + wn * 16 : (wn * kWarpTiles + c) * 16;
}

template <bool kGelu>
__global__ void __launch_bounds__(kThreads, 2) mma_tiled_kernel(TiledArgs a) {
  pdl_launch_dependents();
  extern __shared__ uint4 tiled_smem[];
  auto* smem = reinterpret_cast<unsigned char*>(tiled_smem);
  const int tid = static_cast<int>(threadIdx.x);
  const int lane = tid & 31;
  const int warp = tid >> 5;
  const int wn = warp % kWarpsN;
  const int wm = warp / kWarpsN;
  const int group = static_cast<int>(blockIdx.x % static_cast<unsigned>(a.row_groups));
  const int64_t n0 = static_cast<int64_t>(blockIdx.x / static_cast<unsigned>(a.row_groups)) *
                     block_cols<kGelu>();
  const int64_t m0 = static_cast<int64_t>(group) * kBlockM;
  const int64_t chunks = split_chunks(a.k_dim);
  const int steps = static_cast<int>(a.k_dim / kStepK);  // k_dim % 32 == 0 (tiled_path)

  // This thread's copies: weight row tid / 4 + 64 i, bytes 16 (tid % 4); split
  // row (tid + 256 i) / 12, word (tid + 256 i) % 12.
  const bf16* w_src[kWCopies];
  int w_dst[kWCopies];
#pragma unroll
  for (int i = 0; i < kWCopies; ++i) {
    const int r = tid / 4 + i * (kThreads / 4);
    w_src[i] = weight_row<kGelu>(a, n0, r) + (tid % 4) * 8;
    w_dst[i] = r * kWRowBytes + (tid % 4) * 16;
  }
  const uint4* x_src[kXCopies];
  int x_dst[kXCopies];
#pragma unroll
  for (int i = 0; i < kXCopies; ++i) {
    const int idx = tid + i * kThreads;
    const int r = idx / (kXRowBytes / 16);
    const int word = idx % (kXRowBytes / 16);
    x_src[i] = a.x_split + min(m0 + r, a.m_rows - 1) * chunks * 3 + word;
    x_dst[i] = kBlockW * kWRowBytes + r * kXRowBytes + word * 16;
  }
  const auto copy_w = [&](int step, int stage) {
#pragma unroll
    for (int i = 0; i < kWCopies; ++i) {
      cp_async16(smem + stage * kStageBytes + w_dst[i], w_src[i] + int64_t{step} * kStepK);
    }
  };
  const auto copy_x = [&](int step, int stage) {
#pragma unroll
    for (int i = 0; i < kXCopies; ++i) {
      cp_async16(smem + stage * kStageBytes + x_dst[i],
                 x_src[i] + int64_t{step} * kChunksPerStep * 3);
    }
  };

  // Prologue. Copy groups: the weights of steps 0 .. kStages-2 (before
  // pdl_wait: weights only), then one group per step's activations; the loop
  // then commits one group (weights and activations) per step. Step s's
  // activations are thus group s + 1, and at step s, s + kStages groups have
  // been committed, so waiting for all but the newest kStages - 2 lands it
  // (and its weights, in group 0 or the same group).
#pragma unroll
  for (int s = 0; s < kStages - 1; ++s) {
    if (s < steps) copy_w(s, s);
  }
  cp_async_commit();
  pdl_wait();
#pragma unroll
  for (int s = 0; s < kStages - 1; ++s) {
    if (s < steps) copy_x(s, s);
    cp_async_commit();
  }

  float acc[kWarpTiles][kWarpRowTiles][4];
  float total[kWarpTiles][kWarpRowTiles][4];
  const auto zero = [](float(&v)[kWarpTiles][kWarpRowTiles][4]) {
#pragma unroll
    for (int c = 0; c < kWarpTiles; ++c) {
#pragma unroll
      for (int j = 0; j < kWarpRowTiles; ++j) {
#pragma unroll
        for (int i = 0; i < 4; ++i) v[c][j][i] = 0.0f;
      }
    }
  };
  zero(acc);
  zero(total);
  // Range r covers steps [r · steps / KS, (r + 1) · steps / KS), as in the
  // row-tile kernels (warp_partials). fold() ends range `range`.
  int range = 0;
  const auto range_end = [&](int r) { return static_cast<int>(int64_t{r + 1} * steps / a.k_split); };
  const auto fold = [&] {
#pragma unroll
    for (int c = 0; c < kWarpTiles; ++c) {
#pragma unroll
      for (int j = 0; j < kWarpRowTiles; ++j) {
#pragma unroll
        for (int i = 0; i < 4; ++i) {
          total[c][j][i] = range == 0 ? acc[c][j][i] : total[c][j][i] + acc[c][j][i];
          acc[c][j][i] = 0.0f;
        }
      }
    }
    ++range;
  };
  while (range < a.k_split && range_end(range) == 0) fold();  // empty leading ranges

  const int g = lane >> 2;
  const int t = lane & 3;
  for (int s = 0; s < steps; ++s) {
    cp_async_wait<kStages - 2>();
    __syncthreads();  // step s has landed for everyone; step s - 1's stage is free
    const int ahead = s + kStages - 1;
    if (ahead < steps) {
      copy_w(ahead, ahead % kStages);
      copy_x(ahead, ahead % kStages);
    }
    cp_async_commit();
    const unsigned char* stage = smem + (s % kStages) * kStageBytes;
    uint4 w_frag[kWarpTiles][2];
#pragma unroll
    for (int c = 0; c < kWarpTiles; ++c) {
      const int r0 = tile_row0<kGelu>(wn, c) + g;
      w_frag[c][0] = *reinterpret_cast<const uint4*>(stage + r0 * kWRowBytes + t * 16);
      w_frag[c][1] = *reinterpret_cast<const uint4*>(stage + (r0 + 8) * kWRowBytes + t * 16);
    }
#pragma unroll
    for (int j = 0; j < kWarpRowTiles; ++j) {
      const int row = (wm * kWarpRowTiles + j) * 8 + g;
      const auto* xs = reinterpret_cast<const uint4*>(stage + kBlockW * kWRowBytes +
                                                      row * kXRowBytes + t * 48);
      const uint4 hi = xs[0];
      const uint4 mid = xs[1];
      const uint4 lo = xs[2];
      const mma::SplitX split{{hi.x, hi.y, hi.z, hi.w},
                              {mid.x, mid.y, mid.z, mid.w},
                              {lo.x, lo.y, lo.z, lo.w}};
#pragma unroll
      for (int c = 0; c < kWarpTiles; ++c) mma::mma_step(acc[c][j], w_frag[c][0], w_frag[c][1], split);
    }
    while (range < a.k_split && range_end(range) == s + 1) fold();
  }
  cp_async_wait<0>();  // no copy outlives the block

  // Epilogue: each lane writes its own entries.
#pragma unroll
  for (int j = 0; j < kWarpRowTiles; ++j) {
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const int64_t row = m0 + (wm * kWarpRowTiles + j) * 8 + mma::entry_row(i, lane);
      if (row >= a.m_rows) continue;
      if constexpr (kGelu) {
        const int64_t col = n0 + wn * 16 + mma::entry_col(i, lane);
        if (col >= a.n_cols) continue;
        const float out = __fmul_rn(gelu_tanh(total[0][j][i]), total[1][j][i]);
        a.y[row * a.n_cols + col] = out;
        if (a.out_split != nullptr) store_split(a.out_split, split_chunks(a.n_cols), row, col, out);
      } else {
#pragma unroll
        for (int c = 0; c < kWarpTiles; ++c) {
          const int64_t col = n0 + (wn * kWarpTiles + c) * 16 + mma::entry_col(i, lane);
          if (col < a.n_cols) a.y[row * a.n_cols + col] = total[c][j][i];
        }
      }
    }
  }
  if constexpr (kGelu) {
    // The split rows' zero padding past n_cols: written by the last column block.
    if (a.out_split != nullptr && n0 + block_cols<kGelu>() >= a.n_cols) {
      const int64_t pad = split_chunks(a.n_cols) * 8 - a.n_cols;
      const int64_t rows_here = min(a.m_rows - m0, static_cast<int64_t>(kBlockM));
      for (int64_t p = tid; p < rows_here * pad; p += kThreads) {
        store_split(a.out_split, split_chunks(a.n_cols), m0 + p / pad, a.n_cols + p % pad, 0.0f);
      }
    }
  }
}

template <bool kGelu>
void launch_tiled(TiledArgs a, cudaStream_t stream, const char* name) {
  const int64_t col_blocks = (a.n_cols + block_cols<kGelu>() - 1) / block_cols<kGelu>();
  const int64_t row_groups = (a.m_rows + kBlockM - 1) / kBlockM;
  const int64_t blocks = col_blocks * row_groups;
  if (blocks > INT_MAX) fail("{}: {} x {} blocks exceed the CUDA grid", name, col_blocks, row_groups);
  a.row_groups = static_cast<int>(row_groups);
  a.k_split = mma_k_split(a.n_cols);
  allow_dynamic_smem(reinterpret_cast<const void*>(mma_tiled_kernel<kGelu>), kSmemBytes, name);
  launch_pdl(mma_tiled_kernel<kGelu>, blocks, kThreads, kSmemBytes, stream, name, a);
}

}  // namespace

bool tiled_path(const void* w, int64_t m, int64_t k) {
  return m >= kTiledMinRows && (reinterpret_cast<uintptr_t>(w) & 15u) == 0 && k % kSplitStepK == 0 &&
         k / kSplitStepK <= INT_MAX;
}

void tiled_linear(const void* x_split, const void* w, float* y, int64_t m, int64_t n, int64_t k,
                  cudaStream_t stream) {
  TiledArgs a{};
  a.x_split = static_cast<const uint4*>(x_split);
  a.w = static_cast<const bf16*>(w);
  a.y = y;
  a.m_rows = m;
  a.n_cols = n;
  a.k_dim = k;
  launch_tiled<false>(a, stream, "mma_tiled_kernel");
}

void tiled_gelu_mul(const void* x_split, const void* w_gate, const void* w_up, float* gate,
                    void* out_split, int64_t m, int64_t n, int64_t k, cudaStream_t stream) {
  TiledArgs a{};
  a.x_split = static_cast<const uint4*>(x_split);
  a.w = static_cast<const bf16*>(w_gate);
  a.w_up = static_cast<const bf16*>(w_up);
  a.y = gate;
  a.out_split = static_cast<bf16*>(out_split);
  a.m_rows = m;
  a.n_cols = n;
  a.k_dim = k;
  launch_tiled<true>(a, stream, "mma_tiled_gelu_mul_kernel");
}

}  // namespace specula::cuda
