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
// Here a cluster of KS blocks (KS = mma_k_split(N), the K ranges) owns 128
// weight rows x 64 activation rows; block rank r walks the K steps of range r:
// each step's weights [128 x 32] and split activations [64 x 32 x 3 terms] are
// copied into shared memory (cp.async, kStages deep) and read by all 8 warps;
// warp (wn, wm) computes weight tiles {2wn, 2wn + 1} x row tiles 4wm .. 4wm + 3
// with mma_step, the fragments each lane would load from global memory in the
// row-tile kernels, into zeroed accumulators. The ranges' sums are then added
// in range order through distributed shared memory (red of rank 0, plus rank
// 1's, ...), which is the row-tile kernels' combine (sum_of), empty ranges'
// zeros included. So a row's bits are those of every other path.
//
// (The first version walked all of K in one block, folding the ranges in
// order: correct, but the 5,376-column products of 31B then ran on 42 blocks,
// and a batch-64 step took 177 ms instead of 107 on an H200.)
#include <cooperative_groups.h>
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <climits>
#include <cstdint>

#include "engine/backend/backends.h"
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

constexpr int kStepK = kSplitStepK;         // K elements a step covers
constexpr int kChunksPerStep = kStepK / 8;  // x_split chunks a step covers
constexpr int kWarpsN = 4;                  // warps along the weight rows
constexpr int kWarpsM = 2;                  // warps along the activation rows
constexpr int kThreads = kWarpsN * kWarpsM * 32;
constexpr int kWarpTiles = 2;                         // 16-row weight tiles per warp
constexpr int kWarpRowTiles = 4;                      // 8-row activation tiles per warp
constexpr int kBlockW = kWarpsN * kWarpTiles * 16;    // 128 weight rows a block
constexpr int kBlockM = kWarpsM * kWarpRowTiles * 8;  // 64 activation rows a block
constexpr int kStages = 4;  // steps in flight (see the loop's group count)
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
  int row_groups;  // ceil(m_rows / kBlockM)
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

// Shared memory of the range-order combine after the main loop (reusing the
// pipeline's): red[warp][entry][lane], entry e = (c · kWarpRowTiles + j) · 4 + i
// of the warp's accumulators.
struct TiledCombine {
  float red[kWarpsN * kWarpsM][kWarpTiles * kWarpRowTiles * 4][32];
};
static_assert(sizeof(TiledCombine) <= kSmemBytes, "the combine fits the pipeline's memory");

// A cluster of KS blocks computes one tile: block rank r sums K range r of
// mma_k_split(N) (steps [r · steps / KS, (r + 1) · steps / KS)) into zeroed
// accumulators, as warp r of a row-tile kernel does, and the ranges' sums are
// then added in range order through distributed shared memory (red of rank 0,
// plus rank 1's, ...: sum_of's order), each rank adding a slice of the tile.
// Grid: KS blocks per (column block, row group), rank fastest, then the row
// group, so that the blocks streaming the same weights run together.
template <bool kGelu, int KS>
__global__ void __cluster_dims__(KS, 1, 1) __launch_bounds__(kThreads, 2)
    mma_tiled_kernel(TiledArgs a) {
  namespace cg = cooperative_groups;
  pdl_launch_dependents();
  extern __shared__ uint4 tiled_smem[];
  auto* smem = reinterpret_cast<unsigned char*>(tiled_smem);
  const int tid = static_cast<int>(threadIdx.x);
  const int lane = tid & 31;
  const int warp = tid >> 5;
  const int wn = warp % kWarpsN;
  const int wm = warp / kWarpsN;
  const int rank = static_cast<int>(blockIdx.x % KS);
  const unsigned tile = blockIdx.x / KS;
  const int group = static_cast<int>(tile % static_cast<unsigned>(a.row_groups));
  const int64_t n0 =
      static_cast<int64_t>(tile / static_cast<unsigned>(a.row_groups)) * block_cols<kGelu>();
  const int64_t m0 = static_cast<int64_t>(group) * kBlockM;
  const int64_t chunks = split_chunks(a.k_dim);
  const int64_t steps_all = a.k_dim / kStepK;  // k_dim % 32 == 0 (tiled_path)
  const int s_begin = static_cast<int>(rank * steps_all / KS);
  const int steps = static_cast<int>((rank + 1) * steps_all / KS) - s_begin;

  // This thread's copies: weight row tid / 4 + 64 i, bytes 16 (tid % 4); split
  // row (tid + 256 i) / 12, word (tid + 256 i) % 12; all from step s_begin.
  const bf16* w_src[kWCopies];
#pragma unroll
  for (int i = 0; i < kWCopies; ++i) {
    const int r = tid / 4 + i * (kThreads / 4);
    w_src[i] = weight_row<kGelu>(a, n0, r) + (tid % 4) * 8 + int64_t{s_begin} * kStepK;
  }
  const uint4* x_src[kXCopies];
#pragma unroll
  for (int i = 0; i < kXCopies; ++i) {
    const int idx = tid + i * kThreads;
    const int r = idx / (kXRowBytes / 16);
    x_src[i] = a.x_split + min(m0 + r, a.m_rows - 1) * chunks * 3 + idx % (kXRowBytes / 16) +
               int64_t{s_begin} * kChunksPerStep * 3;
  }
  const auto copy_w = [&](int step, int stage) {
#pragma unroll
    for (int i = 0; i < kWCopies; ++i) {
      const int r = tid / 4 + i * (kThreads / 4);
      cp_async16(smem + stage * kStageBytes + r * kWRowBytes + (tid % 4) * 16,
                 w_src[i] + int64_t{step} * kStepK);
    }
  };
  const auto copy_x = [&](int step, int stage) {
#pragma unroll
    for (int i = 0; i < kXCopies; ++i) {
      const int idx = tid + i * kThreads;
      cp_async16(smem + stage * kStageBytes + kBlockW * kWRowBytes + idx * 16,
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
#pragma unroll
  for (int c = 0; c < kWarpTiles; ++c) {
#pragma unroll
    for (int j = 0; j < kWarpRowTiles; ++j) {
#pragma unroll
      for (int i = 0; i < 4; ++i) acc[c][j][i] = 0.0f;
    }
  }
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
      const auto* xs =
          reinterpret_cast<const uint4*>(stage + kBlockW * kWRowBytes + row * kXRowBytes + t * 48);
      const uint4 hi = xs[0];
      const uint4 mid = xs[1];
      const uint4 lo = xs[2];
      const mma::SplitX split{
          {hi.x, hi.y, hi.z, hi.w}, {mid.x, mid.y, mid.z, mid.w}, {lo.x, lo.y, lo.z, lo.w}};
#pragma unroll
      for (int c = 0; c < kWarpTiles; ++c) {
        mma::mma_step(acc[c][j], w_frag[c][0], w_frag[c][1], split);
      }
    }
  }
  cp_async_wait<0>();  // no copy outlives the loop
  __syncthreads();     // every warp is done with the stages: they become the combine

  auto& sh = *reinterpret_cast<TiledCombine*>(smem);
#pragma unroll
  for (int c = 0; c < kWarpTiles; ++c) {
#pragma unroll
    for (int j = 0; j < kWarpRowTiles; ++j) {
#pragma unroll
      for (int i = 0; i < 4; ++i)
        sh.red[warp][(c * kWarpRowTiles + j) * 4 + i][lane] = acc[c][j][i];
    }
  }
  cg::cluster_group cluster = cg::this_cluster();
  cluster.sync();  // every rank's range sums are in its shared memory

  // Items (warp, j, i, lane): both weight tiles' entries of one accumulator
  // slot; rank r adds items r, r + KS, ...
  constexpr int kItems = kWarpsN * kWarpsM * kWarpRowTiles * 4 * 32;
  const auto range_sum = [&](int w, int e, int l) {
    float v = cluster.map_shared_rank(&sh, 0)->red[w][e][l];
#pragma unroll
    for (int r = 1; r < KS; ++r) v += cluster.map_shared_rank(&sh, r)->red[w][e][l];
    return v;
  };
  for (int item = rank * kThreads + tid; item < kItems; item += KS * kThreads) {
    const int l = item & 31;
    const int slot = (item >> 5) % (kWarpRowTiles * 4);  // j · 4 + i
    const int w = (item >> 5) / (kWarpRowTiles * 4);
    const int j = slot >> 2;
    const int i = slot & 3;
    const int item_wn = w % kWarpsN;
    const int item_wm = w / kWarpsN;
    const int64_t row = m0 + (item_wm * kWarpRowTiles + j) * 8 + mma::entry_row(i, l);
    if (row >= a.m_rows) continue;
    if constexpr (kGelu) {
      const int64_t col = n0 + item_wn * 16 + mma::entry_col(i, l);
      if (col >= a.n_cols) continue;
      const float gate = range_sum(w, slot, l);
      const float up = range_sum(w, kWarpRowTiles * 4 + slot, l);
      const float out = __fmul_rn(gelu_tanh(gate), up);
      a.y[row * a.n_cols + col] = out;
      if (a.out_split != nullptr) store_split(a.out_split, split_chunks(a.n_cols), row, col, out);
    } else {
#pragma unroll
      for (int c = 0; c < kWarpTiles; ++c) {
        const int64_t col = n0 + (item_wn * kWarpTiles + c) * 16 + mma::entry_col(i, l);
        if (col < a.n_cols)
          a.y[row * a.n_cols + col] = range_sum(w, c * kWarpRowTiles * 4 + slot, l);
      }
    }
  }
  if constexpr (kGelu) {
    // The split rows' zero padding past n_cols: rank 0 of the last column block.
    if (a.out_split != nullptr && rank == 0 && n0 + block_cols<kGelu>() >= a.n_cols) {
      const int64_t pad = split_chunks(a.n_cols) * 8 - a.n_cols;
      const int64_t rows_here = min(a.m_rows - m0, static_cast<int64_t>(kBlockM));
      for (int64_t p = tid; p < rows_here * pad; p += kThreads) {
        store_split(a.out_split, split_chunks(a.n_cols), m0 + p / pad, a.n_cols + p % pad, 0.0f);
      }
    }
  }
  cluster.sync();  // the other ranks' shared memory stays until everyone has read it
}

template <bool kGelu>
void launch_tiled(TiledArgs a, cudaStream_t stream, const char* name) {
  const int64_t col_blocks = (a.n_cols + block_cols<kGelu>() - 1) / block_cols<kGelu>();
  const int64_t row_groups = (a.m_rows + kBlockM - 1) / kBlockM;
  const int ks = mma_k_split(a.n_cols);
  const int64_t blocks = col_blocks * row_groups * ks;
  if (blocks > INT_MAX)
    fail("{}: {} x {} tiles exceed the CUDA grid", name, col_blocks, row_groups);
  a.row_groups = static_cast<int>(row_groups);
  const auto launch = [&](auto kernel) {
    allow_dynamic_smem(reinterpret_cast<const void*>(kernel), kSmemBytes, name);
    launch_pdl(kernel, blocks, kThreads, kSmemBytes, stream, name, a);
  };
  if (ks == 4) {
    launch(mma_tiled_kernel<kGelu, 4>);
  } else {
    launch(mma_tiled_kernel<kGelu, 8>);
  }
}

}  // namespace

bool tiled_path(const void* w, int64_t m, int64_t k) {
  return cuda_kernel_choices().tiled_products && m >= kTiledMinRows &&
         (reinterpret_cast<uintptr_t>(w) & 15u) == 0 && k % kSplitStepK == 0 &&
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
