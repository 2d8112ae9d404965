// SPDX-License-Identifier: Apache-2.0
// attention on the GPU (gemma4-architecture.md §2.5-§2.6): causal, optionally
// sliding-window, grouped-query attention, split across the key sequence.
//
// Batch invariance. A query's output depends only on its own q row, the keys
// it can see and their absolute positions, never on S, on the other queries,
// on k_pos0 or on how far the key tensor extends past what the query sees.
// That is what lets a decode step (1 query, keys gathered from the window
// start) and a verify window (k + 1 queries over a longer key tensor) agree bit
// for bit. It holds because every reduction is pinned to absolute positions:
// - keys are split into chunks of kChunk absolute positions ([c·kChunk,
//   (c+1)·kChunk)); a chunk's partial (running max m, sum of exponentials l,
//   unnormalised weighted V sum) covers only the visible keys of that chunk,
//   visited in increasing position, softmax-rescaled once per aligned block of
//   32 positions;
// - chunks are merged in increasing chunk order, and only chunks that hold a
//   visible key take part, so a fully masked chunk is never an operand;
// - each dot product sums a lane's dims in order, then a fixed xor-shuffle
//   tree (which leaves the same value in every lane); exp is expf, no atomics;
//   products are explicit fmaf / __fmul_rn so no FMA contraction can differ.
// No kernel code path depends on S or T (template parameter: the head dim only).
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <utility>

#include "engine/backend/cuda/cuda_backend.h"

namespace specula::cuda {
namespace {

// Keys per chunk (absolute positions). Part of the numerics: changing it
// changes results (still within tolerance), never their batch invariance.
constexpr int64_t kChunk = 32;  // small chunks: decode parallelism comes from the key axis
// Keys per softmax rescale block, aligned to absolute multiples of 32.
constexpr int kSubBlock = 32;
static_assert(kChunk % kSubBlock == 0, "chunks must be made of whole 32-key blocks");
// The largest head dimension (dims per lane = kMaxLaneDims).
constexpr int kMaxHeadDim = 512;
constexpr int kMaxLaneDims = kMaxHeadDim / 32;
// Warps (one (query, head) pair each) per block of the partials kernel.
constexpr int kPartialWarps = 8;
// Warps per block of the combine kernel.
constexpr int kCombineWarps = 4;
// Partials kept at once: the scratch is requested at this size on every call
// (so it is allocated once, not regrown as T grows in steady-state decode);
// queries are processed in tiles that fit it.
constexpr size_t kPartialsBudget = size_t{256} << 20;
constexpr unsigned kFullMask = 0xffffffffu;

// Geometry shared by both kernels (by value).
struct AttnGeom {
  int s;        // queries in this launch (a tile of the call's S)
  int n_heads;  // query heads
  int n_kv;     // kv heads
  int group;    // n_heads / n_kv
  int d;        // head dimension
  int n_slots;  // partial slots per (query, head): most chunks a query can see
  int64_t t;    // keys
  int64_t k_pos0;
  int64_t ring;  // > 0: k/v are rings of `ring` rows (position kp at row kp % ring)
  int window;
  bool causal;
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
__device__ inline KeyRange visible_keys(int64_t qp, const AttnGeom& g) {
  KeyRange r{g.k_pos0, g.k_pos0 + g.t - 1};
  if (g.causal) r.hi = min(r.hi, qp);
  if (g.window > 0) r.lo = max(r.lo, qp - g.window + 1);
  return r;
}

// Fixed xor-butterfly reductions: each step adds the same two values in every
// lane (addition commutes), so all lanes end with one identical result.
__device__ inline float warp_sum(float x) {
#pragma unroll
  for (int off = 16; off > 0; off >>= 1) x += __shfl_xor_sync(kFullMask, x, off);
  return x;
}
__device__ inline float warp_max(float x) {
#pragma unroll
  for (int off = 16; off > 0; off >>= 1) x = fmaxf(x, __shfl_xor_sync(kFullMask, x, off));
  return x;
}

// Partials: one warp per (query, head, chunk slot); a block holds up to
// kPartialWarps (query, head) pairs of one kv head, so the heads of a query
// read the same K/V rows together (served once from L1/L2).
// Grid: x = chunk slot (chunk = first chunk the query sees + slot), y = kv
// head, z = groups of kPartialWarps pairs (pair = query · group + head in group).
// Lane `lane` owns dims lane, lane + 32, ... (coalesced row reads).
// Writes, for a chunk holding a visible key, ml = (m, l) and acc[D]; chunks
// with no visible key are left unwritten (the combine never reads them).
template <int NR>
__global__ void __launch_bounds__(kPartialWarps * 32)
    attention_partials_kernel(const float* __restrict__ q, const float* __restrict__ k,
                              const float* __restrict__ v, const int32_t* __restrict__ q_pos,
                              float* __restrict__ part_ml, float* __restrict__ part_acc,
                              AttnGeom g) {
  const int lane = static_cast<int>(threadIdx.x) & 31;
  const int64_t pair = static_cast<int64_t>(blockIdx.z) * (blockDim.x / 32) + threadIdx.x / 32;
  const int64_t qi = pair / g.group;
  if (qi >= g.s) return;  // whole warp: no block-level sync in this kernel
  const int kvh = static_cast<int>(blockIdx.y);
  const int h = kvh * g.group + static_cast<int>(pair % g.group);
  const int slot = static_cast<int>(blockIdx.x);

  const KeyRange r = visible_keys(q_pos[qi], g);
  if (r.lo > r.hi) return;
  const int64_t chunk0 = floor_div(r.lo, kChunk) + slot;
  const int64_t a = max(r.lo, chunk0 * kChunk);
  const int64_t b = min(r.hi, chunk0 * kChunk + kChunk - 1);
  if (a > b) return;  // this query sees fewer chunks than there are slots

  const int64_t row = qi * g.n_heads + h;
  const float* qr = q + row * g.d;
  float qv[NR];
#pragma unroll
  for (int i = 0; i < NR; ++i) {
    const int dim = lane + 32 * i;
    qv[i] = dim < g.d ? __ldg(qr + dim) : 0.0f;
  }
  float acc[NR];
#pragma unroll
  for (int i = 0; i < NR; ++i) acc[i] = 0.0f;
  float m = -INFINITY;
  float l = 0.0f;
  const int64_t kv_stride = static_cast<int64_t>(g.n_kv) * g.d;  // floats per key
  const float* k_head = k + static_cast<int64_t>(kvh) * g.d;
  const float* v_head = v + static_cast<int64_t>(kvh) * g.d;

  // Aligned blocks of 32 absolute positions; [j0, j1] = visible part of each.
  for (int64_t base = floor_div(a, kSubBlock) * kSubBlock; base <= b; base += kSubBlock) {
    const int j0 = static_cast<int>(max(a, base) - base);
    const int j1 = static_cast<int>(min(b, base + kSubBlock - 1) - base);
    // Row of absolute position kp: kp - k_pos0, or kp % ring for ring caches.
    auto key_row = [&](int64_t kp) { return g.ring > 0 ? kp % g.ring : kp - g.k_pos0; };
    // Scores: lane j keeps the score of key base + j (-inf where not visible).
    float my_s = -INFINITY;
    for (int j = j0; j <= j1; j += 4) {
      float dot[4];
#pragma unroll
      for (int u = 0; u < 4; ++u) {
        dot[u] = 0.0f;
        if (j + u <= j1) {
          const float* kr = k_head + key_row(base + j + u) * kv_stride;
#pragma unroll
          for (int i = 0; i < NR; ++i) {
            const int dim = lane + 32 * i;
            if (dim < g.d) dot[u] = fmaf(qv[i], __ldg(kr + dim), dot[u]);
          }
        }
      }
#pragma unroll
      for (int u = 0; u < 4; ++u) {
        const float sc = __fmul_rn(g.scale, warp_sum(dot[u]));
        if (lane == j + u && j + u <= j1) my_s = sc;
      }
    }
    // One rescale per block: m_new covers every visible score of the block.
    const float m_new = fmaxf(m, warp_max(my_s));
    const float corr = expf(m - m_new);  // 0 on the first block (m = -inf)
    const float p = (lane >= j0 && lane <= j1) ? expf(my_s - m_new) : 0.0f;
    l = fmaf(l, corr, warp_sum(p));
#pragma unroll
    for (int i = 0; i < NR; ++i) acc[i] = __fmul_rn(acc[i], corr);
#pragma unroll 4
    for (int j = j0; j <= j1; ++j) {
      const float pj = __shfl_sync(kFullMask, p, j);
      const float* vr = v_head + key_row(base + j) * kv_stride;
#pragma unroll
      for (int i = 0; i < NR; ++i) {
        const int dim = lane + 32 * i;
        if (dim < g.d) acc[i] = fmaf(pj, __ldg(vr + dim), acc[i]);
      }
    }
    m = m_new;
  }

  const int64_t entry = row * g.n_slots + slot;
  if (lane == 0) {
    part_ml[2 * entry] = m;
    part_ml[2 * entry + 1] = l;
  }
  float* out_acc = part_acc + entry * g.d;
#pragma unroll
  for (int i = 0; i < NR; ++i) {
    const int dim = lane + 32 * i;
    if (dim < g.d) out_acc[dim] = acc[i];
  }
}

// Combine: one warp per (query, head); merges the partials of the chunks the
// query sees in increasing chunk order and writes out = acc / l, or a zero row
// when the query sees no key. Grid: x = groups of kCombineWarps (query, head) pairs.
template <int NR>
__global__ void __launch_bounds__(kCombineWarps * 32)
    attention_combine_kernel(const int32_t* __restrict__ q_pos, const float* __restrict__ part_ml,
                             const float* __restrict__ part_acc, float* __restrict__ out,
                             AttnGeom g) {
  const int lane = static_cast<int>(threadIdx.x) & 31;
  const int64_t row =
      static_cast<int64_t>(blockIdx.x) * (blockDim.x / 32) + threadIdx.x / 32;  // qi·H + h
  if (row >= static_cast<int64_t>(g.s) * g.n_heads) return;
  float* o = out + row * g.d;
  const KeyRange r = visible_keys(q_pos[row / g.n_heads], g);
  if (r.lo > r.hi) {
#pragma unroll
    for (int i = 0; i < NR; ++i) {
      const int dim = lane + 32 * i;
      if (dim < g.d) o[dim] = 0.0f;  // nothing visible: zeros, not 0/0
    }
    return;
  }
  const int64_t c_lo = floor_div(r.lo, kChunk);
  const int n_chunks =
      static_cast<int>(min(floor_div(r.hi, kChunk) - c_lo + 1, static_cast<int64_t>(g.n_slots)));
  const float* ml = part_ml + 2 * row * g.n_slots;
  const float* pa = part_acc + row * g.n_slots * g.d;

  float m = ml[0];
  float l = ml[1];
  float acc[NR];
#pragma unroll
  for (int i = 0; i < NR; ++i) {
    const int dim = lane + 32 * i;
    acc[i] = dim < g.d ? pa[dim] : 0.0f;
  }
  for (int c = 1; c < n_chunks; ++c) {
    const float mc = ml[2 * c];
    const float lc = ml[2 * c + 1];
    const float m_new = fmaxf(m, mc);
    const float fa = expf(m - m_new);
    const float fb = expf(mc - m_new);
    l = fmaf(l, fa, __fmul_rn(lc, fb));
    const float* ac = pa + static_cast<int64_t>(c) * g.d;
#pragma unroll
    for (int i = 0; i < NR; ++i) {
      const int dim = lane + 32 * i;
      if (dim < g.d) acc[i] = fmaf(acc[i], fa, __fmul_rn(ac[dim], fb));
    }
    m = m_new;
  }
#pragma unroll
  for (int i = 0; i < NR; ++i) {
    const int dim = lane + 32 * i;
    if (dim < g.d) o[dim] = acc[i] / l;
  }
}

// Launches both kernels for one tile of queries (partials only when there are keys).
template <int NR>
void launch_attention(const float* q, const float* k, const float* v, const int32_t* q_pos,
                      float* part_ml, float* part_acc, float* out, const AttnGeom& g,
                      cudaStream_t stream) {
  if (g.n_slots > 0) {
    const int64_t pairs = static_cast<int64_t>(g.s) * g.group;
    const int warps = static_cast<int>(std::min<int64_t>(pairs, kPartialWarps));
    const dim3 grid(static_cast<unsigned>(g.n_slots), static_cast<unsigned>(g.n_kv),
                    static_cast<unsigned>((pairs + warps - 1) / warps));
    attention_partials_kernel<NR>
        <<<grid, warps * 32, 0, stream>>>(q, k, v, q_pos, part_ml, part_acc, g);
    check_cuda(cudaGetLastError(), "attention_partials_kernel");
  }
  const int64_t rows = static_cast<int64_t>(g.s) * g.n_heads;
  attention_combine_kernel<NR><<<blocks_for(rows, kCombineWarps), kCombineWarps * 32, 0, stream>>>(
      q_pos, part_ml, part_acc, out, g);
  check_cuda(cudaGetLastError(), "attention_combine_kernel");
}

template <int... NRs>
void dispatch_lane_dims(int nr, std::integer_sequence<int, NRs...>, const float* q, const float* k,
                        const float* v, const int32_t* q_pos, float* part_ml, float* part_acc,
                        float* out, const AttnGeom& g, cudaStream_t stream) {
  // Exactly one NR + 1 matches (nr is in [1, kMaxLaneDims], checked by the caller).
  ((nr == NRs + 1 ? launch_attention<NRs + 1>(q, k, v, q_pos, part_ml, part_acc, out, g, stream)
                  : void()),
   ...);
}

bool ranges_overlap(const Tensor& a, const Tensor& b) {
  if (a.nbytes() == 0 || b.nbytes() == 0) return false;
  const auto* a0 = static_cast<const char*>(a.data());
  const auto* b0 = static_cast<const char*>(b.data());
  return a0 < b0 + b.nbytes() && b0 < a0 + a.nbytes();
}

void check_no_alias(const char* op, const char* out_name, const Tensor& out, const char* in_name,
                    const Tensor& in) {
  if (ranges_overlap(out, in)) {
    fail("{}: output {} {} overlaps input {} {}; this op needs a separate output buffer", op,
         out_name, out.describe(), in_name, in.describe());
  }
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
  check_dtype(kOp, "q", p.q, DType::kF32);
  check_dtype(kOp, "k", p.k, DType::kF32);
  check_dtype(kOp, "v", p.v, DType::kF32);
  check_dtype(kOp, "out", p.out, DType::kF32);
  check_dtype(kOp, "q_positions", p.q_positions, DType::kI32);
  check_rank(kOp, "q", p.q, 3);
  check_rank(kOp, "k", p.k, 3);
  check_same_shape(kOp, "k", p.k, "v", p.v);
  check_same_shape(kOp, "q", p.q, "out", p.out);
  const int64_t s_len = p.q.dim(0);
  const int64_t n_heads = p.q.dim(1);
  const int64_t d = p.q.dim(2);
  const bool ring = p.ring_keys >= 0;
  if (ring && (p.ring_keys > p.k.dim(0) || p.k_pos0 < 0)) {
    fail("attention: ring_keys {} at k_pos0 {} do not fit the ring k {}", p.ring_keys, p.k_pos0,
         p.k.describe());
  }
  const int64_t t_len = ring ? p.ring_keys : p.k.dim(0);
  const int64_t n_kv = p.k.dim(1);
  if (p.k.dim(2) != d) {
    fail("attention: q {} and k {} disagree on the head dimension ({} vs {})", p.q.describe(),
         p.k.describe(), d, p.k.dim(2));
  }
  if (n_kv == 0 || n_heads % n_kv != 0) {
    fail("attention: q {} has {} heads, which is not a multiple of the {} kv heads of k {}",
         p.q.describe(), n_heads, n_kv, p.k.describe());
  }
  if (p.q_positions.shape() != Shape({s_len})) {
    fail("attention: q_positions {} must be i32[{}] for q {}", p.q_positions.describe(), s_len,
         p.q.describe());
  }
  if (p.window < 0) fail("attention: window must be >= 0 (0 = no window), got {}", p.window);
  check_no_alias(kOp, "out", p.out, "q", p.q);
  check_no_alias(kOp, "out", p.out, "k", p.k);
  check_no_alias(kOp, "out", p.out, "v", p.v);
  check_no_alias(kOp, "out", p.out, "q_positions", p.q_positions);
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
  g.t = t_len;
  g.k_pos0 = p.k_pos0;
  g.ring = ring ? p.k.dim(0) : 0;
  g.window = p.window;
  g.causal = p.causal;
  g.scale = p.scale;
  // Slots per (query, head): the chunks a visible range can touch, bounded by
  // the chunks the key tensor touches and, for a causal window, by the window
  // length (a range of w positions touches at most (w + kChunk - 2) / kChunk + 1
  // chunks; without causality a window bounds only the start of the range).
  int64_t n_slots = 0;
  if (t_len > 0) {
    n_slots = floor_div(p.k_pos0 + t_len - 1, kChunk) - floor_div(p.k_pos0, kChunk) + 1;
    if (p.causal && p.window > 0) {
      n_slots = std::min<int64_t>(n_slots, (p.window + kChunk - 2) / kChunk + 1);
    }
  }
  g.n_slots = static_cast<int>(n_slots);

  // Tile the queries so one tile's partials fit the scratch; tiles are
  // independent (a query's result does not depend on its tile).
  const size_t per_query = static_cast<size_t>(n_heads) * static_cast<size_t>(n_slots) *
                           static_cast<size_t>(d + 2) * sizeof(float);
  int64_t tile = s_len;
  float* part_ml = nullptr;
  float* part_acc = nullptr;
  if (per_query > 0) {
    const size_t bytes = std::max(kPartialsBudget, per_query);
    void* base = scratch(attn_partials_, bytes);
    tile = std::min<int64_t>(s_len, static_cast<int64_t>(bytes / per_query));
    part_ml = static_cast<float*>(base);
    // acc after the (m, l) pairs of a full tile; 2·tile·H·slots floats keep it 8-byte aligned.
    part_acc = part_ml + 2 * tile * n_heads * n_slots;
  }
  // Grid z of the partials kernel is at most 65535 blocks of kPartialWarps pairs.
  tile = std::min<int64_t>(tile, int64_t{65535} * kPartialWarps / g.group);
  tile = std::max<int64_t>(tile, 1);

  const int nr = static_cast<int>((d + 31) / 32);
  const auto* q = p.q.data_as<const float>();
  const auto* k = p.k.data_as<const float>();
  const auto* v = p.v.data_as<const float>();
  const auto* pos = p.q_positions.data_as<const int32_t>();
  auto* out = p.out.data_as<float>();
  for (int64_t s0 = 0; s0 < s_len; s0 += tile) {
    g.s = static_cast<int>(std::min(tile, s_len - s0));
    const int64_t offset = s0 * n_heads * d;
    dispatch_lane_dims(nr, std::make_integer_sequence<int, kMaxLaneDims>{}, q + offset, k, v,
                       pos + s0, part_ml, part_acc, out + offset, g, stream());
  }
}

}  // namespace specula::cuda
