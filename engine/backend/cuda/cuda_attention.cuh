// SPDX-License-Identifier: Apache-2.0
// Internal to the CUDA attention files (cuda_attention.cu: partials, combine
// and CudaBackend::attention; cuda_attention_decode.cu: the fused decode /
// verify kernel and attention_with_inputs): the constants, geometry and device
// building blocks both use. The numerics are documented in cuda_attention.cu.
#pragma once

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

namespace specula::cuda::attn {

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
  // Partials of a batch (attention_batch): pair tiles per sequence (grid z =
  // sequence · seq_tiles + tile); unused by single-sequence launches.
  int seq_tiles;
};

// Sequences one batched partials launch serves (the size of its by-value
// table of caches: 2 KB of kernel parameters for 64).
constexpr int kBatchSeqs = 64;

// The caches the partials kernel reads: sequence i's keys and values (and,
// for an fp8 cache, their scales; null otherwise). One entry for a
// single-sequence launch, kBatchSeqs for a batch.
template <typename KvT, int kSeqs>
struct KvSources {
  const KvT* k[kSeqs];
  const KvT* v[kSeqs];
  const float* k_scales[kSeqs];
  const float* v_scales[kSeqs];
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

// stage_row for a bf16 cache row: the same shared f32 row (each element
// widened exactly, zero padding), written by plain stores instead of cp.async
// (a copy cannot widen), so it is visible after the block's next barrier like
// the copies are. Coherent loads (load_act): the cache is written by earlier
// kernels (cuda_launch.cuh). With g.vec4 (d % 4 == 0, 16-byte aligned base)
// each lane loads 4 elements (8 bytes) at a time.
__device__ inline void stage_row(float* dst, const uint16_t* src, const AttnGeom& g, int lane) {
  if (g.vec4) {
    const auto* src2 = reinterpret_cast<const uint2*>(src);
    for (int i = lane; i < g.d / 4; i += 32) {
      const uint2 b = load_act(src2 + i);
      reinterpret_cast<float4*>(dst)[i] =
          make_float4(bf16_bits_to_f32(b.x & 0xffffu), bf16_bits_to_f32(b.x >> 16),
                      bf16_bits_to_f32(b.y & 0xffffu), bf16_bits_to_f32(b.y >> 16));
    }
  } else {
    const auto* src16 = reinterpret_cast<const unsigned short*>(src);
    for (int i = lane; i < g.d; i += 32) dst[i] = bf16_bits_to_f32(load_act(src16 + i));
    for (int i = g.d + lane; i < (g.d + 3) / 4 * 4; i += 32) dst[i] = 0.0f;
  }
}

// stage_row for an fp8 cache row: each element dequantized as the CPU does
// (e4m3 value · the row's scale, one f32 product), plain stores like the bf16
// row's, zero padding. Coherent loads: the cache is written by earlier kernels.
__device__ inline void stage_row_fp8(float* dst, const uint8_t* src, float scale, const AttnGeom& g,
                                     int lane) {
  for (int i = lane; i < g.d; i += 32) dst[i] = e4m3_dequant(load_act(src + i), scale);
  for (int i = g.d + lane; i < (g.d + 3) / 4 * 4; i += 32) dst[i] = 0.0f;
}

// Stages key or value row `row` of kv head `kvh` (head_row: the row's first
// element of that head): stage_row for f32 and bf16 caches, stage_row_fp8 with
// scale scales[row · n_kv + kvh] for an fp8 cache (KvT uint8_t).
template <typename KvT>
__device__ inline void stage_kv_row(float* dst, const KvT* head_row, const float* scales,
                                    int64_t row, int kvh, const AttnGeom& g, int lane) {
  if constexpr (std::is_same_v<KvT, uint8_t>) {
    stage_row_fp8(dst, head_row, load_act(scales + row * g.n_kv + kvh), g, lane);
  } else {
    stage_row(dst, head_row, g, lane);
  }
}

// Rows of a chunk one warp stages (rows j ≡ warp mod kPartialWarps).
constexpr int kWarpRows = kChunk / kPartialWarps;
static_assert(kWarpRows * kPartialWarps == kChunk,
              "a chunk's rows are split evenly over the warps");

// One cache row of a kv head: its first element and its row in the cache.
template <typename KvT>
struct KvRowRef {
  const KvT* head_row;
  int64_t row;
};

// Rows whose loads a lane holds at once in stage_kv_rows (of 256 elements;
// half as many longer rows): 8 registers of bf16, few enough that the partials
// and fused kernels (80 registers) do not spill.
constexpr int kGroupRows = 2;

// Part of stage_kv_rows: rows j_first + i · kPartialWarps (i < kGroupRows /
// kRounds, <= j_last) of d <= 256 · kRounds elements each, every load issued
// before any row is widened and stored.
template <typename KvT, int kRounds, typename SrcOf>
__device__ inline void stage_kv_row_group(float* dst, int j_first, int j_last, SrcOf src_of,
                                          const float* scales, int kvh, const AttnGeom& g,
                                          int lane) {
  constexpr bool kFp8 = std::is_same_v<KvT, uint8_t>;
  constexpr int kRows = kGroupRows / kRounds;
  using Vec = std::conditional_t<kFp8, uint2, uint4>;  // 8 elements
  Vec buf[kRows][kRounds];
  float scale[kRows];
#pragma unroll
  for (int i = 0; i < kRows; ++i) {
    const int j = j_first + i * kPartialWarps;
    scale[i] = 1.0f;
    if (j > j_last) continue;
    const auto [head_row, row] = src_of(j);
#pragma unroll
    for (int u = 0; u < kRounds; ++u) {
      const int e = (32 * u + lane) * 8;
      if (e < g.d) buf[i][u] = load_act(reinterpret_cast<const Vec*>(head_row + e));
    }
    if constexpr (kFp8) scale[i] = load_act(scales + row * g.n_kv + kvh);
  }
#pragma unroll
  for (int i = 0; i < kRows; ++i) {
    const int j = j_first + i * kPartialWarps;
    if (j > j_last) continue;
#pragma unroll
    for (int u = 0; u < kRounds; ++u) {
      const int e = (32 * u + lane) * 8;
      if (e >= g.d) continue;
      float v[8];
      if constexpr (kFp8) {
        const uint2 b = buf[i][u];
#pragma unroll
        for (int t = 0; t < 4; ++t) {
          v[t] = e4m3_dequant((b.x >> (8 * t)) & 0xffu, scale[i]);
          v[4 + t] = e4m3_dequant((b.y >> (8 * t)) & 0xffu, scale[i]);
        }
      } else {
        const uint4 b = buf[i][u];
        const uint32_t w[4] = {b.x, b.y, b.z, b.w};
#pragma unroll
        for (int t = 0; t < 4; ++t) {
          v[2 * t] = bf16_bits_to_f32(w[t] & 0xffffu);
          v[2 * t + 1] = bf16_bits_to_f32(w[t] >> 16);
        }
      }
      float4* out = reinterpret_cast<float4*>(dst + j * g.ld + e);
      out[0] = make_float4(v[0], v[1], v[2], v[3]);
      out[1] = make_float4(v[4], v[5], v[6], v[7]);
    }
  }
}

// Stages rows j = j_first, j_first + kPartialWarps, ... <= j_last (at most
// kWarpRows of them, j_last - j_first < kChunk) of one cache, K or V, into
// dst + j · g.ld: the f32 values stage_kv_row writes, row by row. src_of(j)
// gives the row's KvRowRef.
//
// Why not stage_kv_row in a loop: a bf16 or fp8 row is widened through
// registers, and a warp loading one row, storing it and only then loading the
// next waited a full memory latency per row (31B at batch 64 on an H200: the
// partials kernel read its bf16 cache at 0.87 TB/s). Here every row's loads
// (8 elements a lane: 16 bytes of bf16, 8 of fp8 codes) are issued before any
// is widened. Needs d % 8 == 0 and 16-byte aligned caches (g.vec4); else,
// and for f32 caches (cp.async, already asynchronous), stage_kv_row per row.
template <typename KvT, typename SrcOf>
__device__ inline void stage_kv_rows(float* dst, int j_first, int j_last, SrcOf src_of,
                                     const float* scales, int kvh, const AttnGeom& g, int lane) {
  const auto row_by_row = [&] {
    for (int j = j_first; j <= j_last; j += kPartialWarps) {
      const auto [head_row, row] = src_of(j);
      stage_kv_row(dst + j * g.ld, head_row, scales, row, kvh, g, lane);
    }
  };
  if constexpr (std::is_same_v<KvT, float>) {
    row_by_row();
  } else if (!g.vec4 || g.d % 8 != 0) {
    row_by_row();
  } else if (g.d <= 256) {
    for (int i = 0; i < kWarpRows; i += kGroupRows) {
      stage_kv_row_group<KvT, 1>(dst, j_first + i * kPartialWarps, j_last, src_of, scales, kvh, g,
                                 lane);
    }
  } else {
    for (int i = 0; i < kWarpRows; i += kGroupRows / 2) {
      stage_kv_row_group<KvT, 2>(dst, j_first + i * kPartialWarps, j_last, src_of, scales, kvh, g,
                                 lane);
    }
  }
}

// Staged key / value rows as the chunk loops read them. Row j starts at
// base + j · ld (floats) in every layout, so the shared-memory plan is the same.
//   F32Rows:  f32 rows, widened (or copied) when staged.
//   Bf16Rows: a bf16 cache's own bytes, copied by cp.async
//             (CudaKernelChoices::raw_kv_staging), widened here as they are
//             read: the same f32 values, so the same sums and bits.
// quad(j, i): dims 4i .. 4i + 3 of row j. load(j, i) / unpack(load, e): the
// kQuadsPerLoad quads from dims 4i on (i a multiple of kQuadsPerLoad) from
// one shared-memory load, quad e at a time. Bf16Rows reads 16 bytes (8 dims) at a time there
// because 8 lanes reading keys j .. j + 7 then hit distinct banks (ld ≡ 4 mod 32 words); 8-byte
// reads of those rows would conflict two ways.
struct F32Rows {
  static constexpr int kQuadsPerLoad = 1;
  const float* base;
  int ld;
  __device__ __forceinline__ float4 quad(int j, int i) const {
    return reinterpret_cast<const float4*>(base + j * ld)[i];
  }
  // One shared-memory load of kQuadsPerLoad quads from dims 4i (i a multiple
  // of kQuadsPerLoad), and quad e of it: widened one at a time, so a register
  // tile holds the loaded bytes and one quad, not every quad of the load.
  using Load = float4;
  __device__ __forceinline__ Load load(int j, int i) const { return quad(j, i); }
  __device__ __forceinline__ float4 unpack(const Load& l, int) const { return l; }
};

struct Bf16Rows {
  static constexpr int kQuadsPerLoad = 2;
  const float* base;  // row j's bf16 elements from base + j · ld
  int ld;
  __device__ __forceinline__ static float4 widen(uint32_t lo, uint32_t hi) {
    return make_float4(bf16_bits_to_f32(lo & 0xffffu), bf16_bits_to_f32(lo >> 16),
                       bf16_bits_to_f32(hi & 0xffffu), bf16_bits_to_f32(hi >> 16));
  }
  __device__ __forceinline__ float4 quad(int j, int i) const {
    const uint2 b = reinterpret_cast<const uint2*>(base + j * ld)[i];
    return widen(b.x, b.y);
  }
  using Load = uint4;
  __device__ __forceinline__ Load load(int j, int i) const {
    return reinterpret_cast<const uint4*>(base + j * ld)[i / 2];
  }
  __device__ __forceinline__ float4 unpack(const Load& l, int e) const {
    return e == 0 ? widen(l.x, l.y) : widen(l.z, l.w);
  }
};

//   Fp8Rows:  an fp8 cache's own codes, row j's scale right after them (at
//             float d / 4 of the row), dequantized here as they are read
//             (e4m3_dequant: the values the f32 staging writes). 16 bytes
//             (16 dims) a load across keys, for the same reason.
struct Fp8Rows {
  static constexpr int kQuadsPerLoad = 4;
  const float* base;  // row j's codes from base + j · ld, its scale at base + j · ld + scale_at
  int ld;
  int scale_at;  // d / 4
  __device__ __forceinline__ static float4 dequant(uint32_t w, float scale) {
    return make_float4(e4m3_dequant(w & 0xffu, scale), e4m3_dequant((w >> 8) & 0xffu, scale),
                       e4m3_dequant((w >> 16) & 0xffu, scale), e4m3_dequant(w >> 24, scale));
  }
  __device__ __forceinline__ float4 quad(int j, int i) const {
    const float* row = base + j * ld;
    return dequant(reinterpret_cast<const uint32_t*>(row)[i], row[scale_at]);
  }
  struct Load {
    uint4 codes;
    float scale;
  };
  __device__ __forceinline__ Load load(int j, int i) const {
    const float* row = base + j * ld;
    return {reinterpret_cast<const uint4*>(row)[i / 4], row[scale_at]};
  }
  __device__ __forceinline__ float4 unpack(const Load& l, int e) const {
    const uint32_t w = e == 0 ? l.codes.x : e == 1 ? l.codes.y : e == 2 ? l.codes.z : l.codes.w;
    return dequant(w, l.scale);
  }
};

// The row reader of a cache dtype's raw staging.
template <typename KvT>
using RawRows = std::conditional_t<std::is_same_v<KvT, uint8_t>, Fp8Rows, Bf16Rows>;

template <typename KvT>
__device__ __forceinline__ RawRows<KvT> raw_rows(const float* base, const AttnGeom& g) {
  if constexpr (std::is_same_v<KvT, uint8_t>) {
    return Fp8Rows{base, g.ld, g.d / 4};
  } else {
    return Bf16Rows{base, g.ld};
  }
}

// Whether raw staging can take rows of head dim d of cache element KvT: whole
// 16-byte loads (bf16: d % 8 == 0; fp8: d % 16 == 0) from 16-byte aligned rows (vec4).
template <typename KvT>
__host__ __device__ constexpr bool raw_staging_fits(int d, bool vec4) {
  return vec4 && d % (16 / static_cast<int>(sizeof(KvT))) == 0;
}

// Copies rows j = j_first, j_first + kPartialWarps, ... <= j_last of a bf16 or
// fp8 cache into dst + j · g.ld as they are (RawRows' layout; an fp8 row's
// scale scales[row · n_kv + kvh] after its codes), 16 bytes a lane per
// cp.async: nothing waits on a load until the pipeline wait, so every row of
// the chunk is in flight at once. src_of(j) gives the row's KvRowRef. Needs
// raw_staging_fits.
template <typename KvT, typename SrcOf>
__device__ inline void stage_raw_rows(float* dst, int j_first, int j_last, SrcOf src_of,
                                      const float* scales, int kvh, const AttnGeom& g, int lane) {
  constexpr int kPerChunk = 16 / static_cast<int>(sizeof(KvT));  // elements a 16-byte copy
  for (int j = j_first; j <= j_last; j += kPartialWarps) {
    const auto [head_row, row] = src_of(j);
    char* d_row = reinterpret_cast<char*>(dst + j * g.ld);
    const char* s_row = reinterpret_cast<const char*>(head_row);
    for (int c = lane; c < g.d / kPerChunk; c += 32)
      __pipeline_memcpy_async(d_row + 16 * c, s_row + 16 * c, 16);
    if constexpr (std::is_same_v<KvT, uint8_t>) {
      if (lane == 0)
        __pipeline_memcpy_async(dst + j * g.ld + g.d / 4, scales + row * g.n_kv + kvh, 4);
    }
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
template <int TP, typename Rows>
__device__ void chunk_scores(Rows keys, const float* sQ, float* sP, int np, const AttnGeom& g) {
  constexpr int kQ = Rows::kQuadsPerLoad;
  const int n4 = (g.d + 3) / 4;  // a multiple of kQ (raw_staging_fits)
  const int tasks = (np + TP - 1) / TP * kChunk;
  for (int task = static_cast<int>(threadIdx.x); task < tasks; task += kPartialThreads) {
    const int p0 = task / kChunk * TP;
    const int j = task % kChunk;
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
    // Quads in increasing i either way: the same fmaf chain per sum.
#pragma unroll((TP == 4 ? 2 : 4) > kQ ? (TP == 4 ? 2 : 4) / kQ : 1)
    for (int i = 0; i < n4; i += kQ) {
      const typename Rows::Load kl = keys.load(j, i);
#pragma unroll
      for (int e = 0; e < kQ; ++e) {
        const float4 kk = keys.unpack(kl, e);
#pragma unroll
        for (int u = 0; u < TP; ++u) {
          const float4 qq = qr[u][i + e];
          s0[u] = fmaf(qq.x, kk.x, s0[u]);
          s1[u] = fmaf(qq.y, kk.y, s1[u]);
          s2[u] = fmaf(qq.z, kk.z, s2[u]);
          s3[u] = fmaf(qq.w, kk.w, s3[u]);
        }
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

// One task of chunk_values (and chunk_values_late): TP pairs from p0 and one
// float4 column of the head dim, held in registers (every index below is a
// compile-time constant once the u loops unroll).
template <int TP>
struct ValueTile {
  int p0;              // first pair of the tile
  int i;               // float4 column: dims 4i .. 4i + 3
  int j0[TP], j1[TP];  // pair p0 + u sees keys j0[u] .. j1[u] (j0 > j1: none)
  float4 acc[TP];      // pair p0 + u's running sums

  // acc[u] += sP[(p0 + u)·kChunk + j] · v_j[4i .. 4i + 3] for the keys j =
  // from .. to in increasing order, each pair only over its own [j0, j1], one
  // fmaf per component: the one definition of both callers' sums.
  template <typename Rows>
  __device__ __forceinline__ void add_keys(Rows values, const float* sP, int from, int to) {
    for (int j = from; j <= to; ++j) {
      const float4 vv = values.quad(j, i);
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
  }
};

// Weighted values of the chunk: for each pair p with a visible key here,
// acc[d] = Σ_{j = j0..j1} sP[p·kChunk + j] · v_j[d] (increasing j, from 0),
// written to its partial slot. Task = (tile of TP pairs, float4 column i of
// the head dim); keys run over the union [u0, u1] of the pairs' ranges and
// each pair skips the keys outside its own [j0, j1] (not a multiply by 0, so
// what a pair cannot see never reaches its sums).
template <int TP, typename Rows>
__device__ void chunk_values(Rows values, const float* sP, const int* s_j0, const int* s_j1,
                             const int64_t* s_entry, int np, int u0, int u1,
                             float* __restrict__ part_acc, const AttnGeom& g) {
  const int n4 = (g.d + 3) / 4;
  const int tasks = (np + TP - 1) / TP * n4;
  for (int task = static_cast<int>(threadIdx.x); task < tasks; task += kPartialThreads) {
    ValueTile<TP> t;
    t.p0 = task / n4 * TP;
    t.i = task % n4;
#pragma unroll
    for (int u = 0; u < TP; ++u) {
      const bool real = t.p0 + u < np;
      t.j0[u] = real ? s_j0[t.p0 + u] : 1;  // j0 > j1: sees nothing
      t.j1[u] = real ? s_j1[t.p0 + u] : 0;
      t.acc[u] = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
    }
    t.add_keys(values, sP, u0, u1);
#pragma unroll
    for (int u = 0; u < TP; ++u) {
      if (t.p0 + u >= np || s_entry[t.p0 + u] < 0) continue;
      float* dst = part_acc + s_entry[t.p0 + u] * g.d + 4 * t.i;
      if (g.vec4) {
        *reinterpret_cast<float4*>(dst) = t.acc[u];
      } else {
        const float a[4] = {t.acc[u].x, t.acc[u].y, t.acc[u].z, t.acc[u].w};
        for (int e = 0; e < 4 && 4 * t.i + e < g.d; ++e) dst[e] = a[e];
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
  ValueTile<TP> t;
  t.p0 = active ? task / n4 * TP : 0;
  t.i = task % n4;
#pragma unroll
  for (int u = 0; u < TP; ++u) {
    const bool real = active && t.p0 + u < np;
    t.j0[u] = real ? s_j0[t.p0 + u] : 1;  // j0 > j1: sees nothing
    t.j1[u] = real ? s_j1[t.p0 + u] : 0;
    t.acc[u] = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
  }
  const F32Rows values{sV, g.ld};
  if (active) t.add_keys(values, sP, u0, min(u1, v_early - 1));
  __pipeline_wait_prior(0);  // this thread's late V rows have landed
  __syncthreads();           // ... and everyone's, and the ones finished in place
  if (!active) return;
  t.add_keys(values, sP, max(u0, v_early), u1);
#pragma unroll
  for (int u = 0; u < TP; ++u) {
    if (t.p0 + u >= np || s_entry[t.p0 + u] < 0) continue;
    *reinterpret_cast<float4*>(part_acc + s_entry[t.p0 + u] * g.d + 4 * t.i) = t.acc[u];
  }
}

// The keys each of the np pairs pair0 .. pair0 + np - 1 (of kv head kvh) sees
// in the chunk at position c0, written by threads 0 .. np - 1: rows s_j0[p] ..
// s_j1[p] of the chunk (j0 > j1: none) and the pair's partial entry (-1: none).
__device__ inline void chunk_pair_ranges(const int32_t* __restrict__ q_pos, int64_t c0, int kvh,
                                         int64_t pair0, int np, const AttnGeom& g, int* s_j0,
                                         int* s_j1, int64_t* s_entry) {
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
__device__ inline int2 chunk_key_hull(const int* s_j0, const int* s_j1, int np) {
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
template <typename Rows, typename AfterScores>
__device__ void chunk_softmax(Rows keys, const float* sQ, float* sP, const int* s_j0,
                              const int* s_j1, const int64_t* s_entry, int np,
                              float* __restrict__ part_ml, const AttnGeom& g,
                              AfterScores&& after_scores) {
  const int lane = static_cast<int>(threadIdx.x) & 31;
  const int warp = static_cast<int>(threadIdx.x) / 32;
  const int tp = pairs_per_tile(np);
  if (tp == 1) {
    chunk_scores<1>(keys, sQ, sP, np, g);
  } else if (tp == 2) {
    chunk_scores<2>(keys, sQ, sP, np, g);
  } else {
    chunk_scores<4>(keys, sQ, sP, np, g);
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
template <typename Rows>
__device__ inline void chunk_weighted_values(Rows values, const float* sP, const int* s_j0,
                                             const int* s_j1, const int64_t* s_entry, int np,
                                             int u0, int u1, float* __restrict__ part_acc,
                                             const AttnGeom& g, int v_early = kChunk) {
  const int tp = pairs_per_tile(np);
  if constexpr (std::is_same_v<Rows, F32Rows>) {
    if (v_early < kChunk) {
      const float* sV = values.base;
      if (tp == 1) {
        chunk_values_late<1>(sV, sP, s_j0, s_j1, s_entry, np, u0, u1, v_early, part_acc, g);
      } else if (tp == 2) {
        chunk_values_late<2>(sV, sP, s_j0, s_j1, s_entry, np, u0, u1, v_early, part_acc, g);
      } else {
        chunk_values_late<4>(sV, sP, s_j0, s_j1, s_entry, np, u0, u1, v_early, part_acc, g);
      }
      return;
    }
  }
  if (tp == 1) {
    chunk_values<1>(values, sP, s_j0, s_j1, s_entry, np, u0, u1, part_acc, g);
  } else if (tp == 2) {
    chunk_values<2>(values, sP, s_j0, s_j1, s_entry, np, u0, u1, part_acc, g);
  } else {
    chunk_values<4>(values, sP, s_j0, s_j1, s_entry, np, u0, u1, part_acc, g);
  }
}

// Static shared memory of the partials kernels (the pair ranges and entries).
constexpr size_t kPartialsStaticSmem = kPairTile * (2 * sizeof(int) + sizeof(int64_t));

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

inline bool aligned16(const void* p) {
  return reinterpret_cast<uintptr_t>(p) % 16 == 0;
}

// The launches of one attention call (past the fast-prefill branch): the
// geometry, the partials grid, the query tile and the partials scratch.
struct AttnPlan {
  AttnGeom g{};
  int64_t n_chunks = 0;        // chunks the key tensor touches (0: no partials kernel)
  int64_t tile = 0;            // queries per launch
  int64_t query_capacity = 0;  // queries whose partials fit the scratch (0: no partials)
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
ops::AttentionDims check_cuda_attention(CudaBackend& be, const AttentionParams& p);
// The geometry, partials grid, query tile and scratch of one attention call.
AttnPlan plan_attention(CudaBackend& be, const AttentionParams& p, const ops::AttentionDims& dims);
// Sets the per-launch fields of g for queries [s0, s0 + s) of an S-query call.
void set_tile(AttnGeom& g, const AttentionParams& p, int64_t s0, int64_t s, int64_t s_len);

}  // namespace specula::cuda::attn
