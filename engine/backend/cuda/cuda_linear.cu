// SPDX-License-Identifier: Apache-2.0
// Products on the GPU: linear(), linear_multi() and linear_gelu_mul()
// (embedding(): cuda_embedding.cu).
//
// linear, y[M, N] = x[M, K] · w[N, K]ᵀ (x, y f32; w f32|bf16|f16), has three paths:
//
// - bf16 weights, M <= kInvariantRows: the tensor-core kernels of
//   cuda_linear_mma.cu (numerics in cuda_linear_mma.h), batch-invariant like
//   the path below, with their own (equally fixed) reduction order. These are
//   the model's products: decode, verify windows and batched rows.
//
// - f32|f16 weights, any M in linear() (M <= kPrefillGemmRows in
//   linear_prefill()): invariant_linear_kernel, batch-invariant. y[m, n] is bit-identical whatever
//   M is and whichever other rows share the call, which is what makes speculation exact (decode
//   computes 1 row, verify k + 1, batched rows many more). The reduction order for one (m, n) is
//   fixed by the kernel alone: K is cut into chunks of 8 elements; lane l of the warp that owns
//   column n accumulates chunks l, l + 32, l + 64, ... in increasing order, each as 8 explicit fmaf
//   in element order into one f32 partial sum (a final partial chunk, when 8 does not divide K,
//   belongs to the lane whose turn it is, with one fmaf per element); the 32 partial sums are then
//   added by a fixed xor-shuffle tree. Rows are processed in groups of up to kMaxGroup so the
//   weights are streamed once per group, and every row of a group runs the same fmaf sequence
//   whatever the group size, its position in the group, the unrolling, or whether loads are
//   vectorised (misaligned operands take scalar loads but the same arithmetic). No atomics, no
//   split of K across warps. At M = 1 with f16 weights this is a decode GEMV: 16-byte streaming
//   loads (8 f16, not allocated in L1), four columns per warp, several chunks in flight per lane.
//   Activations are read through L1 rather than staged in shared memory: staging would need a block
//   barrier per K tile, and every barrier drains the weight stream of the warps waiting at it; the
//   warps of an SM read the same x rows at nearly the same time, so L1 serves them.
//
//   linear_multi (q/k/v of one x) and linear_gelu_mul (gate/up) reuse the
//   same per-warp body (warp_dot) on one grid: linear_multi concatenates the
//   grids of up to 4 outputs; linear_gelu_mul gives each warp 2 columns of gate
//   and the same 2 of up and writes gelu_tanh(g) · u (the gelu_mul op's
//   arithmetic). So each product has the bits linear() writes, and the fused
//   gate the bits of linear, linear, gelu_mul. The invariant kernels are
//   programmatic dependent launches (kUsePdl): before griddepcontrol.wait they
//   only touch weights (an L2 prefetch, or for single rows the first stages of
//   the cp.async pipeline described at pipe_smem_bytes), so the previous
//   kernel's tail overlaps them.
//
//   Past kInvariantRows rows (a verify window of B x (k + 1) rows, say 32 x 9),
//   linear(), linear_multi() and linear_gelu_mul() run these kernels over
//   consecutive chunks of kInvariantRows rows: a row's bits stay those of a
//   1-row call, and the split scratch sized for kInvariantRows rows suffices,
//   so nothing is allocated.
//
// - any weights with M > kPrefillGemmRows in linear_prefill(): cuBLASLt on bf16 copies of the
//   activations (and of the weights when they are not bf16; cuda_linear_lt.cu), f32 accumulation
//   (CUBLAS_COMPUTE_32F), f32 output written straight into y. Deterministic for
//   a given shape (the algorithm is chosen once per shape and cached), but NOT
//   batch-invariant: the algorithm, and with it the reduction order, depends on
//   M. Rounding x to bf16 costs ~1e-3 relative accuracy. A shape cuBLASLt
//   offers no algorithm for (odd leading-dimension alignment) falls back to the
//   invariant kernel. linear() never rounds f32|f16 weights: a checkpoint
//   stored in f32 is computed in f32 at every M (score of a long prompt, an
//   f32 checkpoint's prefill pieces of up to 512 rows), slower but exact; only
//   linear_prefill(), which the model calls for bf16 checkpoints alone, may.
//
// - quantized weights (i8, f8e4m3 with per-row scales), any M, in linear(),
//   linear_prefill() and, one product at a time, linear_multi() and
//   linear_gelu_mul(): the kernel of cuda_linear_quant.cu (numerics there).
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <climits>
#include <cstdint>
#include <cstdio>
#include <limits>
#include <span>
#include <type_traits>
#include <utility>
#include <vector>

#include "engine/backend/cuda/cuda_backend.h"
#include "engine/backend/cuda/cuda_device_common.cuh"
#include "engine/backend/cuda/cuda_launch.cuh"
#include "engine/backend/cuda/cuda_linear_lt.h"
#include "engine/backend/cuda/cuda_linear_mma.h"
#include "engine/backend/cuda/cuda_linear_quant.h"
#include "engine/backend/cuda/cuda_multi_outs.cuh"

namespace specula::cuda {
namespace {

// ---- batch-invariant kernel geometry ----
// Warps per block; each warp owns kCols output columns of one row group. Small
// blocks keep the grid fine-grained (N = 5376 gives 336 blocks) so the last
// wave is short; blocks share nothing, so their size is not part of the numerics.
constexpr int kWarps = 4;
constexpr int kThreads = kWarps * 32;
// Output columns per warp: every x element loaded is used kCols times.
constexpr int kCols = 4;
// Activation rows per pass over the weights.
constexpr int kMaxGroup = 8;
// Weight elements per lane step: 16 bytes of bf16/f16. Part of the numerics.
constexpr int kChunk = 8;
constexpr unsigned kFullMask = 0xffffffffu;
static_assert(kMaxGroup * kCols <= 32, "each (row, column) result is written by its own lane");

// ---------------------------------------------------------------------------
// Element conversions.

// Eight consecutive weight elements as raw bits: one 16-byte word for bf16 and
// f16, two for f32.
template <typename T>
struct Chunk {
  uint4 v[sizeof(T) / 2];
};

// The first `count` (<= 8) elements at p as a Chunk, one element per load
// (no alignment needed); missing elements are zero bits.
template <typename T>
__device__ __forceinline__ Chunk<T> load_chunk_scalar(const T* p, int count) {
  Chunk<T> c;
  if constexpr (sizeof(T) == 2) {
    const auto* q = reinterpret_cast<const unsigned short*>(p);
    uint32_t words[4] = {0, 0, 0, 0};
#pragma unroll
    for (int j = 0; j < kChunk; ++j) {
      if (j < count) words[j / 2] |= static_cast<uint32_t>(__ldg(q + j)) << (16 * (j % 2));
    }
    c.v[0] = make_uint4(words[0], words[1], words[2], words[3]);
  } else {
    const auto* q = reinterpret_cast<const unsigned int*>(p);
    uint32_t words[8];
#pragma unroll
    for (int j = 0; j < kChunk; ++j) words[j] = j < count ? __ldg(q + j) : 0u;
    c.v[0] = make_uint4(words[0], words[1], words[2], words[3]);
    c.v[1] = make_uint4(words[4], words[5], words[6], words[7]);
  }
  return c;
}

// Eight elements at p (16-byte aligned when kVec).
template <typename T, bool kVec>
__device__ __forceinline__ Chunk<T> load_chunk(const T* p) {
  if constexpr (kVec) {
    Chunk<T> c;
    const auto* q = reinterpret_cast<const uint4*>(p);
#pragma unroll
    for (int i = 0; i < static_cast<int>(sizeof(T) / 2); ++i) c.v[i] = load_stream16(q + i);
    return c;
  } else {
    return load_chunk_scalar(p, kChunk);
  }
}

// Exact widening of a Chunk to f32 (element j of the chunk -> f[j]).
template <typename T>
__device__ __forceinline__ void widen(const Chunk<T>& c, float (&f)[kChunk]) {
  if constexpr (std::is_same_v<T, float>) {
    f[0] = __uint_as_float(c.v[0].x);
    f[1] = __uint_as_float(c.v[0].y);
    f[2] = __uint_as_float(c.v[0].z);
    f[3] = __uint_as_float(c.v[0].w);
    f[4] = __uint_as_float(c.v[1].x);
    f[5] = __uint_as_float(c.v[1].y);
    f[6] = __uint_as_float(c.v[1].z);
    f[7] = __uint_as_float(c.v[1].w);
  } else {
    const uint32_t words[4] = {c.v[0].x, c.v[0].y, c.v[0].z, c.v[0].w};
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      // Little-endian: element 2i is the low half of word i.
      if constexpr (std::is_same_v<T, __nv_bfloat16>) {
        f[2 * i] = __uint_as_float(words[i] << 16);
        f[2 * i + 1] = __uint_as_float(words[i] & 0xffff0000u);
      } else {
        f[2 * i] = __half2float(__ushort_as_half(static_cast<unsigned short>(words[i] & 0xffffu)));
        f[2 * i + 1] = __half2float(__ushort_as_half(static_cast<unsigned short>(words[i] >> 16)));
      }
    }
  }
}

// Eight activations at p (16-byte aligned when kVec), through L1.
template <bool kVec>
__device__ __forceinline__ void load_x8(const float* p, float (&v)[kChunk]) {
  if constexpr (kVec) {
    const float4 a = load_act(reinterpret_cast<const float4*>(p));
    const float4 b = load_act(reinterpret_cast<const float4*>(p) + 1);
    v[0] = a.x, v[1] = a.y, v[2] = a.z, v[3] = a.w;
    v[4] = b.x, v[5] = b.y, v[6] = b.z, v[7] = b.w;
  } else {
#pragma unroll
    for (int j = 0; j < kChunk; ++j) v[j] = load_act(p + j);
  }
}

// acc[g][c] += w_c[j] · x_g[j] for j = 0..7, one fmaf at a time in j order.
// This is the whole per-row arithmetic of a full chunk: it is the same for
// every G and every position of a row in its group.
template <typename T, int G, bool kVec>
__device__ __forceinline__ void accumulate_chunk(const Chunk<T> (&raw)[kCols],
                                                 const float* const (&xrow)[G], int64_t k,
                                                 float (&acc)[G][kCols]) {
  float wf[kCols][kChunk];
#pragma unroll
  for (int c = 0; c < kCols; ++c) widen(raw[c], wf[c]);
#pragma unroll
  for (int g = 0; g < G; ++g) {
    float xv[kChunk];
    load_x8<kVec>(xrow[g] + k, xv);
#pragma unroll
    for (int c = 0; c < kCols; ++c) {
#pragma unroll
      for (int j = 0; j < kChunk; ++j) acc[g][c] = fmaf(wf[c][j], xv[j], acc[g][c]);
    }
  }
}

// The final chunk of `count` (< 8) elements: scalar loads, fmaf for j < count.
template <typename T, int G>
__device__ __forceinline__ void accumulate_partial(const T* const (&wrow)[kCols],
                                                   const float* const (&xrow)[G], int64_t k,
                                                   int count, float (&acc)[G][kCols]) {
  float wf[kCols][kChunk];
#pragma unroll
  for (int c = 0; c < kCols; ++c) widen(load_chunk_scalar(wrow[c] + k, count), wf[c]);
#pragma unroll
  for (int g = 0; g < G; ++g) {
    float xv[kChunk];
#pragma unroll
    for (int j = 0; j < kChunk; ++j) xv[j] = j < count ? load_act(xrow[g] + k + j) : 0.0f;
#pragma unroll
    for (int c = 0; c < kCols; ++c) {
#pragma unroll
      for (int j = 0; j < kChunk; ++j) {
        if (j < count) acc[g][c] = fmaf(wf[c][j], xv[j], acc[g][c]);
      }
    }
  }
}

// Chunks in flight per lane per loop step (loads are issued before any is
// used): more where few rows leave registers free. Changes only scheduling,
// never the order of a row's fmaf sequence.
template <typename T, int G>
constexpr int unroll_for() {
  if constexpr (sizeof(T) == 4) return 2;
  return G <= 5 ? 4 : 2;
}

// Programmatic dependent launch: see cuda_launch.cuh.

// Before waiting on the previous kernel a warp prefetches the first 32 lines
// of 128 bytes (4 KiB: two unrolled steps of a bf16 decode row) of each of its
// weight rows, one line per lane. Prefetches only move reads earlier; never
// the numerics.
constexpr int kPrefetchLine = 128;

// Single-row products of 16-bit weights (decode) stream the weights through a
// per-lane pipeline of cp.async copies into shared memory instead of
// registers: S chunks of each of the warp's kCols rows in flight per lane
// (8 KB per stage per block). That keeps enough bytes in flight to reach the
// memory roofline when a product has few blocks per SM, and lets the copies
// start before the previous kernel ends (they are issued before pdl_wait).
// Each lane reads back only what it copied itself, so no barrier is needed.
// Changes where the weights wait, never the arithmetic. (Measured on an H200:
// products of 4,096-21,504 columns went from 2.8-3.3 TB/s to 3.1-3.9 TB/s.
// With several rows the same pipeline was much slower than register loads:
// its shared memory leaves too little L1 for the activation rows every warp
// re-reads, so those keep the register path.)
// Stages per lane (S) are chosen per launch by pipe_stages(): 8 (64 KB per
// block) when every block is resident at 3 per SM, fewer when more blocks must
// share an SM, so that the grid still fits one wave. 0: the register path.
template <int S>
constexpr size_t pipe_smem_bytes() {
  return size_t{S} * kThreads * kCols * sizeof(uint4);
}

// cp_async16, cp_async_commit, cp_async_wait: cuda_launch.cuh.

// The per-warp body of every batch-invariant kernel (linear, linear_multi,
// linear_gelu_mul): acc[g][c] = Σ_k wrow[c][k] · xrow[g][k] with the fixed
// reduction order described at the top of the file, then reduced across the
// warp so that every lane holds every sum. wrow: kCols weight rows (K elements
// each, any mix of matrices); xrow: G activation rows. Touches nothing but
// L2 prefetches of weights before pdl_wait(). kVec: rows and chunks are
// 16-byte aligned.
template <typename T, int G, bool kVec, int S>
__device__ __forceinline__ void warp_dot(const T* const (&wrow)[kCols],
                                         const float* const (&xrow)[G], int k_dim, int lane,
                                         float (&acc)[G][kCols]) {
  constexpr int kUnroll = unroll_for<T, G>();
#pragma unroll
  for (int g = 0; g < G; ++g) {
#pragma unroll
    for (int c = 0; c < kCols; ++c) acc[g][c] = 0.0f;
  }

  const int n_full = k_dim / kChunk;
  if constexpr (S > 0) {
    static_assert(G == 1 && kVec && sizeof(T) == 2,
                  "the pipeline serves single-row 16-bit products");
    // Lane `lane` visits chunks lane + 32·i, i = 0 .. cnt - 1, in increasing
    // order; chunk i waits in stage i % S: slot (stage, c) of this
    // thread is pipe[(stage · kCols + c) · kThreads].
    extern __shared__ uint4 pipe_smem[];
    uint4* pipe = pipe_smem + threadIdx.x;
    const int cnt = lane < n_full ? (n_full - lane + 31) / 32 : 0;
    auto issue = [&](int i) {
      const int stage = i % S;
      const int64_t k = static_cast<int64_t>(lane + 32 * i) * kChunk;
#pragma unroll
      for (int c = 0; c < kCols; ++c)
        cp_async16(pipe + (stage * kCols + c) * kThreads, wrow[c] + k);
    };
    // Weights only before the wait; one commit group per stage, empty ones
    // included, so that group i always holds chunk i.
#pragma unroll
    for (int i = 0; i < S; ++i) {
      if (i < cnt) issue(i);
      cp_async_commit();
    }
    pdl_wait();
    for (int i = 0; i < cnt; ++i) {
      cp_async_wait<S - 1>();  // group i (chunk i) has landed
      const int stage = i % S;
      Chunk<T> raw[kCols];
#pragma unroll
      for (int c = 0; c < kCols; ++c) raw[c].v[0] = pipe[(stage * kCols + c) * kThreads];
      accumulate_chunk<T, G, kVec>(raw, xrow, static_cast<int64_t>(lane + 32 * i) * kChunk, acc);
      // The slot is free once its values were used: refill it with chunk i + S.
      if (i + S < cnt) issue(i + S);
      cp_async_commit();
    }
    cp_async_wait<0>();
    const int chunk = lane + 32 * cnt;
    const int rem = k_dim - n_full * kChunk;
    if (rem != 0 && chunk == n_full) {
      accumulate_partial<T, G>(wrow, xrow, static_cast<int64_t>(n_full) * kChunk, rem, acc);
    }
  } else {
    // Before the wait (the previous kernel may still be running): only weights,
    // the head of each of the warp's rows into L2, so that they stream in while
    // that kernel finishes.
    if constexpr (kUsePdl) {
      // Lane l: line l of each row (lanes past a short row repeat its last
      // line; K >= 1 in every caller).
      const int64_t offset = min(static_cast<int64_t>(lane) * kPrefetchLine,
                                 static_cast<int64_t>(k_dim) * static_cast<int64_t>(sizeof(T)) - 1);
#pragma unroll
      for (int c = 0; c < kCols; ++c) prefetch_l2(reinterpret_cast<const char*>(wrow[c]) + offset);
    }
    pdl_wait();

    // Lane `lane` visits chunks lane, lane + 32, ... in increasing order.
    int chunk = lane;
    for (; chunk + 32 * (kUnroll - 1) < n_full; chunk += 32 * kUnroll) {
      Chunk<T> raw[kUnroll][kCols];
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) {
#pragma unroll
        for (int c = 0; c < kCols; ++c) {
          raw[u][c] = load_chunk<T, kVec>(wrow[c] + static_cast<int64_t>(chunk + 32 * u) * kChunk);
        }
      }
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) {
        accumulate_chunk<T, G, kVec>(raw[u], xrow, static_cast<int64_t>(chunk + 32 * u) * kChunk,
                                     acc);
      }
    }
    for (; chunk < n_full; chunk += 32) {
      Chunk<T> raw[kCols];
#pragma unroll
      for (int c = 0; c < kCols; ++c) {
        raw[c] = load_chunk<T, kVec>(wrow[c] + static_cast<int64_t>(chunk) * kChunk);
      }
      accumulate_chunk<T, G, kVec>(raw, xrow, static_cast<int64_t>(chunk) * kChunk, acc);
    }
    // Here chunk is in [n_full, n_full + 32): exactly one lane has chunk == n_full,
    // and the partial chunk is the last of that lane's sequence.
    const int rem = k_dim - n_full * kChunk;
    if (rem != 0 && chunk == n_full) {
      accumulate_partial<T, G>(wrow, xrow, static_cast<int64_t>(n_full) * kChunk, rem, acc);
    }
  }

  // Fixed xor tree: afterwards every lane holds the same bits for each sum.
#pragma unroll
  for (int g = 0; g < G; ++g) {
#pragma unroll
    for (int c = 0; c < kCols; ++c) {
      float v = acc[g][c];
#pragma unroll
      for (int offset = 16; offset > 0; offset >>= 1) v += __shfl_xor_sync(kFullMask, v, offset);
      acc[g][c] = v;
    }
  }
}

// Activation rows m0 .. m0 + G - 1, clamped to valid rows (rows past M are
// computed on row M - 1 and never written).
template <int G>
__device__ __forceinline__ void activation_rows(const float* x, int m0, int m_rows, int k_dim,
                                                const float* (&xrow)[G]) {
#pragma unroll
  for (int g = 0; g < G; ++g) xrow[g] = x + static_cast<int64_t>(min(m0 + g, m_rows - 1)) * k_dim;
}

// One warp's tile of y = x · wᵀ: rows m0 = group·G .. +G, columns n0 .. +kCols
// of column block `col_block` (kWarps·kCols columns, one slice per warp).
// Columns past N (in the last block) are computed on clamped, valid addresses
// and never written.
template <typename T, int G, bool kVec, int S>
__device__ __forceinline__ void linear_tile(const float* x, const T* w, float* y, int m_rows,
                                            int n_cols, int k_dim, int group, int col_block) {
  const int lane = static_cast<int>(threadIdx.x & 31u);
  const int n0 = (col_block * kWarps + static_cast<int>(threadIdx.x >> 5)) * kCols;
  if (n0 >= n_cols) return;  // warp-uniform; the kernels have no block barrier
  const int m0 = group * G;
  const T* wrow[kCols];
#pragma unroll
  for (int c = 0; c < kCols; ++c) {
    wrow[c] = w + static_cast<int64_t>(min(n0 + c, n_cols - 1)) * k_dim;
  }
  const float* xrow[G];
  activation_rows<G>(x, m0, m_rows, k_dim, xrow);
  float acc[G][kCols];
  warp_dot<T, G, kVec, S>(wrow, xrow, k_dim, lane, acc);

  // Lane g·kCols + c writes y[m0 + g, n0 + c].
  float out = 0.0f;
#pragma unroll
  for (int g = 0; g < G; ++g) {
#pragma unroll
    for (int c = 0; c < kCols; ++c) {
      if (lane == g * kCols + c) out = acc[g][c];
    }
  }
  const int g_out = lane / kCols;
  const int c_out = lane % kCols;
  if (lane < G * kCols && m0 + g_out < m_rows && n0 + c_out < n_cols) {
    y[static_cast<int64_t>(m0 + g_out) * n_cols + n0 + c_out] = out;
  }
}

// Batch-invariant y = x · wᵀ for one group of G rows and kCols columns per warp.
// Grid: one block per (column block of kWarps·kCols columns, row group), the
// row group varying fastest so the blocks that stream the same weights run at
// the same time and share them through L2. kVec: w rows, x rows and the chunks
// are 16-byte aligned.
template <typename T, int G, bool kVec, int S>
__global__ void __launch_bounds__(kThreads)
    invariant_linear_kernel(const float* __restrict__ x, const T* __restrict__ w,
                            float* __restrict__ y, int m_rows, int n_cols, int k_dim,
                            int n_groups) {
  pdl_launch_dependents();
  const int group = static_cast<int>(blockIdx.x % static_cast<unsigned>(n_groups));
  const int col_block = static_cast<int>(blockIdx.x / static_cast<unsigned>(n_groups));
  linear_tile<T, G, kVec, S>(x, w, y, m_rows, n_cols, k_dim, group, col_block);
}

// Several y_o = x · w_oᵀ in one grid: the concatenation of each output's grid
// of invariant_linear_kernel (block b belongs to the last output o with
// first_block[o] <= b; within it, the same (column block, row group) order).
// Every tile runs linear_tile, so each y_o has the bits linear() writes.
// Vectorised path only (the caller checks the alignment of x and every w).
template <typename T, int G, int S>
__global__ void __launch_bounds__(kThreads)
    invariant_multi_kernel(const float* __restrict__ x, MultiOuts<T> outs, int m_rows, int k_dim,
                           int n_groups) {
  pdl_launch_dependents();
  const PickedOutput<T> out = pick_output(outs, static_cast<int>(blockIdx.x));
  linear_tile<T, G, true, S>(x, out.w, out.y, m_rows, static_cast<int>(out.n_cols), k_dim,
                             out.local_block % n_groups, out.local_block / n_groups);
}

// linear_gelu_mul: each warp owns kGeluCols columns of gate AND the same
// columns of up, i.e. kCols weight rows, so warp_dot (and its register use)
// is the one of the plain kernel.
constexpr int kGeluCols = kCols / 2;
static_assert(kGeluCols * 2 == kCols, "a warp's weight rows are gate and up columns in pairs");
static_assert(kMaxGroup * kGeluCols <= 32, "each gate result is written by its own lane");

// gate[m, n] = gelu_tanh(x·w_gateᵀ)[m, n] · (x·w_upᵀ)[m, n]: both products with
// the invariant arithmetic (the bits linear() writes), then the epilogue of the
// gelu_mul op (GeluMulOp in cuda_elementwise.cu): __fmul_rn(gelu_tanh(g), u).
// Grid: one block per (column block of kWarps·kGeluCols columns, row group),
// the row group fastest. Vectorised path only.
template <typename T, int G, int S>
__global__ void __launch_bounds__(kThreads)
    invariant_gelu_mul_kernel(const float* __restrict__ x, const T* __restrict__ w_gate,
                              const T* __restrict__ w_up, float* __restrict__ gate, int m_rows,
                              int n_cols, int k_dim, int n_groups) {
  pdl_launch_dependents();
  const int lane = static_cast<int>(threadIdx.x & 31u);
  const int group = static_cast<int>(blockIdx.x % static_cast<unsigned>(n_groups));
  const int col_block = static_cast<int>(blockIdx.x / static_cast<unsigned>(n_groups));
  const int n0 = (col_block * kWarps + static_cast<int>(threadIdx.x >> 5)) * kGeluCols;
  if (n0 >= n_cols) return;  // warp-uniform; no block barrier
  const int m0 = group * G;
  // Weight rows: gate columns n0.., then up columns n0.. (clamped like linear_tile).
  const T* wrow[kCols];
#pragma unroll
  for (int c = 0; c < kGeluCols; ++c) {
    const int64_t col = min(n0 + c, n_cols - 1);
    wrow[c] = w_gate + col * k_dim;
    wrow[kGeluCols + c] = w_up + col * k_dim;
  }
  const float* xrow[G];
  activation_rows<G>(x, m0, m_rows, k_dim, xrow);
  float acc[G][kCols];
  warp_dot<T, G, true, S>(wrow, xrow, k_dim, lane, acc);

  // Lane g·kGeluCols + c writes gate[m0 + g, n0 + c] (one gelu per lane).
  float g_val = 0.0f;
  float u_val = 0.0f;
#pragma unroll
  for (int g = 0; g < G; ++g) {
#pragma unroll
    for (int c = 0; c < kGeluCols; ++c) {
      if (lane == g * kGeluCols + c) {
        g_val = acc[g][c];
        u_val = acc[g][kGeluCols + c];
      }
    }
  }
  const int g_out = lane / kGeluCols;
  const int c_out = lane % kGeluCols;
  if (lane < G * kGeluCols && m0 + g_out < m_rows && n0 + c_out < n_cols) {
    gate[static_cast<int64_t>(m0 + g_out) * n_cols + n0 + c_out] =
        __fmul_rn(gelu_tanh(g_val), u_val);
  }
}

bool aligned16(const void* p) {
  return (reinterpret_cast<uintptr_t>(p) & 15u) == 0;
}

// Whether the 16-byte vector loads apply to x and a w of element type `w_size`
// bytes (aligned bases, 16-byte rows of both).
bool vector_path(const void* x, const void* w, int64_t k, size_t w_size) {
  return aligned16(x) && aligned16(w) && k % 4 == 0 && (k * static_cast<int64_t>(w_size)) % 16 == 0;
}

// Launches an invariant kernel of `blocks` blocks of kThreads on `stream`, as a
// programmatic dependent of the previous kernel when kUsePdl.
template <typename... Params, typename... Args>
void launch_invariant_kernel(void (*kernel)(Params...), int64_t blocks, size_t smem,
                             cudaStream_t stream, const char* name, Args... args) {
  launch_pdl(kernel, blocks, kThreads, smem, stream, name, args...);
}

// Calls f(std::integral_constant<int, S>{}) with the pipeline stages for a
// launch of `blocks` blocks: 0 (register path) unless single-row 16-bit
// vectorised; else the deepest of 8, 6 and 3 stages that keeps every block
// resident in one wave (3, 4 or 9 blocks per SM by shared memory), and 6 for
// grids that need several waves anyway. Never changes results.
template <typename T, int G, bool kVec, typename F>
void with_stages(int64_t blocks, F&& f) {
  if constexpr (G == 1 && kVec && sizeof(T) == 2) {
    const int64_t sms = sm_count();
    const int64_t per_sm = (blocks + sms - 1) / sms;
    if (per_sm <= 3) return f(std::integral_constant<int, 8>{});
    if (per_sm <= 4) return f(std::integral_constant<int, 6>{});
    if (per_sm <= 9) return f(std::integral_constant<int, 3>{});
    return f(std::integral_constant<int, 6>{});
  } else {
    return f(std::integral_constant<int, 0>{});
  }
}

// Calls f(std::integral_constant<int, G>{}) with the row group of an M-row
// product: rows 1..8 run as one group of exactly M rows; more rows run in
// groups of kMaxGroup (the last one padded).
template <typename F>
void with_group(int64_t m, F&& f) {
  switch (std::min<int64_t>(m, kMaxGroup)) {
    case 1:
      return f(std::integral_constant<int, 1>{});
    case 2:
      return f(std::integral_constant<int, 2>{});
    case 3:
      return f(std::integral_constant<int, 3>{});
    case 4:
      return f(std::integral_constant<int, 4>{});
    case 5:
      return f(std::integral_constant<int, 5>{});
    case 6:
      return f(std::integral_constant<int, 6>{});
    case 7:
      return f(std::integral_constant<int, 7>{});
    default:
      return f(std::integral_constant<int, kMaxGroup>{});
  }
}

template <typename T, int G, bool kVec>
void launch_invariant_group(const float* x, const T* w, float* y, int64_t m, int64_t n, int64_t k,
                            cudaStream_t stream) {
  const int64_t groups = (m + G - 1) / G;
  const int64_t col_blocks = (n + kWarps * kCols - 1) / (kWarps * kCols);
  const int64_t blocks = groups * col_blocks;
  if (blocks > INT_MAX) {
    fail("linear: {} row groups x {} column blocks exceed the CUDA grid", groups, col_blocks);
  }
  with_stages<T, G, kVec>(blocks, [&](auto stages) {
    constexpr int S = decltype(stages)::value;
    launch_invariant_kernel(invariant_linear_kernel<T, G, kVec, S>, blocks, pipe_smem_bytes<S>(),
                            stream, "invariant_linear_kernel", x, w, y, static_cast<int>(m),
                            static_cast<int>(n), static_cast<int>(k), static_cast<int>(groups));
  });
}

// Misaligned operands take the scalar-load kernel, which is only instantiated
// for groups of 8 (rare: sliced test views).
template <typename T>
void launch_invariant(const float* x, const T* w, float* y, int64_t m, int64_t n, int64_t k,
                      cudaStream_t stream) {
  if (!vector_path(x, w, k, sizeof(T))) {
    return launch_invariant_group<T, kMaxGroup, false>(x, w, y, m, n, k, stream);
  }
  with_group(m, [&](auto g) {
    launch_invariant_group<T, decltype(g)::value, true>(x, w, y, m, n, k, stream);
  });
}

// linear_multi's fused path: the outputs with N > 0, up to kMaxMultiOuts per
// launch (fewer when the blocks of one more would overflow the grid). Every w
// is T, K columns, on the vector path; 1 <= M <= kInvariantRows.
template <typename T, int G>
void launch_multi_group(const float* x, std::span<const ProductOut> outs, int64_t m, int64_t k,
                        cudaStream_t stream) {
  const int64_t groups = (m + G - 1) / G;
  launch_multi_batches<T>(
      outs, [&](int64_t n) { return groups * ((n + kWarps * kCols - 1) / (kWarps * kCols)); },
      [&](const MultiOuts<T>& batch, int64_t blocks) {
        with_stages<T, G, true>(blocks, [&](auto stages) {
          constexpr int S = decltype(stages)::value;
          launch_invariant_kernel(invariant_multi_kernel<T, G, S>, blocks, pipe_smem_bytes<S>(),
                                  stream, "invariant_multi_kernel", x, batch, static_cast<int>(m),
                                  static_cast<int>(k), static_cast<int>(groups));
        });
      });
}

template <typename T>
void launch_multi(const float* x, std::span<const ProductOut> outs, int64_t m, int64_t k,
                  cudaStream_t stream) {
  with_group(m, [&](auto g) { launch_multi_group<T, decltype(g)::value>(x, outs, m, k, stream); });
}

// linear_gelu_mul's fused path: gate f32 [M, N]; w_gate, w_up T [N, K] on the
// vector path; 1 <= M <= kInvariantRows.
template <typename T>
void launch_gelu_mul(const float* x, const T* w_gate, const T* w_up, float* gate, int64_t m,
                     int64_t n, int64_t k, cudaStream_t stream) {
  with_group(m, [&](auto g) {
    constexpr int G = decltype(g)::value;
    const int64_t groups = (m + G - 1) / G;
    const int64_t col_blocks = (n + kWarps * kGeluCols - 1) / (kWarps * kGeluCols);
    const int64_t blocks = groups * col_blocks;
    if (blocks > INT_MAX) {
      fail("linear_gelu_mul: {} row groups x {} column blocks exceed the CUDA grid", groups,
           col_blocks);
    }
    with_stages<T, G, true>(blocks, [&](auto stages) {
      constexpr int S = decltype(stages)::value;
      launch_invariant_kernel(invariant_gelu_mul_kernel<T, G, S>, blocks, pipe_smem_bytes<S>(),
                              stream, "invariant_gelu_mul_kernel", x, w_gate, w_up, gate,
                              static_cast<int>(m), static_cast<int>(n), static_cast<int>(k),
                              static_cast<int>(groups));
    });
  });
}

// Calls f(std::type_identity<T>{}) with the element type of f32|f16 weights
// (callers check_float first). bf16 products always take the tensor-core
// kernels (cuda_linear_mma.cu), so the FMA kernels are not built for bf16.
template <typename F>
void with_weight_type(DType d, F&& f) {
  switch (d) {
    case DType::kF32:
      return f(std::type_identity<float>{});
    case DType::kF16:
      return f(std::type_identity<__half>{});
    default:
      fail("linear: the FMA kernels take f32|f16 weights, not {}", dtype_name(d));
  }
}

// ---------------------------------------------------------------------------
// Argument checks.

// linear()'s checks of one product y = x · wᵀ: op names the call, w_name and
// y_name the tensors ("w", "outs[1].w", "w_gate", ...).
void check_linear_args(const CudaBackend& be, const char* op, const char* w_name,
                       const char* y_name, const Tensor& x, const Tensor& w, const Tensor& y) {
  check_on(be, op, "x", x);
  check_on(be, op, w_name, w);
  check_on(be, op, y_name, y);
  check_dtype(op, "x", x, DType::kF32);
  check_weight(op, w_name, w);
  check_dtype(op, y_name, y, DType::kF32);
  check_rank(op, "x", x, 2);
  check_rank(op, w_name, w, 2);
  check_rank(op, y_name, y, 2);
  if (x.dim(1) != w.dim(1)) {
    fail("{}: x {} and {} {} disagree on K ({} vs {})", op, x.describe(), w_name, w.describe(),
         x.dim(1), w.dim(1));
  }
  if (y.dim(0) != x.dim(0) || y.dim(1) != w.dim(0)) {
    fail("{}: {} {} must be f32[{}, {}] for x {} and {} {}", op, y_name, y.describe(), x.dim(0),
         w.dim(0), x.describe(), w_name, w.describe());
  }
  check_no_alias(op, y_name, y, "x", x);
  check_no_alias(op, y_name, y, w_name, w);
}

// linear() never takes cuBLASLt: its bits would depend on M, and a verify
// window's rows must be those of a single decode row at any size. bf16 weights
// run the tensor-core kernels in chunks of kInvariantRows rows; f32|f16 weights
// the FMA kernel at any M (a bf16 copy would lose their precision).
constexpr int64_t kNeverGemm = std::numeric_limits<int64_t>::max();

// Rows [begin, begin + rows) of an f32 row-major matrix with `cols` columns.
const float* row_ptr(const Tensor& t, int64_t begin, int64_t cols) {
  return t.data_as<const float>() + begin * cols;
}
float* row_ptr_mut(const Tensor& t, int64_t begin, int64_t cols) {
  return t.data_as<float>() + begin * cols;
}

}  // namespace

// y[M, N] = x[M, K] · w[N, K]ᵀ; x, y f32, w f32|bf16|f16, all on this device; y
// must not overlap x or w. Batch-invariant at any M (see top).
void CudaBackend::linear(const Tensor& x, const Tensor& w, const Tensor& y) {
  OpTimer timer(*this, "linear");
  linear_rows_above(x, w, y, kNeverGemm);
}

void CudaBackend::linear_prefill(const Tensor& x, const Tensor& w, const Tensor& y) {
  OpTimer timer(*this, "linear_prefill");
  linear_rows_above(x, w, y, kPrefillGemmRows);
}

// Products of more than `gemm_rows` rows go through cuBLASLt, the rest through
// the batch-invariant kernel.
void CudaBackend::linear_rows_above(const Tensor& x, const Tensor& w, const Tensor& y,
                                    int64_t gemm_rows) {
  check_linear_args(*this, "linear", "w", "y", x, w, y);
  const int64_t m = x.dim(0);
  const int64_t n = w.dim(0);
  const int64_t k = x.dim(1);
  if (m == 0 || n == 0) return;
  if (k == 0) {
    check_cuda(cudaMemsetAsync(y.data(), 0, y.nbytes(), stream_), "linear (cudaMemsetAsync)");
    return;
  }
  if (m > INT_MAX || n > INT_MAX - kWarps * kCols || k > INT_MAX - kChunk) {
    fail("linear: x {} or w {} is too large for the GPU kernels (M, N and K must stay below 2^31)",
         x.describe(), w.describe());
  }
  if (is_quantized(w.dtype())) {
    // Quantized weights (drafters) take their own invariant kernel at every M.
    quant_linear(x.data_as<const float>(), w.data(), w.dtype(), w.scale_data(), y.data_as<float>(),
                 m, n, k, stream_);
    return;
  }
  if (m > gemm_rows && linear_lt(*this, x, w, y)) return;
  if (w.dtype() == DType::kBF16) {
    void* ready = take_ready_split(x, m, k);
    const int64_t chunk = std::min(m, kInvariantRows);
    void* x_split = ready != nullptr ? ready : scratch(x_split_, mma_split_bytes(chunk, k));
    for (int64_t r = 0; r < m; r += chunk) {
      mma_linear(row_ptr(x, r, k), x_split, ready != nullptr, w.data(), row_ptr_mut(y, r, n),
                 std::min(chunk, m - r), n, k, stream_);
    }
    return;
  }
  with_weight_type(w.dtype(), [&](auto tag) {
    using T = typename decltype(tag)::type;
    launch_invariant(x.data_as<const float>(), w.data_as<const T>(), y.data_as<float>(), m, n, k,
                     stream_);
  });
}

// Each outs[i].y f32 [M, N_i] = x f32 [M, K] · outs[i].w [N_i, K]ᵀ (f32|bf16|f16),
// bit for bit what linear() writes; all on this device; no y may overlap x, any
// w or another y. At most kInvariantRows rows with one weight dtype and 16-byte
// aligned operands: one launch per kMaxMultiOuts outputs; otherwise linear()
// per output.
void CudaBackend::linear_multi(const Tensor& x, std::span<const LinearOut> outs) {
  OpTimer timer(*this, "linear_multi");
  constexpr const char* kOp = "linear_multi";
  char w_name[32];
  char y_name[32];
  char other_name[32];
  for (size_t i = 0; i < outs.size(); ++i) {
    std::snprintf(w_name, sizeof(w_name), "outs[%zu].w", i);
    std::snprintf(y_name, sizeof(y_name), "outs[%zu].y", i);
    check_linear_args(*this, kOp, w_name, y_name, x, outs[i].w, outs[i].y);
  }
  // One launch writes every y while reading every w: no overlaps between
  // outputs either (names are formatted only for the error).
  for (size_t i = 0; i < outs.size(); ++i) {
    for (size_t j = 0; j < outs.size(); ++j) {
      if (j == i) continue;
      const bool on_w = ops::bytes_overlap(outs[i].y, outs[j].w);
      if (!on_w && !(j > i && ops::bytes_overlap(outs[i].y, outs[j].y))) continue;
      std::snprintf(y_name, sizeof(y_name), "outs[%zu].y", i);
      std::snprintf(other_name, sizeof(other_name), on_w ? "outs[%zu].w" : "outs[%zu].y", j);
      check_no_alias(kOp, y_name, outs[i].y, other_name, on_w ? outs[j].w : outs[j].y);
    }
  }
  if (outs.empty()) return;
  const int64_t m = x.dim(0);
  const int64_t k = x.dim(1);
  const DType dtype = outs[0].w.dtype();
  // Quantized weights run output by output (linear's own kernel).
  bool fused = m >= 1 && k >= 1 && k <= INT_MAX - kChunk && !is_quantized(dtype);
  for (const LinearOut& o : outs) {
    fused = fused && o.w.dtype() == dtype && o.w.dim(0) <= INT_MAX - kWarps * kCols;
  }
  // bf16 takes the tensor-core kernels, which handle any alignment and, in
  // chunks of kInvariantRows, any M; the FMA kernels fuse only 16-byte aligned
  // operands and at most kInvariantRows rows.
  const bool tensor_cores = fused && dtype == DType::kBF16;
  fused = fused && (tensor_cores || m <= kInvariantRows);
  for (const LinearOut& o : outs) {
    fused = fused && (tensor_cores || vector_path(x.data(), o.w.data(), k, dtype_size(dtype)));
  }
  if (!fused) {
    for (const LinearOut& o : outs) linear_rows_above(x, o.w, o.y, kNeverGemm);
    return;
  }
  const int64_t chunk = std::min(m, kInvariantRows);
  void* ready = tensor_cores ? take_ready_split(x, m, k) : nullptr;
  const bool split_ready = ready != nullptr;
  void* x_split =
      split_ready ? ready : (tensor_cores ? scratch(x_split_, mma_split_bytes(chunk, k)) : nullptr);
  // In slices of kMaxMultiOuts (a launch each) so the hot path never allocates.
  std::array<ProductOut, kMaxMultiOuts> slice;
  for (int64_t r = 0; r < m; r += chunk) {
    const int64_t rows = std::min(chunk, m - r);
    for (size_t first = 0; first < outs.size(); first += slice.size()) {
      const size_t count = std::min(slice.size(), outs.size() - first);
      for (size_t i = 0; i < count; ++i) {
        const LinearOut& o = outs[first + i];
        slice[i] = {o.w.data(), row_ptr_mut(o.y, r, o.w.dim(0)), o.w.dim(0)};
      }
      const std::span<const ProductOut> part(slice.data(), count);
      if (tensor_cores) {
        mma_linear_multi(row_ptr(x, r, k), x_split, split_ready, part, rows, k, stream_);
      } else {
        with_weight_type(dtype, [&](auto tag) {
          using T = typename decltype(tag)::type;
          launch_multi<T>(row_ptr(x, r, k), part, rows, k, stream_);
        });
      }
    }
  }
}

// gate f32 [M, I] = gelu_tanh(x · w_gateᵀ) ⊙ (x · w_upᵀ); x f32 [M, K]; w_gate,
// w_up [I, K] f32|bf16|f16; up f32 [M, I] is scratch (left untouched by the
// fused kernel); all on this device; gate and up overlap neither x, the
// weights nor each other. Bit for bit linear, linear, gelu_mul. At most
// kInvariantRows rows with one weight dtype and 16-byte aligned operands: one
// fused kernel; otherwise linear_multi then gelu_mul.
void CudaBackend::linear_gelu_mul(const Tensor& x, const Tensor& w_gate, const Tensor& w_up,
                                  const Tensor& gate, const Tensor& up) {
  constexpr const char* kOp = "linear_gelu_mul";
  check_linear_args(*this, kOp, "w_gate", "gate", x, w_gate, gate);
  check_linear_args(*this, kOp, "w_up", "up", x, w_up, up);
  check_same_shape(kOp, "gate", gate, "up", up);
  check_no_alias(kOp, "gate", gate, "up", up);
  check_no_alias(kOp, "gate", gate, "w_up", w_up);
  check_no_alias(kOp, "up", up, "w_gate", w_gate);
  const int64_t m = x.dim(0);
  const int64_t n = w_gate.dim(0);
  const int64_t k = x.dim(1);
  const DType dtype = w_gate.dtype();
  const bool fused = m >= 1 && m <= kInvariantRows && n >= 1 && n <= INT_MAX - kWarps * kCols &&
                     k >= 1 && k <= INT_MAX - kChunk && w_up.dtype() == dtype &&
                     !is_quantized(dtype) &&
                     vector_path(x.data(), w_gate.data(), k, dtype_size(dtype)) &&
                     vector_path(x.data(), w_up.data(), k, dtype_size(dtype));
  if (m >= 1 && n >= 1 && n <= INT_MAX - kWarps * kCols && k >= 1 && k <= INT_MAX - kChunk &&
      dtype == DType::kBF16 && w_up.dtype() == dtype) {
    OpTimer timer(*this, kOp);
    const int64_t chunk = std::min(m, kInvariantRows);
    void* ready = take_ready_split(x, m, k);
    void* x_split = ready != nullptr ? ready : scratch(x_split_, mma_split_bytes(chunk, k));
    // The output is down_proj's x: for a few rows (one chunk) its split is
    // written too (into the other split buffer, since this product reads
    // x_split).
    void* out_split = nullptr;
    if (m > 1 && m <= kInvariantRows) {
      out_split = scratch(x_split_out_, mma_split_bytes(m, n));
      ready_split_ = {gate.data(), m, n, op_seq_, out_split};
    }
    for (int64_t r = 0; r < m; r += chunk) {
      mma_linear_gelu_mul(row_ptr(x, r, k), x_split, ready != nullptr, out_split, w_gate.data(),
                          w_up.data(), row_ptr_mut(gate, r, n), std::min(chunk, m - r), n, k,
                          stream_);
    }
    return;
  }
  if (!fused) {
    Backend::linear_gelu_mul(x, w_gate, w_up, gate, up);
    return;
  }
  OpTimer timer(*this, kOp);
  with_weight_type(dtype, [&](auto tag) {
    using T = typename decltype(tag)::type;
    launch_gelu_mul<T>(x.data_as<const float>(), w_gate.data_as<const T>(), w_up.data_as<const T>(),
                       gate.data_as<float>(), m, n, k, stream_);
  });
}

}  // namespace specula::cuda
