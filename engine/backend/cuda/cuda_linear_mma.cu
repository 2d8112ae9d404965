// SPDX-License-Identifier: Apache-2.0
// Batch-invariant products with bf16 weights on the tensor cores; the numerics
// are described in cuda_linear_mma.h.
//
// Why tensor cores for a memory-bound GEMV: with FMA a product of M rows costs
// M fmaf per weight element plus the widening, which made the 2-8 row products
// of verify windows issue-bound (2.1-3.4 TB/s against 3.4-3.9 at one row). One
// m16n8k16 consumes 256 weight elements for up to 8 rows, so 1 to 8 rows cost
// the same few instructions per byte and the weights stream at the same rate.
//
// Layout. A block of KS warps (KS = mma_k_split(N)) owns kTileCols · CT output
// columns (CT weight tiles of 16 rows) and 8 · NT activation rows (NT row
// tiles); its warps each take a contiguous range of the K steps. Lane
// (g = lane / 4, t = lane % 4) loads, per step and tile, 8 consecutive weights
// of rows g and g + 8 at k = 32·step + 8t (one 16-byte load each) and the split
// of the 8 activations of row g at the same k. mma.m16n8k16 pairs k indices by
// position in the fragment, not by value, so the lane's 8 elements are fed as
// the fragment's columns {2t, 2t+1, 2t+8, 2t+9} of two mma (words 0,1 then
// 2,3): A and B see the same permutation of k, which leaves each dot product
// unchanged.
#include <cooperative_groups.h>
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <climits>
#include <cstdint>
#include <type_traits>

#include "engine/backend/cuda/cuda_backend.h"
#include "engine/backend/cuda/cuda_device_common.cuh"
#include "engine/backend/cuda/cuda_launch.cuh"
#include "engine/backend/cuda/cuda_linear_mma.h"
#include "engine/backend/cuda/cuda_linear_tiled.h"
#include "engine/backend/cuda/cuda_mma_step.cuh"
#include "engine/backend/cuda/cuda_multi_outs.cuh"
#include "engine/backend/cuda/cuda_split.cuh"

namespace specula::cuda {
namespace {

using bf16 = __nv_bfloat16;
using mma::as_bits;
using mma::entry_col;
using mma::entry_row;
using mma::mma_step;
using mma::SplitX;

constexpr int kStepK = kSplitStepK;  // k elements per warp step (8 per lane)
constexpr int kTileCols = 16;        // weight rows (output columns) of one mma tile
constexpr int kTileRows = 8;         // activation rows of one mma tile
constexpr int kMaxRowTiles = 4;      // row tiles per pass over the weights

// ---- loads ----

// Eight bf16 weights at row + k as raw bits (element j in half j % 2 of word
// j / 2), element by element (no alignment needed); elements at or past k_dim
// are zero. The tail step and misaligned rows.
__device__ __forceinline__ uint4 load_w8_checked(const bf16* row, int64_t k, int64_t k_dim) {
  const auto* q = reinterpret_cast<const unsigned short*>(row);
  uint32_t words[4] = {0, 0, 0, 0};
#pragma unroll
  for (int j = 0; j < 8; ++j) {
    if (k + j < k_dim) words[j / 2] |= static_cast<uint32_t>(__ldg(q + k + j)) << (16 * (j % 2));
  }
  return make_uint4(words[0], words[1], words[2], words[3]);
}

// ---- the exact three-term split ----

__device__ __forceinline__ SplitX split_x(const float (&v)[8]) {
  SplitX s;
#pragma unroll
  for (int p = 0; p < 4; ++p) {
    const float a = v[2 * p];
    const float b = v[2 * p + 1];
    // Element by element, as producers writing x_split do (store_split).
    const SplitTerms ta = split_one(a);
    const SplitTerms tb = split_one(b);
    s.hi[p] = as_bits(__halves2bfloat162(ta.hi, tb.hi));
    s.mid[p] = as_bits(__halves2bfloat162(ta.mid, tb.mid));
    s.lo[p] = as_bits(__halves2bfloat162(ta.lo, tb.lo));
  }
  return s;
}

// x_split layout: row m, chunk c (elements 8c .. 8c + 7; zero past K) is three
// consecutive uint4 at x_split + (m · chunks + c) · 3: hi, mid, lo words.
__device__ __forceinline__ SplitX load_split(const uint4* p) {
  const uint4 hi = load_act(p);
  const uint4 mid = load_act(p + 1);
  const uint4 lo = load_act(p + 2);
  return SplitX{{hi.x, hi.y, hi.z, hi.w}, {mid.x, mid.y, mid.z, mid.w}, {lo.x, lo.y, lo.z, lo.w}};
}

// Splits every 8-element chunk of x f32 [m_rows, k_dim] into x_split (one
// thread per chunk). Once per product (or per group of products of one x), so
// the product kernels, whose blocks all read the whole x, do not each split it
// again. A programmatic dependent like the products: it reads x only after
// pdl_wait().
__global__ void __launch_bounds__(256)
    split_x_kernel(const float* __restrict__ x, uint4* __restrict__ x_split, int64_t m_rows,
                   int64_t k_dim, int64_t chunks) {
  pdl_launch_dependents();
  pdl_wait();
  const int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= m_rows * chunks) return;
  const int64_t m = i / chunks;
  const int64_t k = (i - m * chunks) * 8;
  const float* row = x + m * k_dim;
  float v[8];
  const bool vec = k + 8 <= k_dim && (reinterpret_cast<uintptr_t>(row + k) & 15u) == 0;
#pragma unroll
  for (int j = 0; j < 8; ++j) v[j] = 0.0f;
  if (vec) {
    const float4 a = load_act(reinterpret_cast<const float4*>(row + k));
    const float4 b = load_act(reinterpret_cast<const float4*>(row + k) + 1);
    v[0] = a.x, v[1] = a.y, v[2] = a.z, v[3] = a.w;
    v[4] = b.x, v[5] = b.y, v[6] = b.z, v[7] = b.w;
  } else {
#pragma unroll
    for (int j = 0; j < 8; ++j) {
      if (k + j < k_dim) v[j] = load_act(row + k + j);
    }
  }
  const SplitX s = split_x(v);
  uint4* out = x_split + i * 3;
  out[0] = make_uint4(s.hi[0], s.hi[1], s.hi[2], s.hi[3]);
  out[1] = make_uint4(s.mid[0], s.mid[1], s.mid[2], s.mid[3]);
  out[2] = make_uint4(s.lo[0], s.lo[1], s.lo[2], s.lo[3]);
}

// Steps of weights in flight per lane on the register path: a ring of U
// buffers, each refilled with the step U ahead as soon as it has been used, so
// U steps stay in flight without register copies.
template <int CT, int NT>
constexpr int ring_steps() {
  return CT * NT == 1 ? 4 : 2;
}

// Single-row products (decode) stream the weights through a per-lane cp.async
// pipeline of PS steps in shared memory instead of the register ring: more
// bytes in flight per warp (up to 8 KB) at fewer registers. Each lane reads back
// only what it copied itself, so no barrier is needed. Products of 2-8 rows
// (one row tile) take the same pipeline, with x from x_split, when they have
// at least a block per SM and rows of at least kRowsPipelineMinK: there the
// ring's 4 KB a warp left the weights latency bound (31B verify window on an
// H200: 21.34 -> 20.58 ms). Smaller ones keep the ring (PS = 0): E2B's and
// E4B's verify windows got 3-8% slower with the pipeline (its shared memory
// leaves less L1 for the x_split rows every lane reads, and short rows give
// the pipeline few steps). Where the weights wait never changes the sums.
template <int CT>
constexpr int kDecodePipeSteps = 8 / CT;
// Grids of single tiles larger than three 8-warp blocks per SM (q/k/v: 1,024
// blocks at 31B) take 5 steps instead, so that four 8-warp blocks fit an SM
// and the grid runs in fewer, fuller waves; likewise 4-warp grids of 6-8
// blocks per SM (the 16,384-column q_proj of 31B's full-attention layers:
// 1.3 waves at six blocks an SM, one at eight).
constexpr int kDecodePipeStepsWide = 5;
// Shortest rows (K) of a several-row product that takes the pipeline.
constexpr int64_t kRowsPipelineMinK = 4096;
template <int KS, int CT, int PS>
constexpr size_t pipe_bytes() {
  return static_cast<size_t>(PS) * CT * 2 * KS * 32 * sizeof(uint4);
}
// Single-row products split x themselves (no split kernel on the decode path),
// kSplitGroup steps at a time, into a per-warp stage after the pipeline.
constexpr int kSplitGroup = 4;
template <int KS, int CT, int PS>
constexpr size_t dynamic_smem() {
  return PS > 0 ? pipe_bytes<KS, CT, PS>() + size_t{KS} * kSplitGroup * 4 * 3 * sizeof(uint4) : 0;
}

// Blocks per SM the register budget must allow: enough for one wave of the
// model's narrow products (336 blocks for N = 5376) at single tiles, and four
// 8-warp (eight 4-warp) blocks with the short pipeline of large grids.
template <int KS, int CT, int NT, int PS>
constexpr int min_blocks() {
  if constexpr (PS == kDecodePipeStepsWide) return 4 * (8 / KS);
  return (CT * NT == 1 ? 3 : 2) * (8 / KS);
}

// The block's tile: acc[c][j] = this warp's partial sums over its K range for
// weight tile c (wrow[c][0] = the lane's row g, wrow[c][1] = row g + 8) and row
// tile j (xrow[j] = chunk 0 of the lane's activation row g of tile j in
// x_split; padding rows past M point at a real row, and their results are
// never written). Single-row products (kRow: PS > 0, NT 1) read x_row, the f32
// row, and split it themselves instead; every other product reads x_split
// (x_row unused). Only weights are loaded before pdl_wait().
//
// Steps whose 32 elements all lie below K ("full" steps) take unchecked
// 16-byte weight loads (pipeline or ring); the one partial step at the end of
// K, and every step of misaligned weights (!kVec), take checked element loads
// with zero fill (x_split is already zero there). Either way each step runs
// the same mma_step in increasing step order, so the loads never change the sums.
//
// K ranges: the tile's K steps are cut into KR contiguous ranges; warp w of
// the block sums range range0 + w. A block owns all KR = KS ranges, except in
// the cluster kernel, whose blocks share a tile. Either way range r covers the
// same steps, so a row's bits do not depend on which kernel summed it.
//
// Index arithmetic is `int` on the decode path (K < 2^31 - 64, the callers'
// bound, so no step offset overflows) and int64_t elsewhere, each the faster
// for its kernels: with 64-bit steps the decode kernels spilled up to 112
// bytes a thread, and 32-bit steps took the several-row kernels from 120 to 96
// registers and made them slower (H200, 31B shapes: 5,376 x 21,504 at 5 rows
// 66.4 -> 82.3 us; one row 65.3 -> 64.4). The type changes no sum.
template <int KS, int CT, int NT, bool kVec, int PS, bool kRow, int KR = KS>
__device__ __forceinline__ void warp_partials(const bf16* const (&wrow)[CT][2],
                                              const uint4* const (&xrow)[NT], const float* x_row,
                                              int64_t k_dim, float (&acc)[CT][NT][4],
                                              int range0 = 0) {
  using Idx = std::conditional_t<kRow, int, int64_t>;
  constexpr int kThreads = KS * 32;
  constexpr int kChunksPerStep = kStepK / 8;
  const int warp = static_cast<int>(threadIdx.x >> 5);
  const int t = static_cast<int>(threadIdx.x & 3u);
  const Idx range = range0 + warp;
  const Idx steps = static_cast<Idx>((k_dim + kStepK - 1) / kStepK);
  const Idx s_begin = range * steps / KR;
  const Idx s_end = (range + 1) * steps / KR;
  const Idx s_full = kVec ? std::min(s_end, static_cast<Idx>(k_dim / kStepK)) : s_begin;
#pragma unroll
  for (int c = 0; c < CT; ++c) {
#pragma unroll
    for (int j = 0; j < NT; ++j) {
#pragma unroll
      for (int i = 0; i < 4; ++i) acc[c][j][i] = 0.0f;
    }
  }
  // Lane pointers at step s_begin.
  const Idx k0 = s_begin * kStepK + 8 * t;
  const bf16* wp[CT][2];
#pragma unroll
  for (int c = 0; c < CT; ++c) {
    wp[c][0] = wrow[c][0] + k0;
    wp[c][1] = wrow[c][1] + k0;
  }
  const uint4* xp[NT];
#pragma unroll
  for (int j = 0; j < NT; ++j) xp[j] = xrow[j] + (s_begin * kChunksPerStep + t) * 3;
  // The step `offset` steps past the pointers' current one.
  const auto compute = [&](const uint4(&w)[CT][2], Idx offset) {
#pragma unroll
    for (int j = 0; j < NT; ++j) {
      const SplitX split = load_split(xp[j] + offset * kChunksPerStep * 3);
#pragma unroll
      for (int c = 0; c < CT; ++c) mma_step(acc[c][j], w[c][0], w[c][1], split);
    }
  };
  const Idx full = s_full - s_begin;  // full steps of this warp (>= 0)

  if constexpr (PS > 0) {
    // Step i waits in stage i % PS: slot (stage, c, h) of this thread is
    // pipe[((stage · CT + c) · 2 + h) · kThreads].
    extern __shared__ uint4 pipe_smem[];
    uint4* pipe = pipe_smem + threadIdx.x;
    const auto issue = [&](Idx i, int stage) {
#pragma unroll
      for (int c = 0; c < CT; ++c) {
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          cp_async16(pipe + ((stage * CT + c) * 2 + h) * kThreads, wp[c][h] + i * kStepK);
        }
      }
    };
    // Waits for step i (in `stage`), reads it into w and refills the stage
    // with step i + PS: a copy is in flight again as soon as its stage has
    // landed, before the step's split and mma.
    const auto take_stage = [&](Idx i, int stage, uint4(&w)[CT][2]) {
      cp_async_wait<PS - 1>();  // group i (step i) has landed
#pragma unroll
      for (int c = 0; c < CT; ++c) {
        w[c][0] = pipe[((stage * CT + c) * 2 + 0) * kThreads];
        w[c][1] = pipe[((stage * CT + c) * 2 + 1) * kThreads];
      }
      if (i + PS < full) issue(i + PS, stage);
      cp_async_commit();
    };
    // Weights only before the wait; one commit group per step, empty ones
    // included, so that group i always holds step i.
#pragma unroll
    for (int i = 0; i < PS; ++i) {
      if (i < full) issue(i, i);
      cp_async_commit();
    }
    pdl_wait();
    if constexpr (!kRow) {
      // Several rows: their splits come from x_split, step by step.
      int stage = 0;  // i % PS
      for (Idx i = 0; i < full; ++i) {
        uint4 w[CT][2];
        take_stage(i, stage, w);
        compute(w, i);
        stage = stage + 1 == PS ? 0 : stage + 1;
      }
      cp_async_wait<0>();
    } else {
      // x is one row (decode) and split here, without the split kernel: every 4
      // steps all 32 lanes split the group's x into the warp's stage, lane
      // (g, t) the 4 elements of half g % 2 of chunk t of step i + g / 2, and
      // every lane then reads its chunk's split from there (one row: every n8
      // slot gets row 0). Each group's x is loaded one group ahead (xq), so
      // that its L2 round trip overlaps the steps before it instead of
      // stalling the warp at every group (31B decode step on an H200:
      // 18.1-18.6 -> 17.6-17.75 ms).
      //
      // Each step first reads its stage into registers and refills it, and
      // only then splits and multiplies: a weight copy is in flight again as
      // soon as its stage has landed, not after the step's dependent mma
      // chain and, every 4 steps, the split. At two to three blocks an SM
      // these kernels are bound by their own instructions as much as by the
      // weights: with 16 lanes splitting 8 elements and the refill after the
      // mma, 31B's down_proj issued a third more instructions and a decode
      // step took 17.32 ms instead of 16.69 (H200).
      //
      // Not here but worth knowing: the several-row loop above relies on the
      // compiler unrolling it by two, which keeps the next step's x_split
      // load in flight during the current step; kept rolled, or with
      // volatile shared loads, verify windows got 18% slower.
      uint4* stage_x = pipe_smem + pipe_bytes<KS, CT, PS>() / sizeof(uint4) +
                       static_cast<int>(threadIdx.x >> 5) * kSplitGroup * 4 * 3;
      const int g = static_cast<int>((threadIdx.x & 31u) >> 2);
      const int g_step = g >> 1;  // the step of the group this lane splits
      const int g_half = g & 1;   // and which half of its chunk t
      const float* x_lane = x_row + s_begin * kStepK + 8 * t + 4 * g_half;
      float4 xq = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
      if (g_step < full) xq = load_act(reinterpret_cast<const float4*>(x_lane + g_step * kStepK));
      int stage = 0;  // i % PS
      for (Idx i = 0; i < full; ++i) {
        uint4 w[CT][2];
        take_stage(i, stage, w);
        if (i % kSplitGroup == 0) {
          __syncwarp();  // the previous group's stage has been read
          if (i + g_step < full) {
            const SplitTerms e0 = split_one(xq.x);
            const SplitTerms e1 = split_one(xq.y);
            const SplitTerms e2 = split_one(xq.z);
            const SplitTerms e3 = split_one(xq.w);
            if (i + kSplitGroup + g_step < full) {
              xq = load_act(
                  reinterpret_cast<const float4*>(x_lane + (i + kSplitGroup + g_step) * kStepK));
            }
            // Words hi, mid, lo of the chunk, each 16 bytes: this lane's half of each.
            uint2* dst = reinterpret_cast<uint2*>(stage_x + (g_step * 4 + t) * 3) + g_half;
            dst[0] = make_uint2(as_bits(__halves2bfloat162(e0.hi, e1.hi)),
                                as_bits(__halves2bfloat162(e2.hi, e3.hi)));
            dst[2] = make_uint2(as_bits(__halves2bfloat162(e0.mid, e1.mid)),
                                as_bits(__halves2bfloat162(e2.mid, e3.mid)));
            dst[4] = make_uint2(as_bits(__halves2bfloat162(e0.lo, e1.lo)),
                                as_bits(__halves2bfloat162(e2.lo, e3.lo)));
          }
          __syncwarp();
        }
        const uint4* xs = stage_x + (static_cast<int>(i % kSplitGroup) * 4 + t) * 3;
        const SplitX split{{xs[0].x, xs[0].y, xs[0].z, xs[0].w},
                           {xs[1].x, xs[1].y, xs[1].z, xs[1].w},
                           {xs[2].x, xs[2].y, xs[2].z, xs[2].w}};
#pragma unroll
        for (int c = 0; c < CT; ++c) mma_step(acc[c][0], w[c][0], w[c][1], split);
        stage = stage + 1 == PS ? 0 : stage + 1;
      }
      cp_async_wait<0>();
    }
  } else {
    constexpr int U = ring_steps<CT, NT>();
    uint4 ring[U][CT][2];
    const auto fill = [&](uint4(&slot)[CT][2], Idx ahead) {
#pragma unroll
      for (int c = 0; c < CT; ++c) {
        slot[c][0] = load_stream16(wp[c][0] + ahead * kStepK);
        slot[c][1] = load_stream16(wp[c][1] + ahead * kStepK);
      }
    };
#pragma unroll
    for (int u = 0; u < U; ++u) {
      if (u < full) fill(ring[u], u);  // weights only: may overlap the previous kernel
    }
    pdl_wait();
    Idx done = 0;
    for (; done + U <= full; done += U) {
#pragma unroll
      for (int u = 0; u < U; ++u) {
        compute(ring[u], u);
        if (done + u + U < full) fill(ring[u], u + U);
      }
#pragma unroll
      for (int c = 0; c < CT; ++c) {
        wp[c][0] += U * kStepK;
        wp[c][1] += U * kStepK;
      }
#pragma unroll
      for (int j = 0; j < NT; ++j) xp[j] += U * kChunksPerStep * 3;
    }
    // Fewer than U full steps left: they already wait in ring[0 ..].
#pragma unroll
    for (int u = 0; u < U - 1; ++u) {
      if (done + u < full) compute(ring[u], u);
    }
  }
  // Checked steps: the partial last step of K, or every step when misaligned.
  for (Idx s = s_full; s < s_end; ++s) {
    const Idx k = s * kStepK + 8 * t;
    uint4 w[CT][2];
#pragma unroll
    for (int c = 0; c < CT; ++c) {
      w[c][0] = load_w8_checked(wrow[c][0], k, k_dim);
      w[c][1] = load_w8_checked(wrow[c][1], k, k_dim);
    }
#pragma unroll
    for (int j = 0; j < NT; ++j) {
      SplitX split;
      if constexpr (kRow) {
        float xv[8];
#pragma unroll
        for (int e = 0; e < 8; ++e) xv[e] = k + e < k_dim ? load_act(x_row + k + e) : 0.0f;
        split = split_x(xv);
      } else {
        split = load_split(xrow[j] + (s * kChunksPerStep + t) * 3);
      }
#pragma unroll
      for (int c = 0; c < CT; ++c) mma_step(acc[c][j], w[c][0], w[c][1], split);
    }
  }
}

// Shared memory of the warp-order combine: red[warp][entry][lane].
template <int KS, int CT, int NT>
struct Combine {
  float red[KS][CT * NT * 4][32];
};

// Stores this warp's partials and waits for the block: afterwards sum_of(e,
// lane) is the fixed-order total of entry e = (c·NT + j)·4 + i.
template <int KS, int CT, int NT>
__device__ __forceinline__ void publish(Combine<KS, CT, NT>& sh, const float (&acc)[CT][NT][4]) {
  const int warp = static_cast<int>(threadIdx.x >> 5);
  const int lane = static_cast<int>(threadIdx.x & 31u);
#pragma unroll
  for (int c = 0; c < CT; ++c) {
#pragma unroll
    for (int j = 0; j < NT; ++j) {
#pragma unroll
      for (int i = 0; i < 4; ++i) sh.red[warp][(c * NT + j) * 4 + i][lane] = acc[c][j][i];
    }
  }
  __syncthreads();
}

template <int KS, int CT, int NT>
__device__ __forceinline__ float sum_of(const Combine<KS, CT, NT>& sh, int e, int lane) {
  float v = sh.red[0][e][lane];
#pragma unroll
  for (int w = 1; w < KS; ++w) v += sh.red[w][e][lane];
  return v;
}

// The lane's activation rows in x_split: tile j's row g, clamped to the last row
// past M (a padding row's column of the mma only feeds results that are never
// written, and reading a real row keeps the loads branch-free).
template <int NT>
__device__ __forceinline__ void lane_x_rows(const uint4* x_split, int64_t m0, int64_t m_rows,
                                            int64_t k_dim, const uint4* (&xrow)[NT]) {
  const int g = static_cast<int>((threadIdx.x & 31u) >> 2);
  const int64_t chunks = split_chunks(k_dim);
#pragma unroll
  for (int j = 0; j < NT; ++j) {
    xrow[j] = x_split + std::min<int64_t>(m0 + j * kTileRows + g, m_rows - 1) * chunks * 3;
  }
}

// The lane's two weight rows of the tile starting at column n0 of w [n_cols, K]
// (rows past the end clamped to the last: computed, never written).
__device__ __forceinline__ void lane_w_rows(const bf16* w, int64_t n0, int64_t n_cols,
                                            int64_t k_dim, const bf16* (&rows)[2]) {
  const int g = static_cast<int>((threadIdx.x & 31u) >> 2);
  rows[0] = w + std::min<int64_t>(n0 + g, n_cols - 1) * k_dim;
  rows[1] = w + std::min<int64_t>(n0 + g + 8, n_cols - 1) * k_dim;
}

// Writes the block's combined tile of y [m_rows, n_cols] (ld n_cols): columns
// n0 .. n0 + 16·CT, rows m0 .. m0 + 8·NT.
template <int KS, int CT, int NT>
__device__ __forceinline__ void store_tile(const Combine<KS, CT, NT>& sh, float* y, int64_t m0,
                                           int64_t m_rows, int64_t n0, int64_t n_cols) {
  for (int idx = static_cast<int>(threadIdx.x); idx < CT * NT * 4 * 32; idx += KS * 32) {
    const int e = idx >> 5;
    const int lane = idx & 31;
    const int i = e & 3;
    const int j = (e >> 2) % NT;
    const int c = (e >> 2) / NT;
    const int64_t col = n0 + c * kTileCols + entry_col(i, lane);
    const int64_t row = m0 + j * kTileRows + entry_row(i, lane);
    if (col < n_cols && row < m_rows) y[row * n_cols + col] = sum_of(sh, e, lane);
  }
}

// y = x · wᵀ. Grid: (column block of 16·CT columns) × (row group of 8·NT rows),
// the row group fastest so that blocks streaming the same weights run together.
// xf is x itself on the decode path (one row, split in the kernel), else null
// (x_split holds the rows), as in the kernels below.
template <int KS, int CT, int NT, bool kVec, int PS, bool kRow>
__global__ void __launch_bounds__(KS * 32, min_blocks<KS, CT, NT, PS>())
    mma_linear_kernel(const float* __restrict__ xf, const uint4* __restrict__ x,
                      const bf16* __restrict__ w, float* __restrict__ y, int64_t m_rows,
                      int64_t n_cols, int64_t k_dim, int row_groups) {
  pdl_launch_dependents();
  __shared__ Combine<KS, CT, NT> sh;
  const int group = static_cast<int>(blockIdx.x % static_cast<unsigned>(row_groups));
  const int64_t n0 =
      static_cast<int64_t>(blockIdx.x / static_cast<unsigned>(row_groups)) * (kTileCols * CT);
  const int64_t m0 = static_cast<int64_t>(group) * (kTileRows * NT);
  const bf16* wrow[CT][2];
#pragma unroll
  for (int c = 0; c < CT; ++c) lane_w_rows(w, n0 + c * kTileCols, n_cols, k_dim, wrow[c]);
  const uint4* xrow[NT];
  lane_x_rows<NT>(x, m0, m_rows, k_dim, xrow);
  float acc[CT][NT][4];
  warp_partials<KS, CT, NT, kVec, PS, kRow>(wrow, xrow, kRow ? xf + m0 * k_dim : nullptr, k_dim,
                                            acc);
  publish(sh, acc);
  store_tile(sh, y, m0, m_rows, n0, n_cols);
}

// The decode product (one row) of a grid too small to fill the GPU, its tile
// split over a cluster of C blocks of 8 / C warps: block rank r's warp w sums
// K range r · (8 / C) + w of mma_k_split(N) = 8, exactly as warp
// r · (8 / C) + w of mma_linear_kernel<8, 1, 1, true, PS, true> does, and the
// eight warp sums are added in range order through distributed shared memory,
// so a row gets the bits of every other path. Grid: C blocks per 16-column
// tile, tile-major. Why: a product of fewer tiles than SMs (E2B's down_proj,
// 96 tiles of 6,144-element rows) streamed from that many SMs only; with the
// tile spread over a cluster it keeps every SM busy (H200: 1,536 x 6,144 13.9
// -> 8.6 us with C = 8; 2,560 x 8,192, 160 tiles, 22.1 -> 14.2 us with C = 4).
// xf: x f32 [1, K]; x_split: unused (the decode path splits x itself).
template <int C, int PS>
__global__ void __cluster_dims__(C, 1, 1) __launch_bounds__(8 / C * 32, 3 * C)
    mma_linear_cluster_kernel(const float* __restrict__ xf, const uint4* __restrict__ x_split,
                              const bf16* __restrict__ w, float* __restrict__ y, int64_t n_cols,
                              int64_t k_dim) {
  constexpr int KB = 8 / C;  // warps of a block
  static_assert(KB * C == 8, "a cluster holds the 8 K ranges of a tile");
  namespace cg = cooperative_groups;
  pdl_launch_dependents();
  __shared__ Combine<KB, 1, 1> sh;
  const int rank = static_cast<int>(blockIdx.x % C);
  const int64_t n0 = static_cast<int64_t>(blockIdx.x / C) * kTileCols;
  const bf16* wrow[1][2];
  lane_w_rows(w, n0, n_cols, k_dim, wrow[0]);
  const uint4* xrow[1];
  lane_x_rows<1>(x_split, 0, 1, k_dim, xrow);
  float acc[1][1][4];
  warp_partials<KB, 1, 1, true, PS, true, 8>(wrow, xrow, xf, k_dim, acc, rank * KB);
  publish(sh, acc);
  cg::cluster_group cluster = cg::this_cluster();
  cluster.sync();  // every rank's warp sums are in its shared memory
  // Row 0 of the tile is entry 2 · (c / 8) of lane 4 · (c % 8) for column c
  // (entry_col, entry_row); each rank adds kPerRank of the 16 columns.
  constexpr int kPerRank = kTileCols / C;
  const int tid = static_cast<int>(threadIdx.x);
  if (tid < kPerRank) {
    const int c = rank * kPerRank + tid;
    const int e = 2 * (c / 8);
    const int lane = 4 * (c % 8);
    float v = cluster.map_shared_rank(&sh, 0)->red[0][e][lane];
#pragma unroll
    for (int range = 1; range < 8; ++range) {
      v += cluster.map_shared_rank(&sh, range / KB)->red[range % KB][e][lane];
    }
    if (n0 + c < n_cols) y[n0 + c] = v;
  }
  cluster.sync();  // the other ranks' shared memory stays until everyone has read it
}

// Several y_o = x · w_oᵀ in one grid: the concatenation of each output's
// mma_linear_kernel<KS, CT, NT, true, PS> grid (all with the same KS). Every
// tile is computed as there.
template <int KS, int CT, int NT, int PS, bool kRow>
__global__ void __launch_bounds__(KS * 32, min_blocks<KS, CT, NT, PS>())
    mma_multi_kernel(const float* __restrict__ xf, const uint4* __restrict__ x,
                     MultiOuts<bf16> outs, int64_t m_rows, int64_t k_dim, int row_groups) {
  pdl_launch_dependents();
  __shared__ Combine<KS, CT, NT> sh;
  const PickedOutput<bf16> out = pick_output(outs, static_cast<int>(blockIdx.x));
  const int64_t n0 = static_cast<int64_t>(out.local_block / row_groups) * (kTileCols * CT);
  const int64_t m0 = static_cast<int64_t>(out.local_block % row_groups) * (kTileRows * NT);
  const bf16* wrow[CT][2];
#pragma unroll
  for (int c = 0; c < CT; ++c) lane_w_rows(out.w, n0 + c * kTileCols, out.n_cols, k_dim, wrow[c]);
  const uint4* xrow[NT];
  lane_x_rows<NT>(x, m0, m_rows, k_dim, xrow);
  float acc[CT][NT][4];
  warp_partials<KS, CT, NT, true, PS, kRow>(wrow, xrow, kRow ? xf + m0 * k_dim : nullptr, k_dim,
                                            acc);
  publish(sh, acc);
  store_tile(sh, out.y, m0, m_rows, n0, out.n_cols);
}

// gate = gelu_tanh(x · w_gateᵀ) ⊙ (x · w_upᵀ): weight tile 0 is 16 gate columns,
// tile 1 the same 16 up columns, so one thread combines both sums of a cell.
template <int KS, int NT, bool kVec, int PS, bool kRow>
__global__ void __launch_bounds__(KS * 32, min_blocks<KS, 2, NT, PS>())
    mma_gelu_mul_kernel(const float* __restrict__ xf, const uint4* __restrict__ x,
                        const bf16* __restrict__ w_gate, const bf16* __restrict__ w_up,
                        float* __restrict__ gate, int64_t m_rows, int64_t n_cols, int64_t k_dim,
                        int row_groups, bf16* __restrict__ out_split) {
  pdl_launch_dependents();
  __shared__ Combine<KS, 2, NT> sh;
  const int group = static_cast<int>(blockIdx.x % static_cast<unsigned>(row_groups));
  const int64_t n0 =
      static_cast<int64_t>(blockIdx.x / static_cast<unsigned>(row_groups)) * kTileCols;
  const int64_t m0 = static_cast<int64_t>(group) * (kTileRows * NT);
  const bf16* wrow[2][2];
  lane_w_rows(w_gate, n0, n_cols, k_dim, wrow[0]);
  lane_w_rows(w_up, n0, n_cols, k_dim, wrow[1]);
  const uint4* xrow[NT];
  lane_x_rows<NT>(x, m0, m_rows, k_dim, xrow);
  float acc[2][NT][4];
  warp_partials<KS, 2, NT, kVec, PS, kRow>(wrow, xrow, kRow ? xf + m0 * k_dim : nullptr, k_dim,
                                           acc);
  publish(sh, acc);
  for (int idx = static_cast<int>(threadIdx.x); idx < NT * 4 * 32; idx += KS * 32) {
    const int e = idx >> 5;  // entry of tile 0; tile 1's is e + NT·4
    const int lane = idx & 31;
    const int i = e & 3;
    const int j = e >> 2;
    const int64_t col = n0 + entry_col(i, lane);
    const int64_t row = m0 + j * kTileRows + entry_row(i, lane);
    if (col < n_cols && row < m_rows) {
      const float g = sum_of(sh, e, lane);
      const float u = sum_of(sh, e + NT * 4, lane);
      const float out = __fmul_rn(gelu_tanh(g), u);
      gate[row * n_cols + col] = out;
      if (out_split != nullptr) store_split(out_split, split_chunks(n_cols), row, col, out);
    }
  }
  // The split rows' zero padding past n_cols: written by the last column block.
  if (out_split != nullptr && n0 + kTileCols >= n_cols) {
    const int64_t pad = split_chunks(n_cols) * 8 - n_cols;
    const int64_t rows_here = min(m_rows - m0, static_cast<int64_t>(kTileRows * NT));
    for (int64_t p = threadIdx.x; p < rows_here * pad; p += KS * 32)
      store_split(out_split, split_chunks(n_cols), m0 + p / pad, n_cols + p % pad, 0.0f);
  }
}

bool aligned16(const void* p) {
  return (reinterpret_cast<uintptr_t>(p) & 15u) == 0;
}

// 16-byte weight loads apply: an aligned base and rows of a multiple of 8 elements.
bool vec_path(const void* w, int64_t k) {
  return aligned16(w) && k % 8 == 0;
}

// Row tiles per pass for M rows: 1, 2 or 4 (more rows run in groups of 32).
int64_t row_tiles_for(int64_t m) {
  const int64_t tiles = (m + kTileRows - 1) / kTileRows;
  return tiles >= 3 ? kMaxRowTiles : tiles;
}

// Calls f(NT, KS) as std::integral_constant for M rows and N columns.
template <typename F>
void with_shape(int64_t m, int64_t n, F&& f) {
  const auto with_ks = [&](auto nt) {
    if (mma_k_split(n) == 4) return f(nt, std::integral_constant<int, 4>{});
    return f(nt, std::integral_constant<int, 8>{});
  };
  switch (row_tiles_for(m)) {
    case 1:
      return with_ks(std::integral_constant<int, 1>{});
    case 2:
      return with_ks(std::integral_constant<int, 2>{});
    default:
      return with_ks(std::integral_constant<int, kMaxRowTiles>{});
  }
}

// Whether a product takes the decode path (pipeline, x split in the kernel):
// one row, 16-byte weight loads and an aligned x.
bool decode_path(const float* x, int64_t m, bool vec) {
  return m == 1 && vec && aligned16(x);
}

// Weight tiles per block (CT): 2 (32 columns) for products of several rows,
// so that each split activation a lane loads feeds twice the weight bytes
// (those rows are read from x_split, not streamed with the weights). One row
// (the decode pipeline) and misaligned weights keep 1. Measured on an H200
// (31B shapes, 5 rows, whole verify window): 23.83 -> 23.11 ms; batch 8 steps
// 30.1 -> 28.9 ms. 4 tiles spill registers. Column tiling touches no sum, so
// a row's bits do not change.
int column_tiles(bool decode, bool vec) {
  return decode || !vec ? 1 : 2;
}

// Calls f(kVec, PS) as integral constants: kVec when `vec` (16-byte weight
// loads); PS, the pipeline steps, on the decode path (fewer for large grids of
// single tiles, see kDecodePipeStepsWide) and for products of up to 8 rows
// that are large enough (kRowsPipelineMinK), else 0 (the register ring).
template <int KS, int CT, int NT, typename F>
void with_paths(bool vec, bool decode, int64_t blocks, int64_t k_dim, F&& f) {
  if (!vec) return f(std::false_type{}, std::integral_constant<int, 0>{});
  if constexpr (NT == 1) {
    if (decode) {
      if constexpr (CT == 1) {
        // More blocks than fit at the usual pipeline depth, but few enough
        // for one wave at the shorter one.
        const int64_t usual = int64_t{3} * (8 / KS) * sm_count();
        const int64_t wide = int64_t{4} * (8 / KS) * sm_count();
        if (blocks > usual && (KS == 8 || blocks <= wide)) {
          return f(std::true_type{}, std::integral_constant<int, kDecodePipeStepsWide>{});
        }
      }
      return f(std::true_type{}, std::integral_constant<int, kDecodePipeSteps<CT>>{});
    }
    if (blocks >= sm_count() && k_dim >= kRowsPipelineMinK) {
      return f(std::true_type{}, std::integral_constant<int, kDecodePipeSteps<CT>>{});
    }
  }
  return f(std::true_type{}, std::integral_constant<int, 0>{});
}

// Calls f(kRow) as an integral constant: true on the decode path (one row,
// split in the kernel), which only the pipelined single-tile-row kernels take.
// A kernel compiled for one of the two x sources keeps fewer registers live:
// with both in one kernel, the decode path's x prefetch (warp_partials) made
// the several-row products spill more, and the 5-stage decode kernels spilled
// 36 bytes even before it (now none).
template <int NT, bool kVec, int PS, typename F>
void with_row(bool decode, F&& f) {
  if constexpr (NT == 1 && kVec && PS > 0) {
    if (decode) return f(std::true_type{});
  }
  return f(std::false_type{});
}

// Shortest rows (K) of a decode product that takes the cluster kernel: below
// it a warp has too few steps to amortise the cluster's exchange (1,536 x
// 2,048 on an H200: 4.3 us alone, 4.9 us with clusters of 4 or 8).
constexpr int64_t kClusterMinK = 4096;

// Blocks per cluster for a decode product of `tiles` 16-column tiles over K
// (mma_linear_cluster_kernel), or 0 for one block per tile. Up to one tile per
// SM: 8; up to 1.5 tiles per SM: 4 (more blocks of fewer warps; eight
// one-warp blocks per tile lost there). More tiles fill the GPU without: the
// 31B's 336-tile products got 5-20% slower with either size. (Same bits
// either way; against one block per tile, E2B's decode step took 15% less
// time, E4B's 11%: bench/RESULTS.md, session 18.)
int decode_cluster(int64_t tiles, int64_t k_dim) {
  if (k_dim < kClusterMinK) return 0;
  if (tiles <= sm_count()) return 8;
  if (2 * tiles <= int64_t{3} * sm_count()) return 4;
  return 0;
}

int64_t checked_blocks(int64_t col_blocks, int64_t row_groups, const char* op) {
  const int64_t blocks = col_blocks * row_groups;
  if (blocks > INT_MAX) {
    fail("{}: {} column blocks x {} row groups exceed the CUDA grid", op, col_blocks, row_groups);
  }
  return blocks;
}

// Fills x_split from x f32 [m, k] (queued on `stream`, a programmatic dependent).
void launch_split(const float* x, void* x_split, int64_t m, int64_t k, cudaStream_t stream) {
  const int64_t chunks = split_chunks(k);
  const int64_t threads = 256;
  const int64_t blocks = (m * chunks + threads - 1) / threads;
  if (blocks > INT_MAX) fail("linear: x [{}, {}] is too large to split", m, k);
  launch_pdl(split_x_kernel, blocks, static_cast<int>(threads), 0, stream, "split_x_kernel", x,
             static_cast<uint4*>(x_split), m, k, chunks);
}

}  // namespace

int mma_k_split(int64_t n_cols) {
  return n_cols > kWideColumns ? 4 : 8;
}

size_t mma_split_bytes(int64_t m, int64_t k) {
  return static_cast<size_t>(m) * static_cast<size_t>(split_chunks(k)) * 3 * sizeof(uint4);
}

void mma_linear(const float* x, void* x_split, bool split_ready, const void* w, float* y, int64_t m,
                int64_t n, int64_t k, cudaStream_t stream) {
  const bool vec = vec_path(w, k);
  const bool decode = decode_path(x, m, vec);
  if (!decode && !split_ready) launch_split(x, x_split, m, k, stream);
  if (!decode && tiled_path(w, m, k)) return tiled_linear(x_split, w, y, m, n, k, stream);
  const auto* xs = static_cast<const uint4*>(x_split);
  const auto* wb = static_cast<const bf16*>(w);
  if (decode && mma_k_split(n) == 8) {
    const int64_t tiles = (n + kTileCols - 1) / kTileCols;
    const auto clustered = [&](auto c) {
      constexpr int C = decltype(c)::value;
      constexpr int PS = kDecodePipeSteps<1>;
      launch_pdl(mma_linear_cluster_kernel<C, PS>, tiles * C, 8 / C * 32,
                 dynamic_smem<8 / C, 1, PS>(), stream, "mma_linear_cluster_kernel", x, xs, wb, y, n,
                 k);
    };
    switch (decode_cluster(tiles, k)) {
      case 8:
        return clustered(std::integral_constant<int, 8>{});
      case 4:
        return clustered(std::integral_constant<int, 4>{});
      default:
        break;
    }
  }
  const auto launch = [&](auto ct) {
    constexpr int CT = decltype(ct)::value;
    with_shape(m, n, [&](auto nt, auto ks) {
      constexpr int NT = decltype(nt)::value;
      constexpr int KS = decltype(ks)::value;
      const int64_t row_groups = (m + kTileRows * NT - 1) / (kTileRows * NT);
      const int64_t blocks =
          checked_blocks((n + kTileCols * CT - 1) / (kTileCols * CT), row_groups, "linear");
      with_paths<KS, CT, NT>(vec, decode, blocks, k, [&](auto vec_c, auto ps) {
        constexpr bool kVec = decltype(vec_c)::value;
        constexpr int PS = decltype(ps)::value;
        with_row<NT, kVec, PS>(decode, [&](auto row) {
          launch_pdl(mma_linear_kernel<KS, CT, NT, kVec, PS, decltype(row)::value>, blocks, KS * 32,
                     dynamic_smem<KS, CT, PS>(), stream, "mma_linear_kernel", decode ? x : nullptr,
                     xs, wb, y, m, n, k, static_cast<int>(row_groups));
        });
      });
    });
  };
  if (column_tiles(decode, vec) == 2) {
    launch(std::integral_constant<int, 2>{});
  } else {
    launch(std::integral_constant<int, 1>{});
  }
}

void mma_linear_multi(const float* x, void* x_split, bool split_ready,
                      std::span<const ProductOut> outs, int64_t m, int64_t k, cudaStream_t stream) {
  bool same = true;  // one launch needs 16-byte loads and one K split for every output
  for (const ProductOut& o : outs) {
    same = same && vec_path(o.w, k) && mma_k_split(o.n) == mma_k_split(outs[0].n);
  }
  if (!same) {  // the same bits, one launch per output
    for (const ProductOut& o : outs) {
      if (o.n > 0) mma_linear(x, x_split, split_ready, o.w, o.y, m, o.n, k, stream);
    }
    return;
  }
  const bool decode = decode_path(x, m, true);
  if (!decode && !split_ready) launch_split(x, x_split, m, k, stream);
  if (!decode && tiled_path(outs[0].w, m, k)) {
    // Each output's tiled launch (same alignment and K as the others, checked
    // above), x split once for all.
    for (const ProductOut& o : outs) {
      if (o.n > 0) tiled_linear(x_split, o.w, o.y, m, o.n, k, stream);
    }
    return;
  }
  const auto* xs = static_cast<const uint4*>(x_split);
  const auto launch = [&](auto ct) {
    constexpr int CT = decltype(ct)::value;
    with_shape(m, outs[0].n, [&](auto nt, auto ks) {
      constexpr int NT = decltype(nt)::value;
      constexpr int KS = decltype(ks)::value;
      const int64_t row_groups = (m + kTileRows * NT - 1) / (kTileRows * NT);
      launch_multi_batches<bf16>(
          outs, [&](int64_t n) { return (n + kTileCols * CT - 1) / (kTileCols * CT) * row_groups; },
          [&](const MultiOuts<bf16>& batch, int64_t blocks) {
            with_paths<KS, CT, NT>(true, decode, blocks, k, [&](auto, auto ps) {
              constexpr int PS = decltype(ps)::value;
              with_row<NT, true, PS>(decode, [&](auto row) {
                launch_pdl(mma_multi_kernel<KS, CT, NT, PS, decltype(row)::value>, blocks, KS * 32,
                           dynamic_smem<KS, CT, PS>(), stream, "mma_multi_kernel",
                           decode ? x : nullptr, xs, batch, m, k, static_cast<int>(row_groups));
              });
            });
          });
    });
  };
  if (column_tiles(decode, true) == 2) {
    launch(std::integral_constant<int, 2>{});
  } else {
    launch(std::integral_constant<int, 1>{});
  }
}

void mma_linear_gelu_mul(const float* x, void* x_split, bool split_ready, void* out_split,
                         const void* w_gate, const void* w_up, float* gate, int64_t m, int64_t n,
                         int64_t k, cudaStream_t stream) {
  const bool vec = vec_path(w_gate, k) && vec_path(w_up, k);
  const bool decode = decode_path(x, m, vec);
  if (!decode && !split_ready) launch_split(x, x_split, m, k, stream);
  if (!decode && tiled_path(w_gate, m, k) && tiled_path(w_up, m, k)) {
    return tiled_gelu_mul(x_split, w_gate, w_up, gate, out_split, m, n, k, stream);
  }
  const auto* xs = static_cast<const uint4*>(x_split);
  const auto* wg = static_cast<const bf16*>(w_gate);
  const auto* wu = static_cast<const bf16*>(w_up);
  with_shape(m, n, [&](auto nt, auto ks) {
    constexpr int NT = decltype(nt)::value;
    constexpr int KS = decltype(ks)::value;
    const int64_t row_groups = (m + kTileRows * NT - 1) / (kTileRows * NT);
    const int64_t blocks =
        checked_blocks((n + kTileCols - 1) / kTileCols, row_groups, "linear_gelu_mul");
    with_paths<KS, 2, NT>(vec, decode, blocks, k, [&](auto vec_c, auto ps) {
      constexpr bool kVec = decltype(vec_c)::value;
      constexpr int PS = decltype(ps)::value;
      with_row<NT, kVec, PS>(decode, [&](auto row) {
        launch_pdl(mma_gelu_mul_kernel<KS, NT, kVec, PS, decltype(row)::value>, blocks, KS * 32,
                   dynamic_smem<KS, 2, PS>(), stream, "mma_gelu_mul_kernel", decode ? x : nullptr,
                   xs, wg, wu, gate, m, n, k, static_cast<int>(row_groups),
                   static_cast<bf16*>(out_split));
      });
    });
  });
}

}  // namespace specula::cuda
