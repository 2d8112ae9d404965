// SPDX-License-Identifier: Apache-2.0
// attention on the GPU (gemma4-architecture.md §2.5-§2.6): causal, optionally
// sliding-window, grouped-query attention, split across the key sequence.
//
// Batch invariance. A query's output depends only on its own q row, the keys
// it can see and their absolute positions, never on S, on the other queries,
// on k_pos0, on the ring layout or on how far the key tensor extends past what
// the query sees. That is what lets a decode step (1 query, keys gathered from
// the window start) and a verify window (k + 1 queries over a longer key
// tensor) agree bit for bit. It holds because every reduction is pinned to
// absolute positions and to the (query, head) alone:
// - keys are split into chunks of kChunk = 32 absolute positions ([c·32,
//   (c+1)·32)); a chunk's partial covers only the keys of that chunk the query
//   sees: m = max score, l = Σ expf(score - m) (xor butterfly over the 32 key
//   lanes), acc[d] = Σ expf(score - m)·v[d] (one fmaf per key, increasing
//   position, starting from 0);
// - a score is scale · q·k, the dot summed as four running fmaf sums over the
//   dims ≡ 0, 1, 2, 3 (mod 4), each in increasing dim, then (s0 + s1) + (s2 + s3);
// - the combine merges the chunks c = 0 .. n-1 the query sees (counted from its
//   first visible chunk): M = max m_c, w_c = expf(m_c - M), L = Σ l_c·w_c
//   (lane-strided over c, then xor butterfly), acc = Σ w_c·acc_c summed in 8
//   interleaved groups (c mod 8, increasing c) added in a fixed tree; out = acc / L.
// Which threads do what (pairs per block, pairs per register tile, which key
// rows a block stages) varies with S and T; the arithmetic of a (query, head)
// does not. exp is expf, no atomics; products are explicit fmaf / __fmul_rn and
// sums __fadd_rn, so no FMA contraction or reassociation can differ.
//
// Speed. Decode is latency bound, so a partials block stages the K and V rows
// of its chunk in shared memory with asynchronous copies issued all at once
// (one memory latency per block, V arriving while the scores are computed),
// and every (query, head) pair of its kv head (the GQA group, times the
// queries of a verify window) reuses that tile. The combine is launched as a
// programmatic dependent (PDL) so its launch overlaps the partials kernel.
// attention_with_inputs (a lone row) runs attention_fused_kernel instead of
// the partials kernel: it also finishes the q/k/v inputs (as attention_inputs
// does, bit for bit) and stages the cached keys before its inputs are ready.
#include <cuda_pipeline.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <atomic>
#include <climits>
#include <cmath>
#include <cstdint>
#include <utility>

#include "engine/backend/cuda/cuda_backend.h"
#include "engine/backend/cuda/cuda_device_common.cuh"
#include "engine/backend/cuda/cuda_launch.cuh"

namespace specula::cuda {
namespace {

// Keys per chunk (absolute positions); equal to the warp size: lane j of a
// warp scores key j of a chunk. Part of the numerics (see above).
constexpr int kChunk = 32;
// The largest head dimension (dims per combine lane = kMaxLaneDims).
constexpr int kMaxHeadDim = 512;
constexpr int kMaxLaneDims = kMaxHeadDim / 32;
// (query, head) pairs per partials block, all of one kv head. Work split only.
constexpr int kPairTile = 32;
constexpr int kPartialThreads = 256;
constexpr int kPartialWarps = kPartialThreads / 32;
// Warps per combine block (one block per (query, head)); the fixed tree that
// adds the warps' sums is written for 8. Part of the numerics.
constexpr int kCombineWarps = 8;
constexpr int kCombineThreads = kCombineWarps * 32;
// Partials kept at once: the scratch is requested at this size on every call
// (so it is allocated once, not regrown as T grows in steady-state decode);
// queries are processed in tiles that fit it.
constexpr size_t kPartialsBudget = size_t{256} << 20;
constexpr unsigned kFullMask = 0xffffffffu;

// Shared-memory row stride (floats) of a staged q/k/v row of head dim d: d
// rounded up to whole float4s, then to an odd count of float4s, so that the 8
// lanes of a quarter warp reading float4 i of keys j .. j + 7 hit distinct banks.
__host__ __device__ constexpr int smem_row_floats(int d) {
  return 4 * (((d + 3) / 4) | 1);
}

// q rows staged per partials block holding `pairs` pairs (whole register tiles of 4).
__host__ __device__ constexpr int staged_q_rows(int pairs) {
  return (pairs + 3) / 4 * 4;
}

// Dynamic shared memory of a partials block: K and V tiles [kChunk][ld], q rows
// [staged_q_rows][ld], scores [pairs][kChunk].
constexpr size_t partials_smem_bytes(int d, int pairs) {
  return (static_cast<size_t>(2 * kChunk + staged_q_rows(pairs)) * smem_row_floats(d) +
          static_cast<size_t>(pairs) * kChunk) *
         sizeof(float);
}
constexpr size_t kMaxPartialsSmem = partials_smem_bytes(kMaxHeadDim, kPairTile);
// Hopper allows 227 KB of shared memory per block (less the kernel's static 512 B).
static_assert(kMaxPartialsSmem + 512 <= 227 * 1024, "partials tiles exceed Hopper shared memory");

// Geometry shared by both kernels (by value).
struct AttnGeom {
  int s;          // queries in this launch (a tile of the call's S)
  int n_heads;    // query heads
  int n_kv;       // kv heads
  int group;      // n_heads / n_kv
  int d;          // head dimension
  int ld;         // smem_row_floats(d)
  int n_slots;    // partial slots per (query, head): most chunks a query can see
  int pair_tile;  // pairs per partials block: min(kPairTile, s · group)
  int64_t t;      // keys
  int64_t k_pos0;
  int64_t ring;     // > 0: k/v are rings of `ring` rows (position kp at row kp % ring)
  int64_t c_first;  // chunk of partials block x = 0: the chunk of k_pos0
  int window;
  bool causal;
  bool vec4;   // d % 4 == 0 and q, k, v 16-byte aligned: rows move as float4
  bool eager;  // one pair tile (decode, verify): stage rows before reading q_pos
  // AttentionParams::positions_bound: key ranges come from q_pos alone (t and
  // k_pos0 are not read), and partials block x = 0 sits at the chunk of the
  // first query's first visible key, so one launch fits every step.
  bool derive;
  // AttentionParams::product_follows, on the call's last combine launch only:
  // the combine lets the kernel after it start early.
  bool release_next;
  // attention_fused_kernel only: V rows [0, v_early) of a chunk are staged with
  // its K rows, rows [v_early, kChunk) once the scores are done, into the space
  // the q rows held until then (kChunk: every V row with K, q rows after V).
  // Where that lets three blocks share an SM instead of two (verify windows of
  // 5-8 queries at D = 256), see fused_late_v_rows().
  int v_early;
  float scale;
};

__host__ __device__ inline int64_t floor_div(int64_t x, int64_t y) {
  return x >= 0 ? x / y : -((-x + y - 1) / y);
}

// Absolute positions [lo, hi] of the keys the query at `qp` sees (empty if lo > hi):
// (!causal || kp <= qp) && (window == 0 || kp > qp - window), within the tensor.
struct KeyRange {
  int64_t lo, hi;
};
// With g.derive the tensor holds every key a query can see (the caller's
// promise), so the same range follows from qp and the window alone.
__device__ inline KeyRange visible_keys(int64_t qp, const AttnGeom& g) {
  if (g.derive) return KeyRange{g.window > 0 ? max(int64_t{0}, qp - g.window + 1) : 0, qp};
  KeyRange r{g.k_pos0, g.k_pos0 + g.t - 1};
  if (g.causal) r.hi = min(r.hi, qp);
  if (g.window > 0) r.lo = max(r.lo, qp - g.window + 1);
  return r;
}

// Fixed xor-butterfly reductions: each step adds the same two values in every
// lane (addition commutes), so all lanes end with one identical result.
__device__ inline float lane_sum(float x) {
#pragma unroll
  for (int off = 16; off > 0; off >>= 1) x = __fadd_rn(x, __shfl_xor_sync(kFullMask, x, off));
  return x;
}
__device__ inline float lane_max(float x) {
#pragma unroll
  for (int off = 16; off > 0; off >>= 1) x = fmaxf(x, __shfl_xor_sync(kFullMask, x, off));
  return x;
}

// Queues (in the calling thread's current cp.async group) the copy of one
// d-float row from global `src` to shared `dst`, split over the 32 lanes of a
// warp, and zeroes dst[d, round_up(d, 4)) so float4 dot products read zeros
// past the row.
__device__ inline void stage_row(float* dst, const float* src, const AttnGeom& g, int lane) {
  if (g.vec4) {
    for (int i = lane; i < g.d / 4; i += 32) __pipeline_memcpy_async(dst + 4 * i, src + 4 * i, 16);
  } else {
    for (int i = lane; i < g.d; i += 32) __pipeline_memcpy_async(dst + i, src + i, 4);
    for (int i = g.d + lane; i < (g.d + 3) / 4 * 4; i += 32) dst[i] = 0.0f;
  }
}

// Pairs per register tile in the partials block (one staged k or v float4 read
// serves TP pairs). Fewer pairs: smaller tiles, so more warps share the work.
// Never changes results: each pair's arithmetic is the same for every TP.
__host__ __device__ inline int pairs_per_tile(int np) {
  return np <= 4 ? 1 : (np <= 8 ? 2 : 4);
}

// Scores of the chunk: sP[p·kChunk + j] = scale · q_p·k_j for the block's np
// pairs and the chunk's keys j (junk for keys that were not staged: the
// softmax never reads those). Task = (tile of TP pairs, key j); the 32 keys of
// a tile are the 32 lanes of one warp, so each lane reads its own key row and
// the q rows are warp-wide broadcasts.
template <int TP>
__device__ void chunk_scores(const float* sK, const float* sQ, float* sP, int np,
                             const AttnGeom& g) {
  const int n4 = (g.d + 3) / 4;
  const int tasks = (np + TP - 1) / TP * kChunk;
  for (int task = static_cast<int>(threadIdx.x); task < tasks; task += kPartialThreads) {
    const int p0 = task / kChunk * TP;
    const int j = task % kChunk;
    const float4* kr = reinterpret_cast<const float4*>(sK + j * g.ld);
    const float4* qr[TP];
    // Running sums over dims 4i + 0, 4i + 1, 4i + 2, 4i + 3 (q rows past np in
    // the last tile were never staged: junk whose sums are dropped).
    float s0[TP], s1[TP], s2[TP], s3[TP];
#pragma unroll
    for (int u = 0; u < TP; ++u) {
      qr[u] = reinterpret_cast<const float4*>(sQ + (p0 + u) * g.ld);
      s0[u] = s1[u] = s2[u] = s3[u] = 0.0f;
    }
    // (Less unrolling for 4-pair tiles keeps the kernel within 80 registers.)
#pragma unroll(TP == 4 ? 2 : 4)
    for (int i = 0; i < n4; ++i) {
      const float4 kk = kr[i];
#pragma unroll
      for (int u = 0; u < TP; ++u) {
        const float4 qq = qr[u][i];
        s0[u] = fmaf(qq.x, kk.x, s0[u]);
        s1[u] = fmaf(qq.y, kk.y, s1[u]);
        s2[u] = fmaf(qq.z, kk.z, s2[u]);
        s3[u] = fmaf(qq.w, kk.w, s3[u]);
      }
    }
#pragma unroll
    for (int u = 0; u < TP; ++u) {
      if (p0 + u < np) {
        const float dot = __fadd_rn(__fadd_rn(s0[u], s1[u]), __fadd_rn(s2[u], s3[u]));
        sP[(p0 + u) * kChunk + j] = __fmul_rn(g.scale, dot);
      }
    }
  }
}

// Weighted values of the chunk: for each pair p with a visible key here,
// acc[d] = Σ_{j = j0..j1} sP[p·kChunk + j] · v_j[d] (increasing j, from 0),
// written to its partial slot. Task = (tile of TP pairs, float4 column i of
// the head dim); keys run over the union [u0, u1] of the pairs' ranges and
// each pair skips the keys outside its own [j0, j1] (not a multiply by 0, so
// what a pair cannot see never reaches its sums).
template <int TP>
__device__ void chunk_values(const float* sV, const float* sP, const int* s_j0, const int* s_j1,
                             const int64_t* s_entry, int np, int u0, int u1,
                             float* __restrict__ part_acc, const AttnGeom& g) {
  const int n4 = (g.d + 3) / 4;
  const int tasks = (np + TP - 1) / TP * n4;
  for (int task = static_cast<int>(threadIdx.x); task < tasks; task += kPartialThreads) {
    const int p0 = task / n4 * TP;
    const int i = task % n4;  // dims 4i .. 4i + 3
    int j0[TP], j1[TP];
    float4 acc[TP];
#pragma unroll
    for (int u = 0; u < TP; ++u) {
      const bool real = p0 + u < np;
      j0[u] = real ? s_j0[p0 + u] : 1;  // j0 > j1: sees nothing
      j1[u] = real ? s_j1[p0 + u] : 0;
      acc[u] = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
    }
    for (int j = u0; j <= u1; ++j) {
      const float4 vv = reinterpret_cast<const float4*>(sV + j * g.ld)[i];
#pragma unroll
      for (int u = 0; u < TP; ++u) {
        if (j >= j0[u] && j <= j1[u]) {
          const float w = sP[(p0 + u) * kChunk + j];
          acc[u].x = fmaf(w, vv.x, acc[u].x);
          acc[u].y = fmaf(w, vv.y, acc[u].y);
          acc[u].z = fmaf(w, vv.z, acc[u].z);
          acc[u].w = fmaf(w, vv.w, acc[u].w);
        }
      }
    }
#pragma unroll
    for (int u = 0; u < TP; ++u) {
      if (p0 + u >= np || s_entry[p0 + u] < 0) continue;
      float* dst = part_acc + s_entry[p0 + u] * g.d + 4 * i;
      if (g.vec4) {
        *reinterpret_cast<float4*>(dst) = acc[u];
      } else {
        const float a[4] = {acc[u].x, acc[u].y, acc[u].z, acc[u].w};
        for (int e = 0; e < 4 && 4 * i + e < g.d; ++e) dst[e] = a[e];
      }
    }
  }
}

// chunk_values for a block whose V rows [v_early, kChunk) are still arriving
// (AttnGeom::v_early) and whose tasks are at most one per thread: keys below
// v_early first, then the wait for the late rows (this thread's copies, then
// the block barrier, so every thread must call it), then the rest. The same
// sums as chunk_values: each pair still adds its keys in increasing order.
template <int TP>
__device__ void chunk_values_late(const float* sV, const float* sP, const int* s_j0,
                                  const int* s_j1, const int64_t* s_entry, int np, int u0, int u1,
                                  int v_early, float* __restrict__ part_acc, const AttnGeom& g) {
  const int n4 = (g.d + 3) / 4;
  const int tasks = (np + TP - 1) / TP * n4;
  const int task = static_cast<int>(threadIdx.x);
  const bool active = task < tasks;
  const int p0 = active ? task / n4 * TP : 0;
  const int i = task % n4;  // dims 4i .. 4i + 3
  int j0[TP], j1[TP];
  float4 acc[TP];
#pragma unroll
  for (int u = 0; u < TP; ++u) {
    const bool real = active && p0 + u < np;
    j0[u] = real ? s_j0[p0 + u] : 1;  // j0 > j1: sees nothing
    j1[u] = real ? s_j1[p0 + u] : 0;
    acc[u] = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
  }
  const auto add_keys = [&](int from, int to) {
    for (int j = from; j <= to; ++j) {
      const float4 vv = reinterpret_cast<const float4*>(sV + j * g.ld)[i];
#pragma unroll
      for (int u = 0; u < TP; ++u) {
        if (j >= j0[u] && j <= j1[u]) {
          const float w = sP[(p0 + u) * kChunk + j];
          acc[u].x = fmaf(w, vv.x, acc[u].x);
          acc[u].y = fmaf(w, vv.y, acc[u].y);
          acc[u].z = fmaf(w, vv.z, acc[u].z);
          acc[u].w = fmaf(w, vv.w, acc[u].w);
        }
      }
    }
  };
  if (active) add_keys(u0, min(u1, v_early - 1));
  __pipeline_wait_prior(0);  // this thread's late V rows have landed
  __syncthreads();           // ... and everyone's, and the ones finished in place
  if (!active) return;
  add_keys(max(u0, v_early), u1);
#pragma unroll
  for (int u = 0; u < TP; ++u) {
    if (p0 + u >= np || s_entry[p0 + u] < 0) continue;
    *reinterpret_cast<float4*>(part_acc + s_entry[p0 + u] * g.d + 4 * i) = acc[u];
  }
}

// The keys each of the np pairs pair0 .. pair0 + np - 1 (of kv head kvh) sees
// in the chunk at position c0, written by threads 0 .. np - 1: rows s_j0[p] ..
// s_j1[p] of the chunk (j0 > j1: none) and the pair's partial entry (-1: none).
__device__ void chunk_pair_ranges(const int32_t* __restrict__ q_pos, int64_t c0, int kvh,
                                  int64_t pair0, int np, const AttnGeom& g, int* s_j0, int* s_j1,
                                  int64_t* s_entry) {
  if (static_cast<int>(threadIdx.x) >= np) return;
  const int64_t pair = pair0 + threadIdx.x;
  const int64_t qi = pair / g.group;
  const int64_t h = int64_t{kvh} * g.group + pair % g.group;
  const KeyRange r = visible_keys(q_pos[qi], g);
  const int64_t a = max(r.lo, c0);
  const int64_t b = min(r.hi, c0 + kChunk - 1);
  const int64_t slot = floor_div(c0, kChunk) - floor_div(r.lo, kChunk);
  const bool sees = r.lo <= r.hi && a <= b && slot < g.n_slots;
  s_j0[threadIdx.x] = sees ? static_cast<int>(a - c0) : 1;
  s_j1[threadIdx.x] = sees ? static_cast<int>(b - c0) : 0;
  s_entry[threadIdx.x] = sees ? (qi * g.n_heads + h) * g.n_slots + slot : -1;
}

// The hull {u0, u1} of the pairs' row ranges (u0 > u1: no pair sees a key of
// the chunk), once chunk_pair_ranges' writes are visible.
__device__ int2 chunk_key_hull(const int* s_j0, const int* s_j1, int np) {
  int u0 = kChunk;
  int u1 = -1;
  for (int p = 0; p < np; ++p) {
    if (s_j0[p] <= s_j1[p]) {
      u0 = min(u0, s_j0[p]);
      u1 = max(u1, s_j1[p]);
    }
  }
  return make_int2(u0, u1);
}

// Scores of the block's np pairs over the staged keys, then each pair's chunk
// softmax (one warp per pair, lane j = key j): sP holds the weights
// expf(score - m) afterwards, and (m, l) goes to the pair's partial entry.
// sK and sQ must be staged and visible to the whole block. after_scores() runs
// in every thread once all scores are written and sK / sQ are no longer read.
template <typename AfterScores>
__device__ void chunk_softmax(const float* sK, const float* sQ, float* sP, const int* s_j0,
                              const int* s_j1, const int64_t* s_entry, int np,
                              float* __restrict__ part_ml, const AttnGeom& g,
                              AfterScores&& after_scores) {
  const int lane = static_cast<int>(threadIdx.x) & 31;
  const int warp = static_cast<int>(threadIdx.x) / 32;
  const int tp = pairs_per_tile(np);
  if (tp == 1) {
    chunk_scores<1>(sK, sQ, sP, np, g);
  } else if (tp == 2) {
    chunk_scores<2>(sK, sQ, sP, np, g);
  } else {
    chunk_scores<4>(sK, sQ, sP, np, g);
  }
  __syncthreads();
  after_scores();
  for (int p = warp; p < np; p += kPartialWarps) {
    const int j0 = s_j0[p];
    const int j1 = s_j1[p];
    if (j0 > j1) continue;  // warp-uniform
    const bool seen = lane >= j0 && lane <= j1;
    const float sc = sP[p * kChunk + lane];
    const float m = lane_max(seen ? sc : -INFINITY);
    const float e = seen ? expf(sc - m) : 0.0f;
    const float l = lane_sum(e);
    sP[p * kChunk + lane] = e;
    if (lane == 0) {
      part_ml[2 * s_entry[p]] = m;
      part_ml[2 * s_entry[p] + 1] = l;
    }
  }
}

// The pairs' weighted V sums over keys [u0, u1] into their partial entries
// (chunk_values with the register tile np calls for); sV and the weights in
// sP must be visible to the whole block, except V rows [v_early, kChunk) when
// v_early < kChunk (chunk_values_late, which waits for them).
__device__ void chunk_weighted_values(const float* sV, const float* sP, const int* s_j0,
                                      const int* s_j1, const int64_t* s_entry, int np, int u0,
                                      int u1, float* __restrict__ part_acc, const AttnGeom& g,
                                      int v_early = kChunk) {
  const int tp = pairs_per_tile(np);
  if (v_early < kChunk) {
    if (tp == 1) {
      chunk_values_late<1>(sV, sP, s_j0, s_j1, s_entry, np, u0, u1, v_early, part_acc, g);
    } else if (tp == 2) {
      chunk_values_late<2>(sV, sP, s_j0, s_j1, s_entry, np, u0, u1, v_early, part_acc, g);
    } else {
      chunk_values_late<4>(sV, sP, s_j0, s_j1, s_entry, np, u0, u1, v_early, part_acc, g);
    }
    return;
  }
  if (tp == 1) {
    chunk_values<1>(sV, sP, s_j0, s_j1, s_entry, np, u0, u1, part_acc, g);
  } else if (tp == 2) {
    chunk_values<2>(sV, sP, s_j0, s_j1, s_entry, np, u0, u1, part_acc, g);
  } else {
    chunk_values<4>(sV, sP, s_j0, s_j1, s_entry, np, u0, u1, part_acc, g);
  }
}

// Partials: one block per (absolute chunk, kv head, tile of up to kPairTile
// (query, head) pairs of that kv head); pair = query · group + head in group.
// Grid: x = chunk - c_first (every chunk the key tensor touches), y = kv head,
// z = pair tile. Each block stages q rows and the chunk's K and V rows that any
// of its pairs sees (cp.async, K group then V group), scores every (pair, key),
// takes each pair's chunk softmax, then its weighted V sum. Writes, for each
// pair with a visible key in the chunk, ml = (m, l) and acc[D] at slot
// chunk - (first chunk the query sees); other slots are left unwritten (the
// combine never reads them). Blocks where no pair sees a key exit at once.
// Up to 3 blocks per SM (80 registers; a decode block's tiles take 71 KB at D = 256).
__global__ void __launch_bounds__(kPartialThreads, 3)
    attention_partials_kernel(const float* __restrict__ q, const float* __restrict__ k,
                              const float* __restrict__ v, const int32_t* __restrict__ q_pos,
                              float* __restrict__ part_ml, float* __restrict__ part_acc,
                              AttnGeom g) {
  // The combine may launch now: it waits (griddepcontrol.wait) for this whole
  // grid to finish, and its memory to be visible, before reading anything.
  // This kernel is itself a programmatic dependent of the kernel before it,
  // and waits for it before touching anything.
  pdl_launch_dependents();
  pdl_wait();
  extern __shared__ float4 smem[];
  float* sK = reinterpret_cast<float*>(smem);          // [kChunk][ld] keys of the chunk
  float* sV = sK + kChunk * g.ld;                      // [kChunk][ld] values
  float* sQ = sV + kChunk * g.ld;                      // [staged_q_rows][ld] q rows
  float* sP = sQ + staged_q_rows(g.pair_tile) * g.ld;  // [pair_tile][kChunk] scores, then weights
  __shared__ int s_j0[kPairTile];                      // keys j0 .. j1 of the chunk pair p sees
  __shared__ int s_j1[kPairTile];                      // (j0 > j1: none)
  __shared__ int64_t s_entry[kPairTile];               // its partial entry (-1: none)

  const int lane = static_cast<int>(threadIdx.x) & 31;
  const int warp = static_cast<int>(threadIdx.x) / 32;
  // Derived launches: the keys of this tile's queries (consecutive positions)
  // span [first visible key of query 0, position of the last query].
  const KeyRange hull =
      g.derive ? KeyRange{visible_keys(q_pos[0], g).lo, static_cast<int64_t>(q_pos[g.s - 1])}
               : KeyRange{g.k_pos0, g.k_pos0 + g.t - 1};
  const int64_t c_first = g.derive ? floor_div(hull.lo, kChunk) : g.c_first;
  const int64_t c0 = (c_first + blockIdx.x) * kChunk;  // position of key 0 of the chunk
  const int kvh = static_cast<int>(blockIdx.y);
  const int64_t pair0 = static_cast<int64_t>(blockIdx.z) * g.pair_tile;
  const int np =
      static_cast<int>(min(static_cast<int64_t>(g.pair_tile), int64_t{g.s} * g.group - pair0));

  // Stages q rows and K rows j0..j1 (cp.async group 0), then V rows j0..j1
  // (group 1). Row of absolute position kp: kp - k_pos0, or kp % ring for ring
  // caches (which may wrap inside a chunk).
  auto stage_tiles = [&](int j0, int j1) {
    const int64_t kv_row = int64_t{g.n_kv} * g.d;  // floats per key
    const float* k_head = k + int64_t{kvh} * g.d;
    const float* v_head = v + int64_t{kvh} * g.d;
    auto key_row = [&](int64_t kp) { return g.ring > 0 ? kp % g.ring : kp - g.k_pos0; };
    for (int p = warp; p < np; p += kPartialWarps) {
      const int64_t pair = pair0 + p;
      const int64_t h = int64_t{kvh} * g.group + pair % g.group;
      stage_row(sQ + p * g.ld, q + ((pair / g.group) * g.n_heads + h) * g.d, g, lane);
    }
    for (int j = j0 + warp; j <= j1; j += kPartialWarps) {
      stage_row(sK + j * g.ld, k_head + key_row(c0 + j) * kv_row, g, lane);
    }
    __pipeline_commit();
    for (int j = j0 + warp; j <= j1; j += kPartialWarps) {
      stage_row(sV + j * g.ld, v_head + key_row(c0 + j) * kv_row, g, lane);
    }
    __pipeline_commit();
  };
  // Eager: stage every row of the chunk inside the key tensor before reading
  // q_pos, saving a memory latency (the visible keys are a subset).
  if (g.eager) {
    stage_tiles(static_cast<int>(max(c0, hull.lo) - c0),
                static_cast<int>(min(c0 + kChunk - 1, hull.hi) - c0));
  }

  chunk_pair_ranges(q_pos, c0, kvh, pair0, np, g, s_j0, s_j1, s_entry);
  __syncthreads();
  // Keys [u0, u1]: the hull of the pairs' ranges (rows the loops below read).
  const int2 hull_keys = chunk_key_hull(s_j0, s_j1, np);
  const int u0 = hull_keys.x;
  const int u1 = hull_keys.y;
  if (u0 > u1) {                            // block-uniform: no pair sees a key of this chunk
    if (g.eager) __pipeline_wait_prior(0);  // no copy outlives the block
    return;
  }
  if (!g.eager) stage_tiles(u0, u1);

  __pipeline_wait_prior(1);  // this thread's q and K copies have landed
  __syncthreads();           // ... and everyone's
  chunk_softmax(sK, sQ, sP, s_j0, s_j1, s_entry, np, part_ml, g, [] {});
  __pipeline_wait_prior(0);  // V rows
  __syncthreads();
  chunk_weighted_values(sV, sP, s_j0, s_j1, s_entry, np, u0, u1, part_acc, g);
}

// ---- attention_with_inputs: the inputs finished inside the partials kernel ----

// The un-finished inputs of a fused launch (AttentionInputsParams as pointers).
struct FusedInputs {
  const float* q;      // raw q [S, H, D]
  const float* k;      // raw k [S, KV, D], or null (a KV-shared layer: q only)
  const float* v;      // raw v [S, KV, D] (unused when v_from_k)
  const void* q_norm;  // [D] of q_norm_dtype, or null (no weight)
  const void* k_norm;
  DType q_norm_dtype;
  DType k_norm_dtype;
  const float* inv_freq;  // [D/2]
  float eps;
  bool v_from_k;
};

// Element i of a [n] weight of any float dtype, as f32 (exact widening).
__device__ inline float load_weight(const void* w, DType dt, int i) {
  if (dt == DType::kBF16) return load_float<DType::kBF16>(w, i);
  if (dt == DType::kF16) return load_float<DType::kF16>(w, i);
  return load_float<DType::kF32>(w, i);
}

// A partials block (decode steps and verify windows of up to kFusedPairTiles
// pair tiles, derived launches) that finishes its inputs itself, so no attention_inputs kernel
// runs between the q/k/v product and attention, and the chunk's old keys load
// while the product is still running:
// - before pdl_wait(): q_pos, the norm weights and frequencies (into shared
//   memory), and the cache rows at positions below the first query (the
//   ordering promise of attention_with_inputs), staged with cp.async;
// - after it: each pair's q row, normalised and rotated into sQ exactly as
//   attention_inputs finishes it, and for each new position in this chunk the
//   finished k and v rows of this kv head, into sK / sV and into their cache
//   rows (each (position, kv head) lies in one chunk; of that chunk's pair
//   tiles, the one with the first pair of the position's own query writes the
//   row, so each cache row has one writer). A KV-shared layer (no k) stages those rows from
//   the cache instead (its donor wrote them earlier in the same forward).
// Then scores, softmax and values as the partials kernel computes them.
// Positions are consecutive (the derived-launch promise), so new position p is
// token p - q_pos[0] of k and v.
template <int kPer, int kMinBlocks>
__global__ void __launch_bounds__(kPartialThreads, kMinBlocks)
    attention_fused_kernel(FusedInputs in, float* __restrict__ k_cache, float* __restrict__ v_cache,
                           const int32_t* __restrict__ q_pos, float* __restrict__ part_ml,
                           float* __restrict__ part_acc, AttnGeom g) {
  pdl_launch_dependents();  // the combine: it waits for this whole grid
  extern __shared__ float4 smem[];
  const int d = g.d;
  // V rows below v_early arrive with K; the others after the scores, where
  // the q rows were (see AttnGeom::v_early).
  const int v_early = g.v_early;
  const bool late_v = v_early < kChunk;
  float* sK = reinterpret_cast<float*>(smem);
  float* sV = sK + kChunk * g.ld;
  float* sQ = sV + (late_v ? v_early : kChunk) * g.ld;
  float* sP = late_v ? sV + kChunk * g.ld : sQ + staged_q_rows(g.pair_tile) * g.ld;
  float* sQn = sP + g.pair_tile * kChunk;  // [d] q_norm as f32
  float* sKn = sQn + d;                    // [d] k_norm as f32
  float* sFreq = sKn + d;                  // [d / 2]
  __shared__ int s_j0[kPairTile];
  __shared__ int s_j1[kPairTile];
  __shared__ int64_t s_entry[kPairTile];

  const int lane = static_cast<int>(threadIdx.x) & 31;
  const int warp = static_cast<int>(threadIdx.x) / 32;
  const int64_t first = q_pos[0];
  const int64_t last = q_pos[g.s - 1];
  const int64_t hull_lo = visible_keys(first, g).lo;
  const int64_t c0 = (floor_div(hull_lo, kChunk) + blockIdx.x) * kChunk;
  const int kvh = static_cast<int>(blockIdx.y);
  // Pair tile z: pairs pair0 .. pair0 + np - 1 (pair = query · group + head in group).
  const int64_t pair0 = int64_t{blockIdx.z} * g.pair_tile;
  const int np = static_cast<int>(min(int64_t{g.pair_tile}, int64_t{g.s} * g.group - pair0));
  const int64_t kv_row = int64_t{g.n_kv} * d;  // floats per key
  const auto key_row = [&](int64_t kp) { return g.ring > 0 ? kp % g.ring : kp - g.k_pos0; };
  // Rows j0..j1 of the chunk from the cache: K, and V below v_early.
  const auto stage_keys = [&](int j0, int j1) {
    for (int j = j0 + warp; j <= j1; j += kPartialWarps) {
      stage_row(sK + j * g.ld, k_cache + key_row(c0 + j) * kv_row + int64_t{kvh} * d, g, lane);
      if (j < v_early) {
        stage_row(sV + j * g.ld, v_cache + key_row(c0 + j) * kv_row + int64_t{kvh} * d, g, lane);
      }
    }
    __pipeline_commit();
  };
  // The same rows' V at or past v_early (once the q rows there are read).
  const auto stage_late_values = [&](int j0, int j1) {
    for (int j = max(j0, v_early) + warp; j <= j1; j += kPartialWarps) {
      stage_row(sV + j * g.ld, v_cache + key_row(c0 + j) * kv_row + int64_t{kvh} * d, g, lane);
    }
  };
  // Old keys of the chunk: [max(c0, first visible), min(chunk end, first - 1)].
  const int old0 = static_cast<int>(max(c0, hull_lo) - c0);
  const int old1 = static_cast<int>(min(c0 + kChunk - 1, first - 1) - c0);
  stage_keys(old0, old1);
  const bool has_qn = in.q_norm != nullptr;
  const bool has_kn = in.k_norm != nullptr;
  for (int i = static_cast<int>(threadIdx.x); i < d; i += kPartialThreads) {
    sQn[i] = has_qn ? load_weight(in.q_norm, in.q_norm_dtype, i) : 0.0f;
    sKn[i] = has_kn && in.k != nullptr ? load_weight(in.k_norm, in.k_norm_dtype, i) : 0.0f;
    if (i < d / 2) sFreq[i] = in.inv_freq[i];
  }
  chunk_pair_ranges(q_pos, c0, kvh, pair0, np, g, s_j0, s_j1, s_entry);
  __syncthreads();
  // Keys [u0, u1]: the hull of the pairs' ranges (rows the loops below read).
  const int2 hull_keys = chunk_key_hull(s_j0, s_j1, np);
  const int u0 = hull_keys.x;
  const int u1 = hull_keys.y;
  if (u0 > u1) {  // block-uniform: no pair sees a key here, so no new position lies here either
    __pipeline_wait_prior(0);
    return;
  }

  pdl_wait();
  // New keys of the chunk: positions [max(c0, first), min(chunk end, last)]
  // (of them, this tile's pairs read rows u0 .. u1 only).
  const int new0 = max(static_cast<int>(max(c0, first) - c0), u0);
  const int new1 = min(static_cast<int>(min(c0 + kChunk - 1, last) - c0), u1);
  const int n_new = in.k != nullptr ? max(0, new1 - new0 + 1) : 0;
  if (in.k == nullptr) stage_keys(new0, new1);
  // The finished v row of new position c0 + j (its raw v row, or with v_from_k
  // its raw k row, plainly normalised) to smem_dst and, unless null, cache_dst:
  // the same bits as the item loop below writes.
  const auto finish_value = [&](int j, float* smem_dst, float* cache_dst) {
    const int64_t src = ((c0 + j - first) * g.n_kv + kvh) * d;
    float vv[kPer];
    load_held<kPer, 32>(in.v_from_k ? in.k + src : in.v + src, lane, d, vv);
    const float inv_v = rms_inv(warp_row_sum_squares(vv, d, lane), d, in.eps);
    write_plain_norm(vv, inv_v, d, lane, smem_dst, cache_dst);
  };
  const auto q_weight = [&](int, int c) { return sQn[c]; };
  const auto k_weight = [&](int, int c) { return sKn[c]; };
  const auto freq = [&](int, int pair) { return sFreq[pair]; };
  // Work items, one warp each: the pairs' q rows, then the new k/v rows.
  for (int item = warp; item < np + n_new; item += kPartialWarps) {
    float vals[kPer];
    if (item < np) {
      const int64_t qi = (pair0 + item) / g.group;
      const int64_t h = int64_t{kvh} * g.group + (pair0 + item) % g.group;
      load_held<kPer, 32>(in.q + (qi * g.n_heads + h) * d, lane, d, vals);
      const float inv = rms_inv(warp_row_sum_squares(vals, d, lane), d, in.eps);
      write_norm_rope(vals, inv, has_qn, q_weight, d, lane, sQ + item * g.ld, q_pos[qi], freq,
                      nullptr, nullptr);
      continue;
    }
    const int j = new0 + (item - np);
    const int64_t pos = c0 + j;
    const int64_t src = ((pos - first) * g.n_kv + kvh) * d;
    const int64_t dst = key_row(pos) * kv_row + int64_t{kvh} * d;
    // Several tiles may finish the row; the cache gets it from the one holding
    // the first pair of its own query (which sees it, so never exits early).
    const bool writer = (pos - first) * g.group / g.pair_tile == int64_t{blockIdx.z};
    // k and v load together (one memory round trip); v_from_k normalises k's row.
    float vv[kPer];
    load_held<kPer, 32>(in.k + src, lane, d, vals);
    load_held<kPer, 32>(in.v_from_k ? nullptr : in.v + src, lane, d, vv);
    const float inv_k = rms_inv(warp_row_sum_squares(vals, d, lane), d, in.eps);
    // A late v row's slot still holds q rows: only the cache gets it now, and
    // the block finishes it again into its slot after the scores.
    float* v_smem = j < v_early ? sV + j * g.ld : nullptr;
    float* v_out = writer ? v_cache + dst : nullptr;
    if (v_smem == nullptr) {
      v_smem = v_out;
      v_out = nullptr;
    }
    if (v_smem == nullptr) {
      // not the writer, and the row is late: nothing to store yet
    } else if (in.v_from_k) {
      write_plain_norm(vals, inv_k, d, lane, v_smem, v_out);
    } else {
      const float inv_v = rms_inv(warp_row_sum_squares(vv, d, lane), d, in.eps);
      write_plain_norm(vv, inv_v, d, lane, v_smem, v_out);
    }
    write_norm_rope(vals, inv_k, has_kn, k_weight, d, lane, sK + j * g.ld,
                    static_cast<int32_t>(pos), freq, writer ? k_cache + dst : nullptr, nullptr);
  }
  __pipeline_wait_prior(0);  // this thread's cache rows have landed
  __syncthreads();           // ... and everyone's, and the finished rows
  chunk_softmax(sK, sQ, sP, s_j0, s_j1, s_entry, np, part_ml, g, [&] {
    if (!late_v) return;
    // The q rows are read: their space takes V rows v_early.. of the old keys
    // (and of a KV-shared layer's new ones) by copy, of the new keys by
    // finishing them again, one warp a row, while the softmax runs.
    stage_late_values(old0, old1);
    if (in.k == nullptr) stage_late_values(new0, new1);
    __pipeline_commit();
    for (int j = max(new0, v_early) + warp; j < new0 + n_new; j += kPartialWarps) {
      finish_value(j, sV + j * g.ld, nullptr);
    }
  });
  __syncthreads();
  chunk_weighted_values(sV, sP, s_j0, s_j1, s_entry, np, u0, u1, part_acc, g, v_early);
}

// Most pair tiles of a fused launch (31B's full-attention verify window of 5
// queries: 40 pairs, two tiles).
constexpr int kFusedPairTiles = 4;

// Dynamic shared memory of a fused block: the partials tiles (the q rows inside
// the V tile when late_v), then the norm weights and frequencies.
constexpr size_t fused_smem_bytes(int d, int pairs, bool late_v) {
  const size_t q_rows = late_v ? 0 : static_cast<size_t>(staged_q_rows(pairs));
  return ((2 * kChunk + q_rows) * smem_row_floats(d) + static_cast<size_t>(pairs) * kChunk +
          static_cast<size_t>(2 * d + d / 2)) *
         sizeof(float);
}

// Blocks of `dynamic_bytes` dynamic (plus `static_bytes` static) shared
// memory that fit one SM of the current device (its attributes cached per
// device, as sm_count does).
int smem_blocks_per_sm(size_t dynamic_bytes, size_t static_bytes) {
  static std::atomic<int> per_sm[64];
  static std::atomic<int> reserved[64];
  int device = 0;
  check_cuda(cudaGetDevice(&device), "cudaGetDevice");
  const int slot = device >= 0 && device < 64 ? device : 0;
  int sm = per_sm[slot].load(std::memory_order_relaxed);
  int res = reserved[slot].load(std::memory_order_relaxed);
  if (sm == 0) {
    check_cuda(cudaDeviceGetAttribute(&sm, cudaDevAttrMaxSharedMemoryPerMultiprocessor, device),
               "cudaDeviceGetAttribute(maxSharedMemoryPerMultiprocessor)");
    check_cuda(cudaDeviceGetAttribute(&res, cudaDevAttrReservedSharedMemoryPerBlock, device),
               "cudaDeviceGetAttribute(reservedSharedMemoryPerBlock)");
    reserved[slot].store(res, std::memory_order_relaxed);
    per_sm[slot].store(sm, std::memory_order_relaxed);
  }
  return static_cast<int>(static_cast<size_t>(sm) /
                          (dynamic_bytes + static_bytes + static_cast<size_t>(res)));
}

// Static shared memory of the partials kernels (the pair ranges and entries).
constexpr size_t kPartialsStaticSmem = kPairTile * (2 * sizeof(int) + sizeof(int64_t));

// AttnGeom::v_early of a fused launch of `blocks` blocks of `pairs` pairs at
// head dim d: V rows past the q rows' count wait for the scores where that
// lets blocks of D <= 256 (three an SM by registers) fit three an SM by shared
// memory too, the grid has more blocks than fit the SMs at the lower count,
// and each thread has at most one value task (chunk_values_late). Else kChunk
// (every V row with K). The late rows cost a block one more memory round trip
// (H200: E2B's decode steps, 8 pairs in grids of at most 32 blocks, took 2.7%
// longer with them), so they pay only where they save a wave: 31B's sliding
// layers in verify windows of 5 queries (10 pairs: 80 KB a block, two an SM;
// 272 working blocks for 264 places) ran in two waves without them.
int fused_late_v_rows(int d, int pairs, int64_t blocks) {
  const int q_rows = staged_q_rows(pairs);
  const int value_tasks = (pairs + pairs_per_tile(pairs) - 1) / pairs_per_tile(pairs) * (d / 4);
  if (d > 256 || q_rows > kChunk || value_tasks > kPartialThreads) return kChunk;
  const int full = smem_blocks_per_sm(fused_smem_bytes(d, pairs, false), kPartialsStaticSmem);
  if (full >= 3 || blocks <= int64_t{full} * sm_count() ||
      smem_blocks_per_sm(fused_smem_bytes(d, pairs, true), kPartialsStaticSmem) < 3) {
    return kChunk;
  }
  return kChunk - q_rows;
}

// Combine: one block per (query, head) row = qi · H + h; merges the partials of
// the n chunks the query sees (see the numerics at the top) and writes
// out = acc / L, or a zero row when the query sees no key. Warp w sums chunks
// c ≡ w (mod 8); lane `lane` owns dims lane, lane + 32, ...; every warp
// computes M and L itself (same values). Grid: x = rows.
template <int NR>
__global__ void __launch_bounds__(kCombineThreads)
    attention_combine_kernel(const int32_t* __restrict__ q_pos, const float* __restrict__ part_ml,
                             const float* __restrict__ part_acc, float* __restrict__ out,
                             AttnGeom g) {
  // Launched as a programmatic dependent of the partials kernel: wait for it
  // (a no-op when launched without the attribute). It lets the kernel after it
  // start early only when the caller says the output product follows
  // (release_next; the model does so for a lone decode row): on an H200 (31B
  // shapes) letting every combine do so made batch-8 decode steps 40% slower
  // (30.2 -> 42.4 ms), and even the last combine of a batch-8 step or a verify
  // window 25-30%, while a single decode row gains ~7 us a layer.
  if (g.release_next) pdl_launch_dependents();
  pdl_wait();
  static_assert(kCombineWarps == 8, "the fixed sum tree below adds 8 warp sums");
  __shared__ float s_red[kCombineWarps][kMaxHeadDim];
  const int lane = static_cast<int>(threadIdx.x) & 31;
  const int warp = static_cast<int>(threadIdx.x) / 32;
  const int64_t row = blockIdx.x;
  float* o = out + row * g.d;
  const KeyRange r = visible_keys(q_pos[row / g.n_heads], g);
  if (r.lo > r.hi) {
    for (int dim = static_cast<int>(threadIdx.x); dim < g.d; dim += kCombineThreads) {
      o[dim] = 0.0f;  // nothing visible: zeros, not 0/0
    }
    return;
  }
  const int64_t c_lo = floor_div(r.lo, kChunk);
  const int n =
      static_cast<int>(min(floor_div(r.hi, kChunk) - c_lo + 1, static_cast<int64_t>(g.n_slots)));
  const float* ml = part_ml + 2 * row * g.n_slots;
  const float* pa = part_acc + row * g.n_slots * g.d;

  float m_part = -INFINITY;
  // The partials are the predecessor's output: coherent loads (load_act,
  // cuda_launch.cuh). The read-only path was ~1% faster at batch 8 (31B on an
  // H200: 25.25 against 25.45-25.49 ms a step) but promises nothing here.
  for (int c = lane; c < n; c += 32) m_part = fmaxf(m_part, load_act(ml + 2 * c));
  const float m = lane_max(m_part);
  float l_part = 0.0f;
  for (int c = lane; c < n; c += 32) {
    l_part = fmaf(load_act(ml + 2 * c + 1), expf(load_act(ml + 2 * c) - m), l_part);
  }
  const float l = lane_sum(l_part);

  float acc[NR];
#pragma unroll
  for (int i = 0; i < NR; ++i) acc[i] = 0.0f;
  // acc[i] += w_c · acc_c[dim] over this warp's chunks in increasing c; the
  // main loop loads 4 chunks before using them (more loads in flight), the
  // tail takes the rest one by one. Dims past d (only in the last i, as
  // NR = ceil(d / 32)) re-read dim d - 1: unconditional loads, never stored.
  auto chunk_dims = [&](int c, float(&x)[NR]) {
    const float* a = pa + static_cast<int64_t>(c) * g.d;
#pragma unroll
    for (int i = 0; i < NR; ++i) x[i] = load_act(a + min(lane + 32 * i, g.d - 1));
  };
  constexpr int kAhead = 4;
  int c = warp;
  for (; c + (kAhead - 1) * kCombineWarps < n; c += kAhead * kCombineWarps) {
    float x[kAhead][NR];
    float w[kAhead];
#pragma unroll
    for (int u = 0; u < kAhead; ++u) {
      w[u] = load_act(ml + 2 * (c + u * kCombineWarps));
      chunk_dims(c + u * kCombineWarps, x[u]);
    }
#pragma unroll
    for (int u = 0; u < kAhead; ++u) {
      const float wu = expf(w[u] - m);
#pragma unroll
      for (int i = 0; i < NR; ++i) acc[i] = fmaf(wu, x[u][i], acc[i]);
    }
  }
  for (; c < n; c += kCombineWarps) {
    float x[NR];
    chunk_dims(c, x);
    const float w = expf(load_act(ml + 2 * c) - m);
#pragma unroll
    for (int i = 0; i < NR; ++i) acc[i] = fmaf(w, x[i], acc[i]);
  }
#pragma unroll
  for (int i = 0; i < NR; ++i) {
    const int dim = lane + 32 * i;
    if (dim < g.d) s_red[warp][dim] = acc[i];
  }
  __syncthreads();
  for (int dim = static_cast<int>(threadIdx.x); dim < g.d; dim += kCombineThreads) {
    const float s03 =
        __fadd_rn(__fadd_rn(s_red[0][dim], s_red[1][dim]), __fadd_rn(s_red[2][dim], s_red[3][dim]));
    const float s47 =
        __fadd_rn(__fadd_rn(s_red[4][dim], s_red[5][dim]), __fadd_rn(s_red[6][dim], s_red[7][dim]));
    o[dim] = __fdiv_rn(__fadd_rn(s03, s47), l);
  }
}

// The partials kernel may use up to kMaxPartialsSmem of dynamic shared memory;
// raise its limit once per device (an attribute of the function per context).
void allow_partials_smem(int device) {
  static std::atomic<uint64_t> done{0};
  const uint64_t bit = device >= 0 && device < 64 ? uint64_t{1} << device : 0;
  if (bit != 0 && (done.load(std::memory_order_relaxed) & bit) != 0) return;
  check_cuda(
      cudaFuncSetAttribute(attention_partials_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                           static_cast<int>(kMaxPartialsSmem)),
      "cudaFuncSetAttribute(attention_partials_kernel)");
  done.fetch_or(bit, std::memory_order_relaxed);
}

void launch_partials(const float* q, const float* k, const float* v, const int32_t* q_pos,
                     float* part_ml, float* part_acc, const AttnGeom& g, int64_t n_chunks,
                     cudaStream_t stream) {
  const int64_t pairs = int64_t{g.s} * g.group;
  const dim3 grid(static_cast<unsigned>(n_chunks), static_cast<unsigned>(g.n_kv),
                  static_cast<unsigned>((pairs + g.pair_tile - 1) / g.pair_tile));
  launch_pdl(attention_partials_kernel, grid, dim3(kPartialThreads),
             partials_smem_bytes(g.d, g.pair_tile), stream, "attention_partials_kernel", q, k, v,
             q_pos, part_ml, part_acc, g);
}

// One combine block per (query, head) row; `after_partials`: launched as a
// programmatic dependent of the partials kernel just queued.
template <int NR>
void launch_combine(const int32_t* q_pos, const float* part_ml, const float* part_acc, float* out,
                    const AttnGeom& g, bool after_partials, cudaStream_t stream) {
  launch_kernel(attention_combine_kernel<NR>, dim3(static_cast<unsigned>(int64_t{g.s} * g.n_heads)),
                dim3(kCombineThreads), 0, stream, "attention_combine_kernel", after_partials, q_pos,
                part_ml, part_acc, out, g);
}

template <int... NRs>
void dispatch_combine(int nr, std::integer_sequence<int, NRs...>, const int32_t* q_pos,
                      const float* part_ml, const float* part_acc, float* out, const AttnGeom& g,
                      bool after_partials, cudaStream_t stream) {
  // Exactly one NR + 1 matches (nr is in [1, kMaxLaneDims], checked by the caller).
  ((nr == NRs + 1
        ? launch_combine<NRs + 1>(q_pos, part_ml, part_acc, out, g, after_partials, stream)
        : void()),
   ...);
}

bool aligned16(const void* p) {
  return reinterpret_cast<uintptr_t>(p) % 16 == 0;
}

// The launches of one attention call (past the fast-prefill branch): the
// geometry, the partials grid, the query tile and the partials scratch.
struct AttnPlan {
  AttnGeom g{};
  int64_t n_chunks = 0;  // chunks the key tensor touches (0: no partials kernel)
  int64_t tile = 0;      // queries per launch
  float* part_acc = nullptr;
  float* part_ml = nullptr;
  int nr = 0;  // combine lanes' dims: ceil(D / 32)

  // Derived sliding launches: the hull of a tile of s consecutive queries spans
  // at most window + s - 1 positions.
  int64_t grid_chunks(int64_t s) const {
    if (!g.derive || g.window <= 0) return n_chunks;
    return std::min<int64_t>(n_chunks, (g.window + s - 1 + kChunk - 2) / kChunk + 1);
  }
};

// attention()'s checks (shapes, devices, what the kernels support).
ops::AttentionDims check_cuda_attention(CudaBackend& be, const AttentionParams& p) {
  constexpr const char* kOp = "attention";
  check_on(be, kOp, "q", p.q);
  check_on(be, kOp, "k", p.k);
  check_on(be, kOp, "v", p.v);
  check_on(be, kOp, "out", p.out);
  check_on(be, kOp, "q_positions", p.q_positions);
  const ops::AttentionDims dims = ops::check_attention(p);
  if (dims.head_dim > kMaxHeadDim) {
    fail("attention: head dimension {} of q {} exceeds the {} the CUDA kernels support",
         dims.head_dim, p.q.describe(), kMaxHeadDim);
  }
  if (dims.heads > 65535) {
    fail("attention: q {} / k {} have more heads than the CUDA kernels support", p.q.describe(),
         p.k.describe());
  }
  return dims;
}

AttnPlan plan_attention(CudaBackend& be, const AttentionParams& p, const ops::AttentionDims& dims) {
  const int64_t s_len = dims.queries;
  const int64_t n_heads = dims.heads;
  const int64_t d = dims.head_dim;
  const int64_t t_len = dims.keys;
  AttnPlan plan;
  AttnGeom& g = plan.g;
  g.n_heads = static_cast<int>(n_heads);
  g.n_kv = static_cast<int>(dims.kv_heads);
  g.group = static_cast<int>(n_heads / dims.kv_heads);
  g.d = static_cast<int>(d);
  g.ld = smem_row_floats(g.d);
  g.t = t_len;
  g.k_pos0 = p.k_pos0;
  g.ring = dims.ring ? p.k.dim(0) : 0;
  g.c_first = floor_div(p.k_pos0, kChunk);
  g.window = p.window;
  g.causal = p.causal;
  g.vec4 = d % 4 == 0 && aligned16(p.q.data()) && aligned16(p.k.data()) && aligned16(p.v.data());
  g.scale = p.scale;
  g.derive = p.positions_bound > 0 && p.causal;
  // Chunks the key tensor touches (the partials grid), and slots per (query,
  // head): the chunks a visible range can touch, bounded by those and, for a
  // causal window, by the window length (a range of w positions touches at
  // most (w + kChunk - 2) / kChunk + 1 chunks; without causality a window
  // bounds only the start of the range). Derived launches size both by
  // positions_bound instead of T, so they do not change from step to step.
  int64_t n_chunks = t_len > 0 ? floor_div(p.k_pos0 + t_len - 1, kChunk) - g.c_first + 1 : 0;
  if (g.derive) {
    if (p.q_positions.numel() > 0 && t_len > 0 && p.k_pos0 + t_len > p.positions_bound) {
      fail("attention: keys up to position {} reach past positions_bound {}", p.k_pos0 + t_len - 1,
           p.positions_bound);
    }
    n_chunks = (p.positions_bound + kChunk - 1) / kChunk;
  }
  if (n_chunks > INT_MAX) {
    fail("attention: k {} spans {} chunks of {} keys, more than the CUDA kernels support",
         p.k.describe(), n_chunks, kChunk);
  }
  plan.n_chunks = n_chunks;
  int64_t n_slots = n_chunks;
  if (p.causal && p.window > 0) {
    n_slots = std::min<int64_t>(n_slots, (p.window + kChunk - 2) / kChunk + 1);
  }
  g.n_slots = static_cast<int>(n_slots);

  // Tile the queries so one tile's partials fit the scratch; tiles are
  // independent (a query's result does not depend on its tile).
  const size_t per_query = static_cast<size_t>(n_heads) * static_cast<size_t>(n_slots) *
                           static_cast<size_t>(d + 2) * sizeof(float);
  int64_t tile = s_len;
  void* base = nullptr;
  if (per_query > 0) {
    const size_t bytes = std::max(kPartialsBudget, per_query);
    base = be.scratch(be.attn_partials_, bytes);
    tile = std::min<int64_t>(s_len, static_cast<int64_t>(bytes / per_query));
  }
  // Grid z of the partials kernel is at most 65535 pair tiles; the combine grid
  // (x = tile · H blocks) at most INT_MAX.
  tile = std::min<int64_t>(tile, int64_t{65535} * kPairTile / g.group);
  tile = std::min<int64_t>(tile, int64_t{INT_MAX} / n_heads);
  plan.tile = std::max<int64_t>(tile, 1);
  // acc [tile·H·slots][D] first (16-byte aligned rows when D % 4 == 0), then
  // the (m, l) pairs.
  plan.part_acc = static_cast<float*>(base);
  plan.part_ml =
      plan.part_acc == nullptr ? nullptr : plan.part_acc + plan.tile * n_heads * n_slots * d;
  if (n_chunks > 0) allow_partials_smem(be.device_index());
  plan.nr = static_cast<int>((d + 31) / 32);
  return plan;
}

// Sets the per-launch fields of g for queries [s0, s0 + s) of an S-query call.
void set_tile(AttnGeom& g, const AttentionParams& p, int64_t s0, int64_t s, int64_t s_len) {
  g.s = static_cast<int>(s);
  g.pair_tile = static_cast<int>(std::min<int64_t>(kPairTile, int64_t{g.s} * g.group));
  // Decode and verify windows (one pair tile): their keys are nearly all
  // visible, so staging a chunk's rows before knowing the ranges wastes little.
  g.eager = int64_t{g.s} * g.group <= kPairTile;
  g.release_next = p.product_follows && s0 + s >= s_len;
  g.v_early = kChunk;
}

}  // namespace

int attention_fused_late_v_rows(int head_dim, int pairs, int64_t blocks) {
  return fused_late_v_rows(head_dim, std::min(pairs, kPairTile), blocks);
}

// q f32 [S, H, D], k/v f32 [T, Hkv, D], out f32 [S, H, D], q_positions i32 [S]
// (all on this device); H a multiple of Hkv, D <= 512. See AttentionParams.
void CudaBackend::attention(const AttentionParams& p) {
  OpTimer timer(*this, "attention");
  const ops::AttentionDims dims = check_cuda_attention(*this, p);
  const int64_t s_len = dims.queries;
  if (p.out.numel() == 0) return;
  if (p.allow_fast_prefill && !dims.ring && s_len >= kFastPrefillQueries && dims.keys > 0) {
    attention_prefill_gemm(*this, p);
    return;
  }
  AttnPlan plan = plan_attention(*this, p, dims);
  AttnGeom& g = plan.g;
  const int64_t n_heads = dims.heads;
  const int64_t d = dims.head_dim;
  const auto* q = p.q.data_as<const float>();
  const auto* k = p.k.data_as<const float>();
  const auto* v = p.v.data_as<const float>();
  const auto* pos = p.q_positions.data_as<const int32_t>();
  auto* out = p.out.data_as<float>();
  for (int64_t s0 = 0; s0 < s_len; s0 += plan.tile) {
    set_tile(g, p, s0, std::min(plan.tile, s_len - s0), s_len);
    const int64_t offset = s0 * n_heads * d;
    if (plan.n_chunks > 0) {
      launch_partials(q + offset, k, v, pos + s0, plan.part_ml, plan.part_acc, g,
                      plan.grid_chunks(g.s), stream());
    }
    dispatch_combine(plan.nr, std::make_integer_sequence<int, kMaxLaneDims>{}, pos + s0,
                     plan.part_ml, plan.part_acc, out + offset, g,
                     /*after_partials=*/plan.n_chunks > 0, stream());
  }
}

// See Backend::attention_with_inputs. attention_fused_kernel (inputs and
// partials) and the combine when the call is a derived launch of one pair tile
// (decode steps, short verify windows) with 16-byte aligned float4 rows and the
// cache read in place; otherwise the two ops.
void CudaBackend::attention_with_inputs(const AttentionInputsParams& in, const AttentionParams& p) {
  const ops::AttentionInputsDims idims = ops::check_attention_inputs(in);
  const ops::AttentionDims dims = check_cuda_attention(*this, p);
  const auto same = [](const Tensor& a, const Tensor& b) { return a.data() == b.data(); };
  bool fits = p.causal && p.positions_bound > 0 && !p.allow_fast_prefill && dims.keys > 0 &&
              dims.queries > 0 &&
              dims.queries * (dims.heads / dims.kv_heads) <= kFusedPairTiles * kPairTile &&
              dims.head_dim % 4 == 0 && idims.head_dim == dims.head_dim &&
              idims.tokens == dims.queries && idims.heads == dims.heads && same(in.q, p.q) &&
              same(in.positions, p.q_positions) && aligned16(p.q.data()) && aligned16(p.k.data()) &&
              aligned16(p.v.data());
  if (fits && idims.has_k) {
    // The new rows go where the attention reads them: the same cache, in place.
    fits = idims.has_cache && idims.kv_heads == dims.kv_heads && same(in.cache_k, p.k) &&
           same(in.cache_v, p.v) &&
           (dims.ring ? p.k.dim(0) == in.cache_k.dim(0)
                      : p.k_pos0 == 0 && p.k.dim(0) <= in.cache_k.dim(0));
  }
  if (!fits) {
    Backend::attention_with_inputs(in, p);
    return;
  }
  check_on(*this, "attention_with_inputs", "q_norm", in.q_norm);
  check_on(*this, "attention_with_inputs", "inv_freq", in.inv_freq);
  if (idims.has_k) {
    check_on(*this, "attention_with_inputs", "k", in.k);
    check_on(*this, "attention_with_inputs", "k_norm", in.k_norm);
    check_on(*this, "attention_with_inputs", "v", in.v);
  }
  OpTimer timer(*this, "attention_with_inputs");
  AttnPlan plan = plan_attention(*this, p, dims);
  if (plan.tile < dims.queries) {  // (never at these sizes: the scratch holds far more)
    Backend::attention_with_inputs(in, p);
    return;
  }
  AttnGeom& g = plan.g;
  set_tile(g, p, 0, dims.queries, dims.queries);
  FusedInputs f{};
  f.q = in.q.data_as<const float>();
  f.q_norm = in.q_norm.empty() ? nullptr : in.q_norm.data();
  f.q_norm_dtype = in.q_norm.empty() ? DType::kF32 : in.q_norm.dtype();
  f.inv_freq = in.inv_freq.data_as<const float>();
  f.eps = in.eps;
  f.v_from_k = in.v_from_k;
  if (idims.has_k) {
    f.k = in.k.data_as<const float>();
    f.v = in.v.data_as<const float>();
    f.k_norm = in.k_norm.empty() ? nullptr : in.k_norm.data();
    f.k_norm_dtype = in.k_norm.empty() ? DType::kF32 : in.k_norm.dtype();
  }
  const auto* pos = p.q_positions.data_as<const int32_t>();
  const int64_t pairs = int64_t{g.s} * g.group;
  const dim3 grid(static_cast<unsigned>(plan.grid_chunks(g.s)), static_cast<unsigned>(g.n_kv),
                  static_cast<unsigned>((pairs + g.pair_tile - 1) / g.pair_tile));
  // Rows of up to 256 floats hold 8 a lane and fit three blocks an SM (the
  // occupancy of the partials kernel: with two, 31B decode steps took 0.8 ms
  // longer on an H200); wider heads fit one block an SM by shared memory anyway.
  auto kernel = g.d <= 256 ? attention_fused_kernel<8, 3> : attention_fused_kernel<16, 1>;
  g.v_early = fused_late_v_rows(g.d, g.pair_tile, int64_t{grid.x} * int64_t{grid.y} * grid.z);
  launch_pdl(kernel, grid, dim3(kPartialThreads),
             fused_smem_bytes(g.d, g.pair_tile, g.v_early < kChunk), stream(),
             "attention_fused_kernel", f, p.k.data_as<float>(), p.v.data_as<float>(), pos,
             plan.part_ml, plan.part_acc, g);
  dispatch_combine(plan.nr, std::make_integer_sequence<int, kMaxLaneDims>{}, pos, plan.part_ml,
                   plan.part_acc, p.out.data_as<float>(), g, /*after_partials=*/true, stream());
}

}  // namespace specula::cuda
