// SPDX-License-Identifier: Apache-2.0
// Fused steps of a decoder layer on the GPU: store_kv (the cache store by
// device positions), rms_norm_add_norm (residual update plus the next block's
// input norm) and attention_inputs (q/k/v norms, RoPE and the cache store of one
// attention layer in a single launch).
//
// Each fused kernel is bit-identical to the separate CUDA ops it replaces
// (rms_norm, rms_norm_add, rope, copy, store_kv): the per-element arithmetic is
// the shared rms_* / rope_rotate helpers of cuda_device_common.cuh, and every
// row is reduced by the same thread pattern as in cuda_elementwise.cu (element c
// of a row summed by lane c % group in increasing c, then the same butterfly).
// A row's result depends only on that row, so the ops are batch invariant.
#include <cuda_runtime.h>

#include <cstdint>
#include <utility>

#include "engine/backend/cuda/cuda_backend.h"
#include "engine/backend/cuda/cuda_device_common.cuh"
#include "engine/backend/cuda/cuda_launch.cuh"
#include "engine/backend/cuda/cuda_linear_mma.h"
#include "engine/backend/cuda/cuda_split.cuh"

namespace specula::cuda {
namespace {

constexpr int kThreads = 256;
constexpr int kWarps = kThreads / 32;
// Grid-stride kernels never launch more blocks than this; each block loops.
constexpr unsigned kMaxBlocks = 65535;
// Widest head attention_inputs fuses; each lane keeps kMaxHeadDim / 32 floats
// of a row in registers. Wider heads take the unfused composition.
constexpr int64_t kMaxHeadDim = 512;
constexpr int kPerLane = static_cast<int>(kMaxHeadDim / 32);

unsigned grid_for(int64_t n, int per_block) {
  const unsigned b = blocks_for(n, per_block);
  return b < kMaxBlocks ? b : kMaxBlocks;
}

// Every kernel here is a programmatic dependent (launch_pdl, cuda_launch.cuh)
// that waits for its predecessor before touching anything: its launch and
// block scheduling overlap the previous kernel's tail, and it lets the next
// kernel do the same. Neither changes what anything computes.
__device__ __forceinline__ void pdl_enter() {
  pdl_launch_dependents();
  pdl_wait();
}

// ---- store_kv ----

// How store_kv (and convert) turns an f32 element into the cache's: f32
// copies it, bf16 rounds it as f32_to_bf16_bits (the CPU's rule), fp8 scales
// its (token, kv head) vector by amax / 448 and rounds each element as
// kv_e4m3_encode (engine/core/dtype.h: the same f32 operations as the CPU's
// kv_e4m3_quantize_row, so the bits and scales are equal).
struct StoreF32 {
  using Elem = float;
  static constexpr bool kScaled = false;
  __device__ static float encode(float x, float) { return x; }
};
struct StoreBf16 {
  using Elem = uint16_t;
  static constexpr bool kScaled = false;
  __device__ static uint16_t encode(float x, float) { return f32_to_bf16_bits(x); }
};
struct StoreFp8 {
  using Elem = uint8_t;
  static constexpr bool kScaled = true;
  __device__ static uint8_t encode(float x, float scale) { return kv_e4m3_encode_dev(x, scale); }
};

// One (token, kv head) vector of d values from src (read with load_act) into
// dst by one warp; scaled conversions also write *scale (lane 0). The amax is
// a max over the finite elements: exact, whatever the order.
template <typename Conv>
__device__ __forceinline__ void store_vector(const float* src, typename Conv::Elem* dst,
                                             float* scale, int64_t d, int lane) {
  float s = 1.0f;
  if constexpr (Conv::kScaled) {
    float amax = 0.0f;
    for (int64_t i = lane; i < d; i += 32) {
      const float x = load_act(src + i);
      if (isfinite(x)) amax = fmaxf(amax, fabsf(x));
    }
    for (int m = 16; m > 0; m >>= 1) amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, m));
    s = kv_e4m3_scale_dev(amax);
    if (lane == 0) *scale = s;
  }
  for (int64_t i = lane; i < d; i += 32) dst[i] = Conv::encode(load_act(src + i), s);
}

// Where store_kv_kernel writes the rows of one sequence: its caches of
// `rows` rows, and for fp8 their scales (null otherwise).
template <typename Elem>
struct KvStoreDest {
  Elem* k;
  Elem* v;
  float* scale_k;
  float* scale_v;
  int64_t rows;
};
// Sequences one batched store launch serves (by value: 2.5 KB of parameters).
constexpr int kStoreBatchSeqs = 64;
template <typename Elem, int kSeqs>
struct KvStoreDests {
  KvStoreDest<Elem> seq[kSeqs];
};

// store_kv for every cache dtype: one warp per (row, kv head) vector of the n
// rows; row i goes to row positions[i] mod R (scales: one per (row, kv head),
// for fp8 only, else null). A negative position cannot throw in a kernel: that
// row is not written. k, v and positions are read with load_act (no
// __restrict__ on them, so the compiler cannot turn the loads into read-only
// ones): see cuda_launch.cuh. A batch (kSeqs > 1, store_kv_batch): row i
// belongs to sequence i / seq_rows and goes to that sequence's caches.
template <typename Conv, int kSeqs>
__global__ void __launch_bounds__(kThreads)
    store_kv_kernel(const float* k, const float* v, const int32_t* positions,
                    const __grid_constant__ KvStoreDests<typename Conv::Elem, kSeqs> dests,
                    int64_t rows, int64_t seq_rows, int64_t heads, int64_t d) {
  pdl_enter();
  const int lane = static_cast<int>(threadIdx.x) & 31;
  const int64_t total = rows * heads;
  for (int64_t w = static_cast<int64_t>(blockIdx.x) * kWarps + threadIdx.x / 32; w < total;
       w += static_cast<int64_t>(gridDim.x) * kWarps) {
    const int64_t r = w / heads;
    const int32_t pos = load_act(positions + r);
    if (pos < 0) continue;  // warp-uniform
    const KvStoreDest<typename Conv::Elem>& c = dests.seq[kSeqs == 1 ? 0 : r / seq_rows];
    const int64_t dst = (static_cast<int64_t>(pos) % c.rows) * heads + (w - r * heads);
    store_vector<Conv>(k + w * d, c.k + dst * d, Conv::kScaled ? c.scale_k + dst : nullptr, d,
                       lane);
    store_vector<Conv>(v + w * d, c.v + dst * d, Conv::kScaled ? c.scale_v + dst : nullptr, d,
                       lane);
  }
}

// Runs f(Conv{}) with the store conversion of a cache dtype.
template <typename F>
void with_store_conv(DType dtype, F&& f) {
  switch (dtype) {
    case DType::kBF16:
      f(StoreBf16{});
      break;
    case DType::kF8E4M3:
      f(StoreFp8{});
      break;
    default:
      f(StoreF32{});
      break;
  }
}

// Destination entry of the caches of one store.
template <typename Conv>
KvStoreDest<typename Conv::Elem> store_dest(const Tensor& cache_k, const Tensor& cache_v,
                                            int64_t cache_rows) {
  using Elem = typename Conv::Elem;
  return {cache_k.data_as<Elem>(), cache_v.data_as<Elem>(),
          Conv::kScaled ? const_cast<float*>(cache_k.scale_data()) : nullptr,
          Conv::kScaled ? const_cast<float*>(cache_v.scale_data()) : nullptr, cache_rows};
}

// convert f32 -> fp8: row w (of d values) of src into row w of dst and
// scale[w], one warp a row (the rows of store_kv).
__global__ void __launch_bounds__(kThreads)
    quantize_rows_fp8_kernel(const float* src, uint8_t* __restrict__ dst, float* __restrict__ scale,
                             int64_t rows, int64_t d) {
  pdl_enter();
  const int lane = static_cast<int>(threadIdx.x) & 31;
  for (int64_t w = static_cast<int64_t>(blockIdx.x) * kWarps + threadIdx.x / 32; w < rows;
       w += static_cast<int64_t>(gridDim.x) * kWarps) {
    store_vector<StoreFp8>(src + w * d, dst + w * d, scale + w, d, lane);
  }
}

// convert fp8 -> f32: dst[i] = e4m3(src[i]) · scale[i / d] (one f32 product,
// as the CPU dequantizes), one thread per element.
__global__ void __launch_bounds__(kThreads)
    dequantize_fp8_kernel(const uint8_t* src, const float* scale, float* __restrict__ dst,
                          int64_t n, int64_t d) {
  pdl_enter();
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    dst[i] = e4m3_dequant(load_act(src + i), load_act(scale + i / d));
  }
}

// convert: dst[i] = src[i] between f32 and bf16 (either way), one thread per
// element; f32 to bf16 rounds as f32_to_bf16_bits.
template <bool kToBf16>
__global__ void __launch_bounds__(kThreads)
    convert_kernel(const void* src, void* __restrict__ dst, int64_t n) {
  pdl_enter();
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    if constexpr (kToBf16) {
      static_cast<uint16_t*>(dst)[i] =
          f32_to_bf16_bits(load_act(static_cast<const float*>(src) + i));
    } else {
      static_cast<float*>(dst)[i] =
          bf16_bits_to_f32(load_act(static_cast<const unsigned short*>(src) + i));
    }
  }
}

// ---- rms_norm_add_norm ----

// Row r of rms_norm_add_norm by all kThreads threads of the block, thread t
// holding elements c = t + i·kThreads (i < kPer, kPer·kThreads >= d):
//   rrow = (rrow + rms_norm(xr)·w)·post_scale;  orow = rms_norm(rrow)·nw
// and, with a split, row r of orow's bf16 split with its zero padding. w / nw
// hold the thread's weight elements (has_w / has_nw false: weightless). Every
// thread must call it (block barriers inside).
template <int kThreads, int kPer>
__device__ __forceinline__ void add_norm_row_in_registers(const float* xr, float* rrow, float* orow,
                                                          const float (&w)[kPer], bool has_w,
                                                          const float (&nw)[kPer], bool has_nw,
                                                          float eps, float post_scale, int64_t d,
                                                          double* partials, __nv_bfloat16* split,
                                                          int64_t split_row_chunks, int64_t r) {
  const int lane = static_cast<int>(threadIdx.x);
  const int n = static_cast<int>(d);  // <= kPer · kThreads
  float xv[kPer], rv[kPer];
  load_held<kPer, kThreads>(xr, lane, n, xv);
  load_held<kPer, kThreads>(rrow, lane, n, rv);
  double sum = 0.0;
#pragma unroll
  for (int i = 0; i < kPer; ++i) {
    if (lane + i * kThreads < n) rms_accumulate(sum, xv[i]);
  }
  sum = fixed_block_sum<kThreads>(sum, partials);
  const float inv = rms_inv(sum, d, eps);
  double next_sum = 0.0;
#pragma unroll
  for (int i = 0; i < kPer; ++i) {
    if (lane + i * kThreads >= n) continue;
    rv[i] = residual_update(rv[i], rms_apply_loaded(xv[i], inv, has_w, w[i]), post_scale);
    rms_accumulate(next_sum, rv[i]);
  }
  next_sum = fixed_block_sum<kThreads>(next_sum, partials);
  const float next_inv = rms_inv(next_sum, d, eps);
#pragma unroll
  for (int i = 0; i < kPer; ++i) {
    const int c = lane + i * kThreads;
    if (c >= n) continue;
    rrow[c] = rv[i];
    const float out = rms_apply_loaded(rv[i], next_inv, has_nw, nw[i]);
    orow[c] = out;
    if (split != nullptr) store_split(split, split_row_chunks, r, c, out);
  }
  if (split != nullptr) {  // the row's zero padding up to whole steps
    for (int64_t c = d + lane; c < split_row_chunks * 8; c += kThreads)
      store_split(split, split_row_chunks, r, c, 0.0f);
  }
}

// rms_norm_kernel's residual path followed by its plain path on the updated
// residual, for one row per kGroup threads (the same group rms_norm picks for
// d): residual = (residual + rms_norm(x)·weight)·post_scale, then
// next_out = rms_norm(residual)·next_weight. Each thread rereads only the
// residual elements it wrote itself, and accumulates their squares in the
// order rms_norm would, so the second norm needs no extra barrier.
//
// kPer > 0 (rows of at most kPer · kGroup elements): thread `lane` keeps its
// elements c = lane + i·kGroup in registers, loads the two weight vectors
// before pdl_wait() (weights are never written by kernels), and issues all of
// a row's x and residual loads at once. Why: at one row (decode) this kernel
// sits between two products on the critical path, and the loop form waited a
// full memory round trip per element (its stores to the residual may alias the
// next element's loads as far as the compiler knows): ~20 us per call at 5,376
// elements on an H200. The sums see the same values in the same order, so both
// forms give the same bits.
template <DType kW, DType kN, int kGroup, int kPer>
__global__ void __launch_bounds__(norm_block_threads(kGroup))
    rms_norm_add_norm_kernel(const float* x, const void* weight, float eps, float* residual,
                             float post_scale, const void* next_weight, float* next_out,
                             int64_t rows, int64_t d, __nv_bfloat16* split,
                             int64_t split_row_chunks) {
  pdl_launch_dependents();
  constexpr int kBlock = norm_block_threads(kGroup);
  constexpr int kRowsPerBlock = kBlock / kGroup;
  constexpr int kHeld = kPer > 0 ? kPer : 1;
  __shared__ double partials[kBlock / 32];
  const int lane = threadIdx.x % kGroup;
  const int group = threadIdx.x / kGroup;
  const bool has_w = weight != nullptr;
  const bool has_nw = next_weight != nullptr;
  float w[kHeld], nw[kHeld];
  if constexpr (kPer > 0) {
    load_held<kPer, kGroup, kW>(weight, lane, static_cast<int>(d), w);
    load_held<kPer, kGroup, kN>(next_weight, lane, static_cast<int>(d), nw);
  }
  pdl_wait();
  // The loop bound depends only on blockIdx, so block-wide barriers inside are uniform.
  for (int64_t base = static_cast<int64_t>(blockIdx.x) * kRowsPerBlock; base < rows;
       base += static_cast<int64_t>(gridDim.x) * kRowsPerBlock) {
    const int64_t r = base + group;
    const bool active = r < rows;
    const float* xr = x + (active ? r : 0) * d;
    float* rrow = residual + (active ? r : 0) * d;
    float* orow = next_out + (active ? r : 0) * d;
    if constexpr (kPer > 0) {
      static_assert(kGroup == kNormBlockThreads, "rows held in registers are the block path's");
      add_norm_row_in_registers<kNormBlockThreads, kPer>(xr, rrow, orow, w, has_w, nw, has_nw, eps,
                                                         post_scale, d, partials, split,
                                                         split_row_chunks, r);
      continue;  // the helper also wrote the split's padding
    } else {
      double sum = 0.0;
      double next_sum = 0.0;
      if (active) {
        for (int64_t j = lane; j < d; j += kGroup) rms_accumulate(sum, xr[j]);
      }
      sum = rms_group_sum<kGroup, kBlock>(sum, partials);
      if (active) {
        const float inv = rms_inv(sum, d, eps);
        for (int64_t c = lane; c < d; c += kGroup) {
          const float updated =
              residual_update(rrow[c], rms_apply<kW>(xr[c], inv, weight, c), post_scale);
          rrow[c] = updated;
          rms_accumulate(next_sum, updated);
        }
      }
      next_sum = rms_group_sum<kGroup, kBlock>(next_sum, partials);
      if (!active) continue;
      const float next_inv = rms_inv(next_sum, d, eps);
      for (int64_t c = lane; c < d; c += kGroup) {
        const float out = rms_apply<kN>(rrow[c], next_inv, next_weight, c);
        orow[c] = out;
        if (split != nullptr) store_split(split, split_row_chunks, r, c, out);
      }
    }
    if (split != nullptr) {  // the row's zero padding up to whole steps
      for (int64_t c = d + lane; c < split_row_chunks * 8; c += kGroup)
        store_split(split, split_row_chunks, r, c, 0.0f);
    }
  }
}

// ---- attention_inputs ----

struct AttnInputsArgs {
  float* q;
  const void* q_norm;
  float* k;  // null without k
  const void* k_norm;
  float* v;
  const int32_t* positions;
  const float* inv_freq;
  float* cache_k;  // null without a cache store
  float* cache_v;
  int64_t tokens, heads, kv_heads, d, cache_rows;
  float eps;
  bool v_from_k;
};

// vals[i] = row[lane + 32 i] for the lane's elements of a row of d <= kMaxHeadDim.
__device__ __forceinline__ void load_row(const float* row, int64_t d, int lane,
                                         float (&vals)[kPerLane]) {
  load_held<kPerLane, 32>(row, lane, static_cast<int>(d), vals);
}

// rms_inv of a row spread over the warp as load_row leaves it: squares summed
// per lane in increasing element order, then the warp butterfly, exactly as
// rms_norm_kernel's warp path (d <= kWarpRowMax) sums it.
__device__ __forceinline__ float warp_row_inv(const float (&vals)[kPerLane], int64_t d, int lane,
                                              float eps) {
  return rms_inv(warp_row_sum_squares(vals, d, lane), d, eps);
}

// Rotation pairs (j, j + d/2) per lane: lane holds pairs j = lane + 32 i.
constexpr int kPairsPerLane = kPerLane / 2;

// One warp per row: rows [0, M·Nh) are (token, head) rows of q, rows
// [M·Nh, M·(Nh + KV)) are (token, kv head) rows of k, each of which also
// produces the same row of v and, with a cache, their cache rows. Only
// __syncwarp is used, so warps of a block may take different branches.
//
// The norm weight of the warp's first row and the rotation frequencies are
// loaded before pdl_wait() (neither is written by any kernel): in a decode
// step each warp has one row, and this takes two dependent memory round trips
// off the path between the q/k/v product and attention.
template <DType kQ, DType kK>
__global__ void __launch_bounds__(kThreads) attention_inputs_kernel(AttnInputsArgs a) {
  pdl_launch_dependents();
  __shared__ float rows_smem[kWarps][kMaxHeadDim];
  const int warp = threadIdx.x / 32;
  const int lane = threadIdx.x % 32;
  float* srow = rows_smem[warp];
  const int64_t d = a.d;
  const int n = static_cast<int>(d);
  const int64_t q_rows = a.tokens * a.heads;
  const int64_t total = q_rows + a.tokens * a.kv_heads;
  float freqs[kPairsPerLane];  // (a head of one dim has no pairs)
  load_held<kPairsPerLane, 32>(n >= 2 ? a.inv_freq : nullptr, lane, n / 2, freqs);
  float w[kPerLane];
  int held = -1;  // the weight w holds: 0 q_norm, 1 k_norm, -1 none yet
  const auto hold_weight = [&](int which) {
    if (held == which) return;
    if (which == 0) {
      load_held<kPerLane, 32, kQ>(a.q_norm, lane, n, w);
    } else {
      load_held<kPerLane, 32, kK>(a.k_norm, lane, n, w);
    }
    held = which;
  };
  const auto weight_at = [&](int i, int) { return w[i]; };
  const auto freq_at = [&](int i, int) { return freqs[i]; };
  const int64_t first = static_cast<int64_t>(blockIdx.x) * kWarps + warp;
  if (first < total) hold_weight(first < q_rows ? 0 : 1);
  pdl_wait();
  // r depends only on the warp: every lane of a warp takes the same path.
  for (int64_t r = first; r < total; r += static_cast<int64_t>(gridDim.x) * kWarps) {
    float vals[kPerLane];
    if (r < q_rows) {
      const int64_t t = r / a.heads;
      float* qrow = a.q + r * d;
      load_row(qrow, d, lane, vals);
      const float inv = warp_row_inv(vals, d, lane, a.eps);
      hold_weight(0);
      write_norm_rope(vals, inv, a.q_norm != nullptr, weight_at, d, lane, srow, a.positions[t],
                      freq_at, qrow, nullptr);
      continue;
    }
    const int64_t kr = r - q_rows;  // t · KV + h
    const int64_t t = kr / a.kv_heads;
    const int64_t h = kr - t * a.kv_heads;
    const int32_t pos = a.positions[t];
    float* krow = a.k + kr * d;
    float* vrow = a.v + kr * d;
    float* ck = nullptr;
    float* cv = nullptr;
    if (a.cache_k != nullptr && pos >= 0) {  // store_kv skips negative positions
      const int64_t slot = static_cast<int64_t>(pos) % a.cache_rows;
      ck = a.cache_k + (slot * a.kv_heads + h) * d;
      cv = a.cache_v + (slot * a.kv_heads + h) * d;
    }
    // The raw k row stays in registers: it is v's input too when v_from_k.
    load_row(krow, d, lane, vals);
    const float inv_k = warp_row_inv(vals, d, lane, a.eps);
    if (a.v_from_k) {
      // copy(k, v) then rms_norm(v): the same row, so the same inverse norm.
      write_plain_norm(vals, inv_k, d, lane, vrow, cv);
    } else {
      float vv[kPerLane];
      load_row(vrow, d, lane, vv);
      const float inv_v = warp_row_inv(vv, d, lane, a.eps);
      write_plain_norm(vv, inv_v, d, lane, vrow, cv);
    }
    // Every lane has loaded its raw k (above) before write_norm_rope's
    // __syncwarp, so overwriting elements another lane read is safe.
    hold_weight(1);
    write_norm_rope(vals, inv_k, a.k_norm != nullptr, weight_at, d, lane, srow, pos, freq_at, krow,
                    ck);
  }
}

}  // namespace

// Row i (KV·D floats) of k and v f32 [n, KV, D] goes to row positions[i] mod R
// of cache_k / cache_v [R, KV, D] (f32, bf16, or fp8 with its scales), by
// store_kv_kernel: one warp per (row, kv head). A negative position cannot be
// reported from the kernel: that row is left unwritten (the CPU backend
// throws instead).
void CudaBackend::store_kv(const Tensor& k, const Tensor& v, const Tensor& positions,
                           const Tensor& cache_k, const Tensor& cache_v) {
  OpTimer timer(*this, "store_kv");
  constexpr const char* kOp = "store_kv";
  check_on(*this, kOp, "k", k);
  check_on(*this, kOp, "v", v);
  check_on(*this, kOp, "positions", positions);
  check_on(*this, kOp, "cache_k", cache_k);
  check_on(*this, kOp, "cache_v", cache_v);
  const ops::StoreKvDims dims = ops::check_store_kv(kOp, k, v, positions, cache_k, cache_v);
  if (dims.rows == 0 || dims.row_floats == 0) return;
  const int64_t heads = k.dim(1);
  const int64_t d = k.dim(2);
  with_store_conv(cache_k.dtype(), [&](auto conv) {
    using Conv = decltype(conv);
    KvStoreDests<typename Conv::Elem, 1> dests{
        {store_dest<Conv>(cache_k, cache_v, dims.cache_rows)}};
    launch_pdl(store_kv_kernel<Conv, 1>, grid_for(dims.rows * heads, kWarps), kThreads, 0, stream(),
               "store_kv_kernel", k.data_as<const float>(), v.data_as<const float>(),
               positions.data_as<const int32_t>(), dests, dims.rows, dims.rows, heads, d);
  });
}

// See Backend::store_kv_batch. Runs of consecutive entries with one cache
// dtype and row count whose k, v and positions continue the first entry's (the
// rows of a batched step) take one store_kv_kernel launch (up to
// kStoreBatchSeqs); other entries are store_kv calls. Every row is stored by
// the same warp arithmetic as store_kv's, so the bytes are the same.
void CudaBackend::store_kv_batch(std::span<const StoreKvParams> entries) {
  OpTimer timer(*this, "store_kv_batch");
  constexpr const char* kOp = "store_kv_batch";
  size_t i = 0;
  while (i < entries.size()) {
    const StoreKvParams& first = entries[i];
    auto check = [&](const StoreKvParams& e) {
      check_on(*this, kOp, "k", e.k);
      check_on(*this, kOp, "v", e.v);
      check_on(*this, kOp, "positions", e.positions);
      check_on(*this, kOp, "cache_k", e.cache_k);
      check_on(*this, kOp, "cache_v", e.cache_v);
      return ops::check_store_kv(kOp, e.k, e.v, e.positions, e.cache_k, e.cache_v);
    };
    const ops::StoreKvDims d0 = check(first);
    // Entry j continues the first's rows: its tensors start j tensors further.
    auto follows = [&](const Tensor& t0, const Tensor& t, size_t j) {
      return t.data() == static_cast<const char*>(t0.data()) + j * t0.nbytes();
    };
    size_t n = 1;
    while (i + n < entries.size() && n < static_cast<size_t>(kStoreBatchSeqs)) {
      const StoreKvParams& e = entries[i + n];
      check(e);
      if (e.k.shape() != first.k.shape() || e.cache_k.dtype() != first.cache_k.dtype() ||
          !follows(first.k, e.k, n) || !follows(first.v, e.v, n) ||
          !follows(first.positions, e.positions, n)) {
        break;
      }
      ++n;
    }
    if (n < 2 || d0.rows == 0 || d0.row_floats == 0) {
      store_kv(first.k, first.v, first.positions, first.cache_k, first.cache_v);
      ++i;
      continue;
    }
    const int64_t heads = first.k.dim(1);
    const int64_t d = first.k.dim(2);
    const int64_t rows = static_cast<int64_t>(n) * d0.rows;
    with_store_conv(first.cache_k.dtype(), [&](auto conv) {
      using Conv = decltype(conv);
      KvStoreDests<typename Conv::Elem, kStoreBatchSeqs> dests{};
      for (size_t j = 0; j < n; ++j) {
        const StoreKvParams& e = entries[i + j];
        dests.seq[j] = store_dest<Conv>(e.cache_k, e.cache_v, e.cache_k.dim(0));
      }
      launch_pdl(store_kv_kernel<Conv, kStoreBatchSeqs>, grid_for(rows * heads, kWarps), kThreads,
                 0, stream(), "store_kv_kernel", first.k.data_as<const float>(),
                 first.v.data_as<const float>(), first.positions.data_as<const int32_t>(), dests,
                 rows, d0.rows, heads, d);
    });
    i += n;
  }
}

// See Backend::convert. f32 <-> bf16 by convert_kernel, f32 <-> fp8 (one scale
// per row of the last dimension) by quantize_rows_fp8_kernel /
// dequantize_fp8_kernel; equal dtypes copy (fp8: the scales too).
void CudaBackend::convert(const Tensor& src, const Tensor& dst) {
  constexpr const char* kOp = "convert";
  check_on(*this, kOp, "src", src);
  check_on(*this, kOp, "dst", dst);
  if (src.shape() != dst.shape()) {
    fail("{}: src {} and dst {} must have the same shape", kOp, src.describe(), dst.describe());
  }
  auto scales = [&](const char* name, const Tensor& t) {
    if (t.scale_data() == nullptr)
      fail("{}: {} {} is f8e4m3 without its per-row scales", kOp, name, t.describe());
    return t.scales();
  };
  if (src.dtype() == dst.dtype()) {
    copy(src, dst);
    if (src.dtype() == DType::kF8E4M3) copy(scales("src", src), scales("dst", dst));
    return;
  }
  const int64_t n = src.numel();
  const bool fp8 = src.dtype() == DType::kF8E4M3 || dst.dtype() == DType::kF8E4M3;
  if (fp8) {
    const bool to_fp8 = src.dtype() == DType::kF32 && dst.dtype() == DType::kF8E4M3;
    if (!to_fp8 && !(src.dtype() == DType::kF8E4M3 && dst.dtype() == DType::kF32)) {
      fail("{}: no conversion from src {} to dst {} (f32 <-> bf16 and f32 <-> f8e4m3 only)", kOp,
           src.describe(), dst.describe());
    }
    check_no_alias(kOp, "dst", dst, "src", src);
    const Tensor sc = scales(to_fp8 ? "dst" : "src", to_fp8 ? dst : src);
    const int64_t rows = sc.numel();
    if (n == 0 || rows == 0) return;
    const int64_t d = n / rows;
    OpTimer timer(*this, "convert");
    if (to_fp8) {
      launch_pdl(quantize_rows_fp8_kernel, grid_for(rows, kWarps), kThreads, 0, stream(),
                 "quantize_rows_fp8_kernel", src.data_as<const float>(), dst.data_as<uint8_t>(),
                 sc.data_as<float>(), rows, d);
    } else {
      launch_pdl(dequantize_fp8_kernel, grid_for(n, kThreads), kThreads, 0, stream(),
                 "dequantize_fp8_kernel", src.data_as<const uint8_t>(), sc.data_as<const float>(),
                 dst.data_as<float>(), n, d);
    }
    return;
  }
  const bool to_bf16 = src.dtype() == DType::kF32 && dst.dtype() == DType::kBF16;
  if (!to_bf16 && !(src.dtype() == DType::kBF16 && dst.dtype() == DType::kF32)) {
    fail("{}: no conversion from src {} to dst {} (f32 <-> bf16 and f32 <-> f8e4m3 only)", kOp,
         src.describe(), dst.describe());
  }
  check_no_alias(kOp, "dst", dst, "src", src);
  if (n == 0) return;
  OpTimer timer(*this, "convert");
  launch_pdl(to_bf16 ? convert_kernel<true> : convert_kernel<false>, grid_for(n, kThreads),
             kThreads, 0, stream(), "convert_kernel", src.data(), dst.data(), n);
}

// rms_norm_add(x, weight, eps, residual, post_scale) then
// rms_norm(residual, next_weight, eps, next_out) in one kernel, bit for bit.
// x, residual, next_out f32 [..., D]; weight, next_weight [D] f32|bf16|f16 or
// empty; residual is a different buffer from x, next_out overlaps neither.
// Rows up to 1024 wide get a warp each (8 rows per 256-thread block), wider
// rows a kNormBlockThreads block, as rms_norm chooses.
void CudaBackend::rms_norm_add_norm(const Tensor& x, const Tensor& weight, float eps,
                                    const Tensor& residual, float post_scale,
                                    const Tensor& next_weight, const Tensor& next_out) {
  OpTimer timer(*this, "rms_norm_add_norm");
  constexpr const char* kOp = "rms_norm_add_norm";
  check_on(*this, kOp, "x", x);
  check_on(*this, kOp, "residual", residual);
  check_on(*this, kOp, "next_out", next_out);
  check_dtype(kOp, "x", x, DType::kF32);
  check_dtype(kOp, "residual", residual, DType::kF32);
  check_dtype(kOp, "next_out", next_out, DType::kF32);
  check_same_shape(kOp, "x", x, "residual", residual);
  check_same_shape(kOp, "residual", residual, "next_out", next_out);
  check_exact_alias(kOp, "residual", residual, "x", x);
  check_no_alias(kOp, "next_out", next_out, "x", x);
  check_no_alias(kOp, "next_out", next_out, "residual", residual);
  if (x.rank() < 1) fail("rms_norm_add_norm: x must have rank >= 1, got {}", x.describe());
  const int64_t d = x.dim(-1);
  if (d == 0 || x.numel() == 0) return;
  for (const auto& [name, w] :
       {std::pair<const char*, const Tensor*>{"weight", &weight}, {"next_weight", &next_weight}}) {
    if (w->empty()) continue;
    check_on(*this, kOp, name, *w);
    check_float(kOp, name, *w);
    if (w->rank() != 1 || w->dim(0) != d) {
      fail("rms_norm_add_norm: {} {} must be [{}] to match the last dimension of x {}", name,
           w->describe(), d, x.describe());
    }
  }
  if (x.data() == residual.data()) {
    fail("rms_norm_add_norm: x {} and residual {} must be different buffers", x.describe(),
         residual.describe());
  }
  const int64_t rows = x.numel() / d;
  const DType wdt = weight.empty() ? DType::kF32 : weight.dtype();
  const DType ndt = next_weight.empty() ? DType::kF32 : next_weight.dtype();
  // next_out is what the products after this op read (the next layer's q/k/v,
  // the MLP): for a few rows (verify windows, batched rows) they read it as its
  // bf16 split, which is written here too, saving them a split kernel (one row
  // is split inside the decode product instead).
  __nv_bfloat16* split = nullptr;
  const int64_t split_row_chunks = split_chunks(d);
  if (rows > 1 && rows <= kInvariantRows) {
    split = static_cast<__nv_bfloat16*>(scratch(x_split_, mma_split_bytes(rows, d)));
    ready_split_ = {next_out.data(), rows, d, op_seq_, split};
  }
  with_float_dtype(wdt, [&](auto wtag) {
    with_float_dtype(ndt, [&](auto ntag) {
      constexpr DType kW = decltype(wtag)::value;
      constexpr DType kN = decltype(ntag)::value;
      with_norm_rows(d, [&](auto group, auto per) {
        constexpr int kGroup = decltype(group)::value;
        constexpr int kBlock = norm_block_threads(kGroup);
        launch_pdl(rms_norm_add_norm_kernel<kW, kN, kGroup, decltype(per)::value>,
                   grid_for(rows, kBlock / kGroup), kBlock, 0, stream(), "rms_norm_add_norm_kernel",
                   x.data_as<const float>(), weight.data(), eps, residual.data_as<float>(),
                   post_scale, next_weight.data(), next_out.data_as<float>(), rows, d, split,
                   split_row_chunks);
      });
    });
  });
}

// See AttentionInputsParams (engine/ops/backend.h). One launch of 256-thread
// blocks, one warp per (token, head) row of q and per (token, kv head) row of k
// (which also finishes that row of v and stores both in the cache). Head
// dimensions above 512 take the unfused composition (same results).
void CudaBackend::attention_inputs(const AttentionInputsParams& p) {
  constexpr const char* kOp = "attention_inputs";
  const ops::AttentionInputsDims dims = ops::check_attention_inputs(p);
  check_on(*this, kOp, "q", p.q);
  check_on(*this, kOp, "q_norm", p.q_norm);
  check_on(*this, kOp, "positions", p.positions);
  check_on(*this, kOp, "inv_freq", p.inv_freq);
  // The kernel reads positions, inv_freq and the norms while it writes the rows.
  const auto check_apart_from_inputs = [&](const char* name, const Tensor& out) {
    check_no_alias(kOp, name, out, "positions", p.positions);
    check_no_alias(kOp, name, out, "inv_freq", p.inv_freq);
    check_no_alias(kOp, name, out, "q_norm", p.q_norm);
    if (dims.has_k) check_no_alias(kOp, name, out, "k_norm", p.k_norm);
  };
  check_apart_from_inputs("q", p.q);
  if (dims.has_k) {
    check_on(*this, kOp, "k", p.k);
    check_on(*this, kOp, "k_norm", p.k_norm);
    check_on(*this, kOp, "v", p.v);
    check_apart_from_inputs("k", p.k);
    check_apart_from_inputs("v", p.v);
  }
  if (dims.has_cache) {
    check_on(*this, kOp, "cache_k", p.cache_k);
    check_on(*this, kOp, "cache_v", p.cache_v);
    check_apart_from_inputs("cache_k", p.cache_k);
    check_apart_from_inputs("cache_v", p.cache_v);
    // Warps write cache rows while other warps still read q, k and v rows.
    check_no_alias(kOp, "cache_k", p.cache_k, "q", p.q);
    check_no_alias(kOp, "cache_v", p.cache_v, "q", p.q);
    check_no_alias(kOp, "cache_k", p.cache_k, "v", p.v);
    check_no_alias(kOp, "cache_v", p.cache_v, "k", p.k);
  }
  if (dims.head_dim > kMaxHeadDim) {
    Backend::attention_inputs(p);
    return;
  }
  OpTimer timer(*this, "attention_inputs");
  const int64_t total_rows = dims.tokens * (dims.heads + dims.kv_heads);
  if (dims.head_dim == 0 || total_rows == 0) return;
  AttnInputsArgs a{};
  a.q = p.q.data_as<float>();
  a.q_norm = p.q_norm.data();
  a.positions = p.positions.data_as<const int32_t>();
  a.inv_freq = p.inv_freq.data_as<const float>();
  a.tokens = dims.tokens;
  a.heads = dims.heads;
  a.kv_heads = dims.has_k ? dims.kv_heads : 0;
  a.d = dims.head_dim;
  a.eps = p.eps;
  a.v_from_k = p.v_from_k;
  if (dims.has_k) {
    a.k = p.k.data_as<float>();
    a.k_norm = p.k_norm.data();
    a.v = p.v.data_as<float>();
  }
  // A bf16 or fp8 cache: the kernel finishes the rows, then store_kv rounds
  // them into the cache (the same bits as the composition: store_kv of the
  // finished rows).
  const bool bf16_cache = dims.has_cache && p.cache_k.dtype() != DType::kF32;
  if (dims.has_cache && !bf16_cache) {
    a.cache_k = p.cache_k.data_as<float>();
    a.cache_v = p.cache_v.data_as<float>();
    a.cache_rows = p.cache_k.dim(0);
  }
  const DType qdt = p.q_norm.dtype();
  const DType kdt = dims.has_k ? p.k_norm.dtype() : qdt;
  with_float_dtype(qdt, [&](auto qtag) {
    with_float_dtype(kdt, [&](auto ktag) {
      constexpr DType kQ = decltype(qtag)::value;
      constexpr DType kK = decltype(ktag)::value;
      launch_pdl(attention_inputs_kernel<kQ, kK>, grid_for(total_rows, kWarps), kThreads, 0,
                 stream(), "attention_inputs_kernel", a);
    });
  });
  if (bf16_cache) store_kv(p.k, p.v, p.positions, p.cache_k, p.cache_v);
}

}  // namespace specula::cuda
