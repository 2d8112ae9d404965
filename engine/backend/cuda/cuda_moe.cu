// SPDX-License-Identifier: Apache-2.0
// Mixture-of-experts routing and the routed expert FFN on the GPU
// (gemma4-architecture.md §6), matching engine/backend/cpu/cpu_moe.cpp.
//
// moe_experts never reads expert ids on the host. Each pass over at most
// kPassTokens tokens runs four kernels on the stream:
//   1. bucket:   one block groups the pass's (token, slot) pairs by expert and
//                lists the experts in use; per token it also orders the slots
//                by ascending expert id (the CPU's accumulation order).
//   2. gate_up:  per (expert in use, gate/up row pair) a warp streams the two
//                weight rows once for all of that expert's tokens and writes
//                act[slot, c] = gelu_tanh(gate) * up.
//   3. down:     per (expert in use, output row h) a warp writes
//                y[slot, h] = down_e[h, :] · act[slot, :].
//   4. combine:  out[n, h] = Σ_slots (ascending expert id) w[n, slot] * y[slot, h].
// Batch invariance: every dot product is one warp's fixed-order reduction of one
// token's activations (lane l owns the 8-element chunks l, l + 32, ..., each
// chunk summed in order with fmaf, then a butterfly across lanes), whatever
// other tokens share the expert; the combine reads only the token's own slots.
// So a token's output is bit-identical alone or inside any batch.
//
// Prefill (MoeExpertsParams::prefill, more than kGroupedMinTokens tokens, bf16
// weights, H and I multiples of 8): passes of kGroupedPassTokens tokens, whose
// bucket kernel also cuts every expert's slots into tiles of kMoeTileRows; x is
// rounded to bf16 once, and steps 2 and 3 are the grouped tensor-core products
// of cuda_moe_gemm.cu (bf16 activations, so not batch-invariant). The combine
// is the same.
#include <cuda_fp16.h>

#include <algorithm>
#include <climits>
#include <cmath>
#include <cstdint>
#include <limits>
#include <type_traits>

#include "engine/backend/cuda/cuda_backend.h"
#include "engine/backend/cuda/cuda_device_common.cuh"
#include "engine/backend/cuda/cuda_launch.cuh"
#include "engine/backend/cuda/cuda_moe_gemm.h"

namespace specula::cuda {
namespace {

constexpr int kWarps = 8;  // warps per block in the expert kernels (one row each)
constexpr int kTile = 8;   // tokens dotted against one streamed weight row at a time
constexpr int kChunk = 8;  // elements a lane takes per step (one 16-byte bf16|f16 load)
// Rows of down a warp takes at once (their loads in flight together): a row is
// only I = 704 elements at 26B-A4B, under three steps a lane.
constexpr int kDownRows = 2;
// Tokens per pass of moe_experts: bounds the scratch (act and y rows per slot)
// for prefill; decode (N <= 72) is one pass. Results do not depend on it.
constexpr int64_t kPassTokens = 256;
constexpr int kBucketThreads = 1024;
// The bucket kernel keeps two i32 counters per expert in shared memory.
constexpr int64_t kMaxExperts = 4096;
constexpr int64_t kMaxTopK = 4096;
constexpr int kRouteWarps = 4;  // tokens per block in moe_route
// The prefill path: tokens per pass (bounds its scratch: y alone is [tokens ·
// k, H] f32, 369 MB at 26B-A4B's shape), and the fewest tokens that take it
// (below that, experts see too few slots to fill a tile).
constexpr int64_t kGroupedPassTokens = 4096;
constexpr int64_t kGroupedMinTokens = 64;

// ---- Host-side checks (same wording as the CPU backend's). ----

bool aligned16(const void* p) {
  return reinterpret_cast<uintptr_t>(p) % 16 == 0;
}

size_t align_up(size_t bytes) {
  return (bytes + 255) / 256 * 256;
}

// ---- Device helpers. ----

// Address of element i of an f32|bf16|f16 array.
template <DType kDt>
__device__ __forceinline__ const void* elem_ptr(const void* p, int64_t i) {
  constexpr int64_t kSize = kDt == DType::kF32 ? 4 : 2;
  return static_cast<const char*>(p) + i * kSize;
}

// Weights k0 .. k0 + 7 of a row of K elements. kVec: the chunk is whole and
// 16-byte aligned (one or two vector loads); otherwise element loads, with
// zeros past K (never accumulated: see warp_dot).
template <DType kDt, bool kVec>
__device__ __forceinline__ void load_weights(const void* row, int64_t k0, int64_t K,
                                             float (&w)[kChunk]) {
  if constexpr (kVec) {
    if constexpr (kDt == DType::kF32) {
      const auto* p = reinterpret_cast<const float4*>(static_cast<const float*>(row) + k0);
      const float4 a = __ldg(p);
      const float4 b = __ldg(p + 1);
      w[0] = a.x, w[1] = a.y, w[2] = a.z, w[3] = a.w;
      w[4] = b.x, w[5] = b.y, w[6] = b.z, w[7] = b.w;
    } else {
      const uint4 v = __ldg(reinterpret_cast<const uint4*>(static_cast<const uint16_t*>(row) + k0));
      const uint32_t words[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
      for (int q = 0; q < 4; ++q) {
        // Little-endian: the lower-addressed element is the low half.
        w[2 * q] = widen16<kDt>(words[q] & 0xffffu);
        w[2 * q + 1] = widen16<kDt>(words[q] >> 16);
      }
    }
  } else {
#pragma unroll
    for (int i = 0; i < kChunk; ++i) w[i] = k0 + i < K ? load_float<kDt>(row, k0 + i) : 0.0f;
  }
}

// f32 activations k0 .. k0 + 7 of a row of K (same contract as load_weights).
template <bool kVec>
__device__ __forceinline__ void load_acts(const float* row, int64_t k0, int64_t K,
                                          float (&a)[kChunk]) {
  if constexpr (kVec) {
    const auto* p = reinterpret_cast<const float4*>(row + k0);
    const float4 u = p[0];
    const float4 v = p[1];
    a[0] = u.x, a[1] = u.y, a[2] = u.z, a[3] = u.w;
    a[4] = v.x, a[5] = v.y, a[6] = v.z, a[7] = v.w;
  } else {
#pragma unroll
    for (int i = 0; i < kChunk; ++i) a[i] = k0 + i < K ? row[k0 + i] : 0.0f;
  }
}

// For kRows weight rows of length K and the first `count` (<= kTile, warp
// uniform) activation rows xs[t], out[r][t] = rows[r] · xs[t] on every lane.
// The summation order of one (row, token) dot depends only on K: lane l owns
// chunks l, l + 32, ... and adds their elements in order with fmaf; the lanes
// are then combined by a butterfly. Both load paths (kVec or not) add the same
// elements in the same order, so they agree bit for bit.
template <DType kDt, bool kVec, int kRows>
__device__ __forceinline__ void warp_dot(const void* const (&rows)[kRows], int64_t K,
                                         const float* const (&xs)[kTile], int count,
                                         float (&out)[kRows][kTile]) {
  const int lane = threadIdx.x % 32;
  float acc[kRows][kTile];
#pragma unroll
  for (int r = 0; r < kRows; ++r) {
#pragma unroll
    for (int t = 0; t < kTile; ++t) acc[r][t] = 0.0f;
  }
  const int64_t chunks = (K + kChunk - 1) / kChunk;
  // Not unrolled: unrolling by 2 or 4 raised the registers (by 4: 64 -> 80 in down, 78 ->
  // 100 in gate_up), lowered the blocks an SM holds, and made a 26B-A4B
  // decode step slower on an H200 (5.35 -> 5.64 ms).
#pragma unroll 1
  for (int64_t ch = lane; ch < chunks; ch += 32) {
    const int64_t k0 = ch * kChunk;
    float w[kRows][kChunk];
#pragma unroll
    for (int r = 0; r < kRows; ++r) load_weights<kDt, kVec>(rows[r], k0, K, w[r]);
#pragma unroll
    for (int t = 0; t < kTile; ++t) {
      if (t < count) {
        float a[kChunk];
        load_acts<kVec>(xs[t], k0, K, a);
#pragma unroll
        for (int i = 0; i < kChunk; ++i) {
          if (kVec || k0 + i < K) {
#pragma unroll
            for (int r = 0; r < kRows; ++r) acc[r][t] = fmaf(w[r][i], a[i], acc[r][t]);
          }
        }
      }
    }
  }
#pragma unroll
  for (int r = 0; r < kRows; ++r) {
#pragma unroll
    for (int t = 0; t < kTile; ++t) out[r][t] = warp_sum(acc[r][t]);
  }
}

// ---- moe_route ----

// One warp per token: softmax over the E logits (max ignoring NaN, f32 exp, sum
// in double, f32 division), top-k by repeated selection exactly as the CPU's
// scan (the first untaken expert if its probability is NaN, else the lowest id
// of the largest non-NaN probability), then the top-k weights renormalised by
// their f32 sum (added in pick order) and scaled by per_expert_scale.
//
// Each warp keeps its token's probabilities and a bitmap of the experts taken
// in shared memory (route_smem_bytes): the k selections then touch no global
// memory and compute no exp. (Recomputing every probability and rereading the
// picks from global memory in each selection made one token's routing take
// ~20 us on an H200, 10% of a 26B-A4B decode step.)
size_t route_smem_bytes(int n_experts) {
  return static_cast<size_t>(kRouteWarps) * (n_experts + (n_experts + 31) / 32) * 4;
}

template <DType kDt>
__global__ void __launch_bounds__(kRouteWarps * 32)
    moe_route_kernel(const float* logits, const void* expert_scale, int32_t* expert_ids,
                     float* expert_weights, int64_t n, int n_experts, int top_k) {
  extern __shared__ float route_smem[];
  const int lane = threadIdx.x % 32;
  const int warp = threadIdx.x / 32;
  const int64_t r = static_cast<int64_t>(blockIdx.x) * kRouteWarps + warp;
  if (r >= n) return;  // warp-uniform; only warp barriers below
  const int words = (n_experts + 31) / 32;
  float* probs = route_smem + static_cast<int64_t>(warp) * (n_experts + words);
  auto* taken = reinterpret_cast<uint32_t*>(probs + n_experts);  // bit e % 32 of word e / 32
  const float* lr = logits + r * n_experts;
  float m = -std::numeric_limits<float>::infinity();
  for (int e = lane; e < n_experts; e += 32) m = lr[e] > m ? lr[e] : m;  // std::max keeps m on NaN
  for (int s = 16; s > 0; s >>= 1) {
    const float o = __shfl_xor_sync(0xffffffffu, m, s);
    m = o > m ? o : m;
  }
  double sum = 0.0;
  for (int e = lane; e < n_experts; e += 32) sum += exp_f32(__fsub_rn(lr[e], m));
  const auto denom = static_cast<float>(warp_sum(sum));
  for (int e = lane; e < n_experts; e += 32) {
    probs[e] = __fdiv_rn(exp_f32(__fsub_rn(lr[e], m)), denom);
  }
  for (int w = lane; w < words; w += 32) taken[w] = 0u;
  __syncwarp();

  int32_t* rid = expert_ids + r * top_k;
  float* rw = expert_weights + r * top_k;
  float picked_sum = 0.0f;  // lane 0's, in pick order
  for (int t = 0; t < top_k; ++t) {
    int first_free = INT_MAX;
    float best_value = -std::numeric_limits<float>::infinity();
    int best = INT_MAX;
    for (int e = lane; e < n_experts; e += 32) {
      if ((taken[e / 32] >> (e % 32)) & 1u) continue;
      if (first_free == INT_MAX) first_free = e;  // ascending e: the first is the lowest
      const float p = probs[e];
      if (!isnan(p) && (p > best_value || (p == best_value && e < best))) {
        best_value = p;
        best = e;
      }
    }
    for (int s = 16; s > 0; s >>= 1) {
      const int o_free = __shfl_xor_sync(0xffffffffu, first_free, s);
      const float o_value = __shfl_xor_sync(0xffffffffu, best_value, s);
      const int o_best = __shfl_xor_sync(0xffffffffu, best, s);
      first_free = o_free < first_free ? o_free : first_free;
      if (o_value > best_value || (o_value == best_value && o_best < best)) {
        best_value = o_value;
        best = o_best;
      }
    }
    // top_k <= E, so an untaken expert exists and first_free is valid.
    const int pick = (best == INT_MAX || isnan(probs[first_free])) ? first_free : best;
    if (lane == 0) {
      taken[pick / 32] |= 1u << (pick % 32);
      rid[t] = pick;
      picked_sum = __fadd_rn(picked_sum, probs[pick]);
    }
    __syncwarp();  // orders lane 0's bit before every lane's next scan
  }
  picked_sum = __shfl_sync(0xffffffffu, picked_sum, 0);
  for (int t = lane; t < top_k; t += 32) {
    const int pick = rid[t];  // lane 0's store, ordered by the last __syncwarp
    rw[t] = __fmul_rn(__fdiv_rn(probs[pick], picked_sum), load_float<kDt>(expert_scale, pick));
  }
}

// ---- moe_experts ----

// Per-pass bookkeeping in scratch (all i32). Slots are pass-local: s = t * k + j
// for the pass's token t and choice j.
struct Buckets {
  int32_t* offsets;       // [E + 1]: expert e's slots are list[offsets[e] .. offsets[e + 1])
  int32_t* active;        // [E]: experts with at least one slot, ascending
  int32_t* active_count;  // [1]
  int32_t* list;          // [S]: slots grouped by expert (order within a group is free)
  int32_t* order;         // [S]: per token, its choices j sorted by (expert id, j)
  // The prefill path's tiles (MoeTiles); null on the batch-invariant path.
  int32_t* tile_expert;  // [moe_max_tiles(S, E)]
  int32_t* tile_begin;   // [moe_max_tiles(S, E)]
  int32_t* tile_count;   // [1]
};

// One block. Out-of-range ids are left out of every bucket (the combine turns
// their token into NaN). Order within a bucket comes from atomics and may vary
// between runs; no result depends on it.
__global__ void __launch_bounds__(kBucketThreads)
    moe_bucket_kernel(const int32_t* ids, int tokens, int top_k, int n_experts, Buckets b) {
  extern __shared__ int32_t shared[];
  int32_t* count = shared;               // [E]
  int32_t* cursor = shared + n_experts;  // [E]
  const int slots = tokens * top_k;
  for (int e = threadIdx.x; e < n_experts; e += blockDim.x) count[e] = 0;
  __syncthreads();
  for (int s = threadIdx.x; s < slots; s += blockDim.x) {
    const int e = ids[s];
    if (e >= 0 && e < n_experts) atomicAdd(&count[e], 1);
  }
  __syncthreads();
  if (threadIdx.x < 32) {
    // Warp 0 scans the counts 32 experts at a time (a serial scan by one thread
    // was most of this kernel at decode, where it runs once per layer).
    const int lane = static_cast<int>(threadIdx.x);
    int running = 0;
    int used = 0;
    for (int base = 0; base < n_experts; base += 32) {
      const int e = base + lane;
      const int c = e < n_experts ? count[e] : 0;
      int inclusive = c;
      for (int d = 1; d < 32; d <<= 1) {
        const int o = __shfl_up_sync(0xffffffffu, inclusive, d);
        if (lane >= d) inclusive += o;
      }
      const unsigned in_use = __ballot_sync(0xffffffffu, c > 0);
      if (e < n_experts) {
        b.offsets[e] = running + inclusive - c;
        cursor[e] = running + inclusive - c;
        if (c > 0) b.active[used + __popc(in_use & ((1u << lane) - 1u))] = e;
      }
      running += __shfl_sync(0xffffffffu, inclusive, 31);
      used += __popc(in_use);
    }
    if (lane == 0) {
      b.offsets[n_experts] = running;
      *b.active_count = used;
    }
  }
  __syncthreads();
  if (threadIdx.x == 0) {
    if (b.tile_expert != nullptr) {
      int tiles = 0;
      for (int e = 0; e < n_experts; ++e) {
        for (int s = cursor[e]; s < cursor[e] + count[e]; s += kMoeTileRows) {
          b.tile_expert[tiles] = e;
          b.tile_begin[tiles] = s;
          ++tiles;
        }
      }
      *b.tile_count = tiles;
    }
  }
  __syncthreads();
  for (int s = threadIdx.x; s < slots; s += blockDim.x) {
    const int e = ids[s];
    if (e >= 0 && e < n_experts) b.list[atomicAdd(&cursor[e], 1)] = s;
  }
  // Insertion sort of each token's choices by expert id; strict '>' keeps equal
  // ids in choice order (as the CPU's buckets keep slots ascending).
  for (int t = threadIdx.x; t < tokens; t += blockDim.x) {
    const int32_t* tid = ids + static_cast<int64_t>(t) * top_k;
    int32_t* to = b.order + static_cast<int64_t>(t) * top_k;
    for (int j = 0; j < top_k; ++j) {
      int p = j;
      while (p > 0 && tid[to[p - 1]] > tid[j]) {
        to[p] = to[p - 1];
        --p;
      }
      to[p] = j;
    }
  }
}

// grid (ceil(I / kWarps), max experts in use), kWarps warps: warp w of block
// (bx, r) takes gate row c = bx * kWarps + w and up row I + c of the r-th expert
// in use, streams both once per kTile of its tokens, and writes
// act[s, c] = gelu_tanh(gate · x) * (up · x).
template <DType kDt, bool kVec>
__global__ void __launch_bounds__(kWarps * 32)
    moe_gate_up_kernel(const float* x, const void* gate_up, int64_t hidden, int64_t inter,
                       int top_k, Buckets b, float* act) {
  if (static_cast<int>(blockIdx.y) >= *b.active_count) return;
  const int64_t c = static_cast<int64_t>(blockIdx.x) * kWarps + threadIdx.x / 32;
  if (c >= inter) return;  // warp-uniform; no block barriers below
  const int e = b.active[blockIdx.y];
  const int begin = b.offsets[e];
  const int end = b.offsets[e + 1];
  const int lane = threadIdx.x % 32;
  const void* const rows[2] = {elem_ptr<kDt>(gate_up, (e * 2 * inter + c) * hidden),
                               elem_ptr<kDt>(gate_up, (e * 2 * inter + inter + c) * hidden)};
  for (int s0 = begin; s0 < end; s0 += kTile) {
    const int count = end - s0 < kTile ? end - s0 : kTile;
    int slot[kTile];
    const float* xs[kTile];
#pragma unroll
    for (int t = 0; t < kTile; ++t) {
      slot[t] = b.list[s0 + (t < count ? t : 0)];
      xs[t] = x + static_cast<int64_t>(slot[t] / top_k) * hidden;
    }
    float dots[2][kTile];
    warp_dot<kDt, kVec, 2>(rows, hidden, xs, count, dots);
#pragma unroll
    for (int t = 0; t < kTile; ++t) {
      if (t < count && lane == t) {
        act[static_cast<int64_t>(slot[t]) * inter + c] =
            __fmul_rn(gelu_tanh(dots[0][t]), dots[1][t]);
      }
    }
  }
}

// grid (ceil(H / (kWarps · kDownRows)), max experts in use), kWarps warps:
// warp w of block (bx, r) takes rows h = (bx · kWarps + w) · kDownRows + j
// (j < kDownRows) of the r-th expert's down [H, I] and writes
// y[s, h] = down_e[h, :] · act[s, :] for each of that expert's slots. Rows past
// H repeat the last row: computed, never written.
template <DType kDt, bool kVec>
__global__ void __launch_bounds__(kWarps * 32)
    moe_down_kernel(const float* act, const void* down, int64_t hidden, int64_t inter, Buckets b,
                    float* y) {
  if (static_cast<int>(blockIdx.y) >= *b.active_count) return;
  const int64_t h0 = (static_cast<int64_t>(blockIdx.x) * kWarps + threadIdx.x / 32) * kDownRows;
  if (h0 >= hidden) return;  // warp-uniform
  const int e = b.active[blockIdx.y];
  const int begin = b.offsets[e];
  const int end = b.offsets[e + 1];
  const int lane = threadIdx.x % 32;
  const void* rows[kDownRows];
#pragma unroll
  for (int j = 0; j < kDownRows; ++j) {
    const int64_t h = h0 + j < hidden ? h0 + j : hidden - 1;
    rows[j] = elem_ptr<kDt>(down, (e * hidden + h) * inter);
  }
  for (int s0 = begin; s0 < end; s0 += kTile) {
    const int count = end - s0 < kTile ? end - s0 : kTile;
    int slot[kTile];
    const float* as[kTile];
#pragma unroll
    for (int t = 0; t < kTile; ++t) {
      slot[t] = b.list[s0 + (t < count ? t : 0)];
      as[t] = act + static_cast<int64_t>(slot[t]) * inter;
    }
    float dots[kDownRows][kTile];
    warp_dot<kDt, kVec, kDownRows>(rows, inter, as, count, dots);
#pragma unroll
    for (int j = 0; j < kDownRows; ++j) {
#pragma unroll
      for (int t = 0; t < kTile; ++t) {
        if (t < count && lane == t && h0 + j < hidden) {
          y[static_cast<int64_t>(slot[t]) * hidden + h0 + j] = dots[j][t];
        }
      }
    }
  }
}

// One thread per (token, h): out = ((0 + w_a·y_a) + w_b·y_b) + ... over the
// token's slots in ascending expert id, as the CPU's axpy per expert. A token
// with an expert id outside [0, E) gets NaN (the device cannot throw).
__global__ void moe_combine_kernel(const int32_t* ids, const float* weights, const float* y,
                                   const int32_t* order, int tokens, int top_k, int n_experts,
                                   int64_t hidden, float* out) {
  const int64_t total = static_cast<int64_t>(tokens) * hidden;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < total;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t t = i / hidden;
    const int64_t h = i % hidden;
    const int32_t* tid = ids + t * top_k;
    bool valid = true;
    for (int j = 0; j < top_k; ++j) valid &= tid[j] >= 0 && tid[j] < n_experts;
    float acc = 0.0f;
    if (valid) {
      for (int q = 0; q < top_k; ++q) {
        const int64_t s = t * top_k + order[t * top_k + q];
        acc = __fadd_rn(acc, __fmul_rn(weights[s], y[s * hidden + h]));
      }
    } else {
      acc = std::numeric_limits<float>::quiet_NaN();
    }
    out[i] = acc;
  }
}

// Hands out consecutive 256-byte aligned pieces of one scratch buffer.
class ScratchCarver {
 public:
  explicit ScratchCarver(void* base) : at_(static_cast<char*>(base)) {}
  template <typename T>
  T* take(int64_t count) {
    T* p = reinterpret_cast<T*>(at_);
    at_ += align_up(static_cast<size_t>(count) * sizeof(T));
    return p;
  }

 private:
  char* at_;
};

// Bytes of a pass's bookkeeping (Buckets, with tiles when max_tiles > 0).
size_t bucket_bytes(int64_t n_experts, int64_t max_slots, int64_t max_tiles) {
  return 2 * align_up(static_cast<size_t>(n_experts + 1) * 4) +
         2 * align_up(static_cast<size_t>(max_slots) * 4) +
         (max_tiles > 0 ? 2 * align_up(static_cast<size_t>(max_tiles) * 4) + align_up(4) : 0);
}

// The Buckets bucket_bytes() counted, taken from `carve` in that order.
Buckets carve_buckets(ScratchCarver& carve, int64_t n_experts, int64_t max_slots,
                      int64_t max_tiles) {
  Buckets b{};
  b.offsets = carve.take<int32_t>(n_experts + 1);
  b.active = carve.take<int32_t>(n_experts + 1);
  b.active_count = b.active + n_experts;
  b.list = carve.take<int32_t>(max_slots);
  b.order = carve.take<int32_t>(max_slots);
  if (max_tiles > 0) {
    b.tile_expert = carve.take<int32_t>(max_tiles);
    b.tile_begin = carve.take<int32_t>(max_tiles);
    b.tile_count = carve.take<int32_t>(1);
  }
  return b;
}

// A pass's bucket kernel and its combine (the same on both paths).
void launch_bucket(const int32_t* pass_ids, int tokens, int top_k, int n_experts, const Buckets& b,
                   cudaStream_t stream) {
  moe_bucket_kernel<<<1, kBucketThreads, static_cast<size_t>(2 * n_experts) * 4, stream>>>(
      pass_ids, tokens, top_k, n_experts, b);
  check_cuda(cudaGetLastError(), "moe_bucket_kernel");
}

void launch_combine(const int32_t* pass_ids, const float* pass_weights, const float* y,
                    const Buckets& b, int tokens, int top_k, int n_experts, int64_t hidden,
                    float* pass_out, cudaStream_t stream) {
  const int64_t total = static_cast<int64_t>(tokens) * hidden;
  const unsigned blocks = std::min(blocks_for(total, 256), 65535u);
  moe_combine_kernel<<<blocks, 256, 0, stream>>>(pass_ids, pass_weights, y, b.order, tokens, top_k,
                                                 n_experts, hidden, pass_out);
  check_cuda(cudaGetLastError(), "moe_combine_kernel");
}

}  // namespace

// Routing of N tokens over E experts. logits f32 [N, E]; per_expert_scale [E]
// f32|bf16|f16; expert_ids i32 [N, k] and expert_weights f32 [N, k] out. One
// warp per token, kRouteWarps tokens per block.
void CudaBackend::moe_route(const MoeRouteParams& p) {
  OpTimer timer(*this, "moe_route");
  constexpr const char* kOp = "moe_route";
  check_on(*this, kOp, "logits", p.logits);
  check_on(*this, kOp, "per_expert_scale", p.per_expert_scale);
  check_on(*this, kOp, "expert_ids", p.expert_ids);
  check_on(*this, kOp, "expert_weights", p.expert_weights);
  check_dtype(kOp, "logits", p.logits, DType::kF32);
  check_rank(kOp, "logits", p.logits, 2);
  check_float(kOp, "per_expert_scale", p.per_expert_scale);
  check_dtype(kOp, "expert_ids", p.expert_ids, DType::kI32);
  check_rank(kOp, "expert_ids", p.expert_ids, 2);
  check_dtype(kOp, "expert_weights", p.expert_weights, DType::kF32);
  const int64_t n = p.logits.dim(0);
  const int64_t n_experts = p.logits.dim(1);
  const int64_t top_k = p.expert_ids.dim(1);
  if (p.per_expert_scale.shape() != Shape({n_experts})) {
    fail("moe_route: per_expert_scale {} must be [{}] for logits {}", p.per_expert_scale.describe(),
         n_experts, p.logits.describe());
  }
  if (p.expert_ids.dim(0) != n || top_k < 1 || top_k > n_experts) {
    fail("moe_route: expert_ids {} must be i32[{}, k] with 1 <= k <= {} for logits {}",
         p.expert_ids.describe(), n, n_experts, p.logits.describe());
  }
  check_same_shape(kOp, "expert_ids", p.expert_ids, "expert_weights", p.expert_weights);
  check_no_alias(kOp, "expert_ids", p.expert_ids, "logits", p.logits);
  check_no_alias(kOp, "expert_weights", p.expert_weights, "logits", p.logits);
  check_no_alias(kOp, "expert_weights", p.expert_weights, "expert_ids", p.expert_ids);
  if (n_experts > kMaxExperts) {  // bounds each warp's shared probabilities
    fail("moe_route: logits {} have more than the supported {} experts", p.logits.describe(),
         kMaxExperts);
  }
  if (n == 0) return;
  with_float_dtype(p.per_expert_scale.dtype(), [&](auto tag) {
    constexpr DType kDt = decltype(tag)::value;
    launch_kernel(moe_route_kernel<kDt>, dim3(blocks_for(n, kRouteWarps)), dim3(kRouteWarps * 32),
                  route_smem_bytes(static_cast<int>(n_experts)), stream(), "moe_route_kernel",
                  false, p.logits.data_as<const float>(), p.per_expert_scale.data(),
                  p.expert_ids.data_as<int32_t>(), p.expert_weights.data_as<float>(), n,
                  static_cast<int>(n_experts), static_cast<int>(top_k));
  });
}

// Routed expert FFN. x f32 [N, H]; expert_ids i32 [N, k]; expert_weights f32
// [N, k]; gate_up [E, 2I, H] and down [E, H, I] f32|bf16|f16; out f32 [N, H]
// (not aliasing any input). Ids are not validated on the host (that would need
// a readback): a token with an id outside [0, E) gets a NaN output row.
void CudaBackend::moe_experts(const MoeExpertsParams& p) {
  OpTimer timer(*this, "moe_experts");
  constexpr const char* kOp = "moe_experts";
  check_on(*this, kOp, "x", p.x);
  check_on(*this, kOp, "expert_ids", p.expert_ids);
  check_on(*this, kOp, "expert_weights", p.expert_weights);
  check_on(*this, kOp, "gate_up", p.gate_up);
  check_on(*this, kOp, "down", p.down);
  check_on(*this, kOp, "out", p.out);
  const ops::MoeExpertsDims dims = ops::check_moe_experts(p);
  const int64_t n = dims.tokens;
  const int64_t h = dims.hidden;
  const int64_t top_k = dims.top_k;
  const int64_t n_experts = dims.experts;
  const int64_t inter = dims.inter;
  if (n_experts > kMaxExperts) {
    fail("moe_experts: gate_up {} has more than the supported {} experts", p.gate_up.describe(),
         kMaxExperts);
  }
  if (top_k > kMaxTopK) {
    fail("moe_experts: expert_ids {} choose more than the supported {} experts per token",
         p.expert_ids.describe(), kMaxTopK);
  }
  if (n == 0 || h == 0) return;
  if (top_k == 0) {
    check_cuda(cudaMemsetAsync(p.out.data(), 0, p.out.nbytes(), stream()), "moe_experts (memset)");
    return;
  }

  const bool grouped = p.prefill && n > kGroupedMinTokens && inter > 0 &&
                       p.gate_up.dtype() == DType::kBF16 && p.down.dtype() == DType::kBF16 &&
                       h % 8 == 0 && inter % 8 == 0 && aligned16(p.gate_up.data()) &&
                       aligned16(p.down.data());
  if (grouped) {
    moe_experts_grouped(p, n, h, inter, n_experts, top_k);
    return;
  }

  // Scratch for the largest pass: bookkeeping, act [S, I] and y [S, H].
  const int64_t max_tokens = n < kPassTokens ? n : kPassTokens;
  const int64_t max_slots = max_tokens * top_k;
  ScratchCarver carve(
      scratch(moe_scratch_, bucket_bytes(n_experts, max_slots, 0) +
                                align_up(static_cast<size_t>(max_slots * inter) * 4) +
                                align_up(static_cast<size_t>(max_slots * h) * 4)));
  const Buckets b = carve_buckets(carve, n_experts, max_slots, 0);  // no tiles
  auto* act = carve.take<float>(max_slots * inter);
  auto* y = carve.take<float>(max_slots * h);

  // 16-byte loads need whole 8-element chunks and aligned rows (scratch is).
  const bool vec_gate_up = h % kChunk == 0 && aligned16(p.gate_up.data()) && aligned16(p.x.data());
  const bool vec_down = inter % kChunk == 0 && aligned16(p.down.data());
  const auto* ids = p.expert_ids.data_as<const int32_t>();
  const auto* weights = p.expert_weights.data_as<const float>();
  const auto* x = p.x.data_as<const float>();
  auto* out = p.out.data_as<float>();
  const int k = static_cast<int>(top_k);
  const int e_count = static_cast<int>(n_experts);

  for (int64_t n0 = 0; n0 < n; n0 += kPassTokens) {
    const int tokens = static_cast<int>(n - n0 < kPassTokens ? n - n0 : kPassTokens);
    const int64_t slots = static_cast<int64_t>(tokens) * top_k;
    const int32_t* pass_ids = ids + n0 * top_k;
    launch_bucket(pass_ids, tokens, k, e_count, b, stream());
    // Blocks beyond the experts actually in use return at once.
    const auto max_active = static_cast<unsigned>(slots < n_experts ? slots : n_experts);
    if (max_active > 0 && inter > 0) {
      const dim3 grid(blocks_for(inter, kWarps), max_active);
      with_float_dtype(p.gate_up.dtype(), [&](auto tag) {
        constexpr DType kDt = decltype(tag)::value;
        if (vec_gate_up) {
          moe_gate_up_kernel<kDt, true><<<grid, kWarps * 32, 0, stream()>>>(
              x + n0 * h, p.gate_up.data(), h, inter, k, b, act);
        } else {
          moe_gate_up_kernel<kDt, false><<<grid, kWarps * 32, 0, stream()>>>(
              x + n0 * h, p.gate_up.data(), h, inter, k, b, act);
        }
      });
      check_cuda(cudaGetLastError(), "moe_gate_up_kernel");
    }
    if (max_active > 0) {
      // With I == 0 every dot is empty: y = 0, as the CPU's product of empty rows.
      const dim3 grid(blocks_for(h, kWarps * kDownRows), max_active);
      with_float_dtype(p.down.dtype(), [&](auto tag) {
        constexpr DType kDt = decltype(tag)::value;
        if (vec_down) {
          moe_down_kernel<kDt, true>
              <<<grid, kWarps * 32, 0, stream()>>>(act, p.down.data(), h, inter, b, y);
        } else {
          moe_down_kernel<kDt, false>
              <<<grid, kWarps * 32, 0, stream()>>>(act, p.down.data(), h, inter, b, y);
        }
      });
      check_cuda(cudaGetLastError(), "moe_down_kernel");
    }
    launch_combine(pass_ids, weights + n0 * top_k, y, b, tokens, k, e_count, h, out + n0 * h,
                   stream());
  }
}

// moe_experts' prefill path (see the top of the file); the caller has checked
// the shapes, dtypes and alignment it needs. Per pass: bucket (with tiles), x to
// bf16, the grouped gate/up and down products, the combine.
void CudaBackend::moe_experts_grouped(const MoeExpertsParams& p, int64_t n, int64_t h,
                                      int64_t inter, int64_t n_experts, int64_t top_k) {
  const int64_t max_tokens = n < kGroupedPassTokens ? n : kGroupedPassTokens;
  const int64_t max_slots = max_tokens * top_k;
  const int64_t max_tiles = moe_max_tiles(max_slots, n_experts);
  ScratchCarver carve(
      scratch(moe_scratch_, bucket_bytes(n_experts, max_slots, max_tiles) +
                                align_up(static_cast<size_t>(max_tokens * h) * 2) +
                                align_up(static_cast<size_t>(max_slots * inter) * 2) +
                                align_up(static_cast<size_t>(max_slots * h) * 4)));
  const Buckets b = carve_buckets(carve, n_experts, max_slots, max_tiles);
  auto* xb = carve.take<__nv_bfloat16>(max_tokens * h);
  auto* act = carve.take<__nv_bfloat16>(max_slots * inter);
  auto* y = carve.take<float>(max_slots * h);
  const MoeTiles tiles{.tile_expert = b.tile_expert,
                       .tile_begin = b.tile_begin,
                       .tile_count = b.tile_count,
                       .offsets = b.offsets,
                       .list = b.list};

  const auto* ids = p.expert_ids.data_as<const int32_t>();
  const auto* weights = p.expert_weights.data_as<const float>();
  const auto* x = p.x.data_as<const float>();
  const auto* gate_up = static_cast<const __nv_bfloat16*>(p.gate_up.data());
  const auto* down = static_cast<const __nv_bfloat16*>(p.down.data());
  auto* out = p.out.data_as<float>();
  const int k = static_cast<int>(top_k);
  const int e_count = static_cast<int>(n_experts);
  for (int64_t n0 = 0; n0 < n; n0 += kGroupedPassTokens) {
    const int tokens = static_cast<int>(n - n0 < kGroupedPassTokens ? n - n0 : kGroupedPassTokens);
    const int64_t slots = static_cast<int64_t>(tokens) * top_k;
    const int32_t* pass_ids = ids + n0 * top_k;
    launch_bucket(pass_ids, tokens, k, e_count, b, stream());
    convert_to_bf16(x + n0 * h, DType::kF32, xb, static_cast<int64_t>(tokens) * h, stream());
    const int64_t pass_tiles = moe_max_tiles(slots, n_experts);
    moe_gemm_gate_up(xb, gate_up, act, h, inter, k, tiles, pass_tiles, stream());
    moe_gemm_down(act, down, y, h, inter, tiles, pass_tiles, stream());
    launch_combine(pass_ids, weights + n0 * top_k, y, b, tokens, k, e_count, h, out + n0 * h,
                   stream());
  }
}

}  // namespace specula::cuda
