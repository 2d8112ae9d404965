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
#include <cuda_pipeline.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <atomic>
#include <climits>
#include <cmath>
#include <cstdint>
#include <utility>

#include "engine/backend/cuda/cuda_backend.h"
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
__device__ inline float warp_sum(float x) {
#pragma unroll
  for (int off = 16; off > 0; off >>= 1) x = __fadd_rn(x, __shfl_xor_sync(kFullMask, x, off));
  return x;
}
__device__ inline float warp_max(float x) {
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
__device__ inline int pairs_per_tile(int np) {
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

  if (static_cast<int>(threadIdx.x) < np) {
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
  __syncthreads();
  // Keys [u0, u1]: the hull of the pairs' ranges (rows the loops below read).
  int u0 = kChunk;
  int u1 = -1;
  for (int p = 0; p < np; ++p) {
    if (s_j0[p] <= s_j1[p]) {
      u0 = min(u0, s_j0[p]);
      u1 = max(u1, s_j1[p]);
    }
  }
  if (u0 > u1) {                            // block-uniform: no pair sees a key of this chunk
    if (g.eager) __pipeline_wait_prior(0);  // no copy outlives the block
    return;
  }
  if (!g.eager) stage_tiles(u0, u1);

  const int tp = pairs_per_tile(np);
  __pipeline_wait_prior(1);  // this thread's q and K copies have landed
  __syncthreads();           // ... and everyone's
  if (tp == 1) {
    chunk_scores<1>(sK, sQ, sP, np, g);
  } else if (tp == 2) {
    chunk_scores<2>(sK, sQ, sP, np, g);
  } else {
    chunk_scores<4>(sK, sQ, sP, np, g);
  }
  __syncthreads();

  // Chunk softmax, one warp per pair, lane j = key j.
  for (int p = warp; p < np; p += kPartialWarps) {
    const int j0 = s_j0[p];
    const int j1 = s_j1[p];
    if (j0 > j1) continue;  // warp-uniform
    const bool seen = lane >= j0 && lane <= j1;
    const float sc = sP[p * kChunk + lane];
    const float m = warp_max(seen ? sc : -INFINITY);
    const float e = seen ? expf(sc - m) : 0.0f;
    const float l = warp_sum(e);
    sP[p * kChunk + lane] = e;
    if (lane == 0) {
      part_ml[2 * s_entry[p]] = m;
      part_ml[2 * s_entry[p] + 1] = l;
    }
  }
  __pipeline_wait_prior(0);  // V rows
  __syncthreads();
  if (tp == 1) {
    chunk_values<1>(sV, sP, s_j0, s_j1, s_entry, np, u0, u1, part_acc, g);
  } else if (tp == 2) {
    chunk_values<2>(sV, sP, s_j0, s_j1, s_entry, np, u0, u1, part_acc, g);
  } else {
    chunk_values<4>(sV, sP, s_j0, s_j1, s_entry, np, u0, u1, part_acc, g);
  }
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
  for (int c = lane; c < n; c += 32) m_part = fmaxf(m_part, ml[2 * c]);
  const float m = warp_max(m_part);
  float l_part = 0.0f;
  for (int c = lane; c < n; c += 32) l_part = fmaf(ml[2 * c + 1], expf(ml[2 * c] - m), l_part);
  const float l = warp_sum(l_part);

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
    for (int i = 0; i < NR; ++i) x[i] = a[min(lane + 32 * i, g.d - 1)];
  };
  constexpr int kAhead = 4;
  int c = warp;
  for (; c + (kAhead - 1) * kCombineWarps < n; c += kAhead * kCombineWarps) {
    float x[kAhead][NR];
    float w[kAhead];
#pragma unroll
    for (int u = 0; u < kAhead; ++u) {
      w[u] = ml[2 * (c + u * kCombineWarps)];
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
    const float w = expf(ml[2 * c] - m);
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

}  // namespace

// q f32 [S, H, D], k/v f32 [T, Hkv, D], out f32 [S, H, D], q_positions i32 [S]
// (all on this device); H a multiple of Hkv, D <= 512. See AttentionParams.
void CudaBackend::attention(const AttentionParams& p) {
  OpTimer timer(*this, "attention");
  constexpr const char* kOp = "attention";
  check_on(*this, kOp, "q", p.q);
  check_on(*this, kOp, "k", p.k);
  check_on(*this, kOp, "v", p.v);
  check_on(*this, kOp, "out", p.out);
  check_on(*this, kOp, "q_positions", p.q_positions);
  const ops::AttentionDims dims = ops::check_attention(p);
  const int64_t s_len = dims.queries;
  const int64_t n_heads = dims.heads;
  const int64_t d = dims.head_dim;
  const bool ring = dims.ring;
  const int64_t t_len = dims.keys;
  const int64_t n_kv = dims.kv_heads;
  if (d > kMaxHeadDim) {
    fail("attention: head dimension {} of q {} exceeds the {} the CUDA kernels support", d,
         p.q.describe(), kMaxHeadDim);
  }
  if (n_heads > 65535) {
    fail("attention: q {} / k {} have more heads than the CUDA kernels support", p.q.describe(),
         p.k.describe());
  }
  if (p.out.numel() == 0) return;
  if (p.allow_fast_prefill && !ring && s_len >= kFastPrefillQueries && t_len > 0) {
    attention_prefill_gemm(*this, p);
    return;
  }

  AttnGeom g{};
  g.n_heads = static_cast<int>(n_heads);
  g.n_kv = static_cast<int>(n_kv);
  g.group = static_cast<int>(n_heads / n_kv);
  g.d = static_cast<int>(d);
  g.ld = smem_row_floats(g.d);
  g.t = t_len;
  g.k_pos0 = p.k_pos0;
  g.ring = ring ? p.k.dim(0) : 0;
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
  int64_t n_slots = n_chunks;
  if (p.causal && p.window > 0) {
    n_slots = std::min<int64_t>(n_slots, (p.window + kChunk - 2) / kChunk + 1);
  }
  g.n_slots = static_cast<int>(n_slots);
  // Derived sliding launches: the hull of a tile of s consecutive queries spans
  // at most window + s - 1 positions.
  auto derived_grid = [&](int64_t s) {
    if (!g.derive || p.window <= 0) return n_chunks;
    return std::min<int64_t>(n_chunks, (p.window + s - 1 + kChunk - 2) / kChunk + 1);
  };

  // Tile the queries so one tile's partials fit the scratch; tiles are
  // independent (a query's result does not depend on its tile).
  const size_t per_query = static_cast<size_t>(n_heads) * static_cast<size_t>(n_slots) *
                           static_cast<size_t>(d + 2) * sizeof(float);
  int64_t tile = s_len;
  void* base = nullptr;
  if (per_query > 0) {
    const size_t bytes = std::max(kPartialsBudget, per_query);
    base = scratch(attn_partials_, bytes);
    tile = std::min<int64_t>(s_len, static_cast<int64_t>(bytes / per_query));
  }
  // Grid z of the partials kernel is at most 65535 pair tiles; the combine grid
  // (x = tile · H blocks) at most INT_MAX.
  tile = std::min<int64_t>(tile, int64_t{65535} * kPairTile / g.group);
  tile = std::min<int64_t>(tile, int64_t{INT_MAX} / n_heads);
  tile = std::max<int64_t>(tile, 1);
  // acc [tile·H·slots][D] first (16-byte aligned rows when D % 4 == 0), then
  // the (m, l) pairs.
  auto* part_acc = static_cast<float*>(base);
  float* part_ml = part_acc == nullptr ? nullptr : part_acc + tile * n_heads * n_slots * d;
  if (n_chunks > 0) allow_partials_smem(device_index());

  const int nr = static_cast<int>((d + 31) / 32);
  const auto* q = p.q.data_as<const float>();
  const auto* k = p.k.data_as<const float>();
  const auto* v = p.v.data_as<const float>();
  const auto* pos = p.q_positions.data_as<const int32_t>();
  auto* out = p.out.data_as<float>();
  for (int64_t s0 = 0; s0 < s_len; s0 += tile) {
    g.s = static_cast<int>(std::min(tile, s_len - s0));
    g.pair_tile = static_cast<int>(std::min<int64_t>(kPairTile, int64_t{g.s} * g.group));
    // Decode and verify windows (one pair tile): their keys are nearly all
    // visible, so staging a chunk's rows before knowing the ranges wastes little.
    g.eager = int64_t{g.s} * g.group <= kPairTile;
    g.release_next = p.product_follows && s0 + tile >= s_len;
    const int64_t offset = s0 * n_heads * d;
    if (n_chunks > 0) {
      launch_partials(q + offset, k, v, pos + s0, part_ml, part_acc, g, derived_grid(g.s),
                      stream());
    }
    dispatch_combine(nr, std::make_integer_sequence<int, kMaxLaneDims>{}, pos + s0, part_ml,
                     part_acc, out + offset, g, /*after_partials=*/n_chunks > 0, stream());
  }
}

}  // namespace specula::cuda
