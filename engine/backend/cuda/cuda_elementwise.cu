// SPDX-License-Identifier: Apache-2.0
// Row-wise and element-wise ops on the GPU: rms_norm, rope, activations,
// arithmetic, soft-capping, argmax, top-k, softmax, transpose01, gather_rows,
// fill_scatter_rows, logprob_rows and fill_uniform.
//
// Numerics follow the CPU reference (engine/backend/cpu/cpu_elementwise.cpp)
// operation for operation. Products and sums that the CPU writes as separate
// f32 operations use the __f*_rn intrinsics, which nvcc never contracts into an
// FMA, so those ops round exactly as the CPU does; only the libm functions
// (tanhf, sincosf) may differ by an ulp or two. Sums the CPU keeps in double
// are kept in double here, so the order of the sum does not show in the f32
// result. Row kernels give each row a fixed group of threads (chosen from the
// row length alone), so a row's result never depends on how many rows a call has.
#include <cuda_fp16.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <type_traits>

#include "engine/backend/cuda/cuda_backend.h"
#include "engine/backend/cuda/cuda_device_common.cuh"
#include "engine/backend/cuda/cuda_launch.cuh"
#include "engine/ops/uniform_hash.h"

namespace specula::cuda {
namespace {

constexpr int kThreads = 256;
// Grid-stride kernels never launch more blocks than this; each thread loops.
constexpr unsigned kMaxBlocks = 65535;

unsigned grid_for(int64_t n, int threads) {
  const unsigned b = blocks_for(n, threads);
  return b < kMaxBlocks ? b : kMaxBlocks;
}

// ---- Host-side argument checks (same wording as the CPU backend's). ----

// An element-wise op whose f32 output may be exactly its f32 input.
void check_unary(const CudaBackend& be, const char* op, const Tensor& x, const Tensor& out) {
  check_on(be, op, "x", x);
  check_on(be, op, "out", out);
  check_dtype(op, "x", x, DType::kF32);
  check_dtype(op, "out", out, DType::kF32);
  check_same_shape(op, "x", x, "out", out);
  check_exact_alias(op, "out", out, "x", x);
}

void check_binary(const CudaBackend& be, const char* op, const char* a_name, const Tensor& a,
                  const char* b_name, const Tensor& b, const Tensor& out) {
  check_on(be, op, a_name, a);
  check_on(be, op, b_name, b);
  check_on(be, op, "out", out);
  check_dtype(op, a_name, a, DType::kF32);
  check_dtype(op, b_name, b, DType::kF32);
  check_dtype(op, "out", out, DType::kF32);
  check_same_shape(op, a_name, a, b_name, b);
  check_same_shape(op, a_name, a, "out", out);
  check_exact_alias(op, "out", out, a_name, a);
  check_exact_alias(op, "out", out, b_name, b);
}

// Calls f(std::integral_constant<DType, d>{}) for the float dtype d of a tensor
// already checked with check_float, so kernels are instantiated per dtype.
// ---- Device helpers. ----

// f32_to_bf16 of engine/core/dtype.h: round to nearest even, NaN -> 0x7fc0.
__device__ __forceinline__ uint16_t bf16_bits(float f) {
  uint32_t bits = __float_as_uint(f);
  if ((bits & 0x7f800000u) == 0x7f800000u && (bits & 0x007fffffu)) return 0x7fc0;
  bits += 0x7fffu + ((bits >> 16) & 1u);
  return static_cast<uint16_t>(bits >> 16);
}

// f32_to_f16 of engine/core/dtype.cpp, the same integer steps (round to nearest
// even, subnormals, overflow to inf, NaN keeps its sign and becomes quiet).
__device__ __forceinline__ uint16_t f16_bits(float f) {
  const uint32_t bits = __float_as_uint(f);
  const uint32_t sign = (bits >> 16) & 0x8000u;
  const int exponent = static_cast<int>((bits >> 23) & 0xff) - 127 + 15;
  uint32_t mantissa = bits & 0x7fffffu;
  if (((bits >> 23) & 0xff) == 0xff) {
    return static_cast<uint16_t>(sign | 0x7c00u | (mantissa ? 0x200u : 0u));
  }
  if (exponent >= 31) return static_cast<uint16_t>(sign | 0x7c00u);
  if (exponent <= 0) {
    if (exponent < -10) return static_cast<uint16_t>(sign);
    mantissa |= 0x800000u;
    const int shift = 14 - exponent;
    uint32_t half = mantissa >> shift;
    const uint32_t rem = mantissa & ((1u << shift) - 1);
    const uint32_t mid = 1u << (shift - 1);
    if (rem > mid || (rem == mid && (half & 1u))) ++half;
    return static_cast<uint16_t>(sign | half);
  }
  uint32_t half = sign | (static_cast<uint32_t>(exponent) << 10) | (mantissa >> 13);
  const uint32_t rem = mantissa & 0x1fffu;
  if (rem > 0x1000u || (rem == 0x1000u && (half & 1u))) ++half;
  return static_cast<uint16_t>(half);
}

// Sum over the whole block (blockDim.x == kThreads) in a fixed order
// (fixed_block_sum, cuda_device_common.cuh). All threads must call it.
__device__ __forceinline__ double block_sum(double v, double* partials) {
  return fixed_block_sum<kThreads>(v, partials);
}

// Largest value, ignoring NaN, as the CPU's std::max(m, v) (which keeps m when
// v is NaN). Starting from -inf, a NaN never becomes the running maximum.
__device__ __forceinline__ float max_keep(float m, float v) {
  return m < v ? v : m;
}

__device__ __forceinline__ float block_max(float v, float* partials) {
  for (int m = 16; m > 0; m >>= 1) v = max_keep(v, __shfl_xor_sync(0xffffffffu, v, m));
  const int warp = threadIdx.x / 32;
  if (threadIdx.x % 32 == 0) partials[warp] = v;
  __syncthreads();
  float total = -std::numeric_limits<float>::infinity();
  for (int w = 0; w < kThreads / 32; ++w) total = max_keep(total, partials[w]);
  __syncthreads();
  return total;
}

// ---- rms_norm ----

// kGroup threads (32: one warp of a kThreads block, or kNormBlockThreads: the
// whole block) normalise one row of d
// floats; the sum of squares is in double, like the CPU's, and rounded once.
// Row r is handled by the same kGroup-thread pattern whatever `rows` is. The
// arithmetic is cuda_device_common.cuh's rms_* helpers, shared with cuda_fused.cu.
// kPer > 0 (rows of at most kPer · kGroup elements): each thread keeps its
// elements in registers and loads the weight before pdl_wait(), so a row costs
// one memory round trip instead of one per element (cuda_fused.cu's
// rms_norm_add_norm_kernel explains why that matters at one row); same sums in
// the same order, same bits.
template <DType kDt, int kGroup, int kPer>
__global__ void __launch_bounds__(norm_block_threads(kGroup))
    rms_norm_kernel(const float* x, const void* weight, float eps, float* out, int64_t rows,
                    int64_t d, float* residual, float post_scale) {
  // A programmatic dependent (launch_pdl): waits for its predecessor before
  // touching anything but the weight, and lets the next kernel start its prologue.
  pdl_launch_dependents();
  constexpr int kBlock = norm_block_threads(kGroup);
  constexpr int kRowsPerBlock = kBlock / kGroup;
  constexpr int kHeld = kPer > 0 ? kPer : 1;
  __shared__ double partials[kBlock / 32];
  const int lane = threadIdx.x % kGroup;
  const int group = threadIdx.x / kGroup;
  const bool has_w = weight != nullptr;
  float w[kHeld];
  if constexpr (kPer > 0) load_held<kPer, kGroup, kDt>(weight, lane, static_cast<int>(d), w);
  pdl_wait();
  // The loop bound depends only on blockIdx, so block-wide barriers inside are uniform.
  for (int64_t base = static_cast<int64_t>(blockIdx.x) * kRowsPerBlock; base < rows;
       base += static_cast<int64_t>(gridDim.x) * kRowsPerBlock) {
    const int64_t r = base + group;
    const bool active = r < rows;
    const float* xr = x + (active ? r : 0) * d;
    double sum = 0.0;
    if constexpr (kPer > 0) {
      const int n = static_cast<int>(d);  // <= kPer · kGroup
      float xv[kPer], rv[kPer];
      load_held<kPer, kGroup>(active ? xr : nullptr, lane, n, xv);
      load_held<kPer, kGroup>(active && residual != nullptr ? residual + r * d : nullptr, lane, n,
                              rv);
#pragma unroll
      for (int i = 0; i < kPer; ++i) {
        if (lane + i * kGroup < n) rms_accumulate(sum, xv[i]);
      }
      sum = rms_group_sum<kGroup, kBlock>(sum, partials);
      if (!active) continue;
      const float inv = rms_inv(sum, d, eps);
#pragma unroll
      for (int i = 0; i < kPer; ++i) {
        const int64_t c = lane + static_cast<int64_t>(i) * kGroup;
        if (c >= d) continue;
        const float v = rms_apply_loaded(xv[i], inv, has_w, w[i]);
        if (residual == nullptr) {
          out[r * d + c] = v;
        } else {
          residual[r * d + c] = residual_update(rv[i], v, post_scale);
        }
      }
    } else {
      if (active) {
        for (int64_t j = lane; j < d; j += kGroup) rms_accumulate(sum, xr[j]);
      }
      sum = rms_group_sum<kGroup, kBlock>(sum, partials);
      if (!active) continue;
      const float inv = rms_inv(sum, d, eps);
      float* orow = out + r * d;
      // Every element is read (above) and written (here) by the same thread, after
      // the reduction, so out may be x itself.
      if (residual == nullptr) {
        for (int64_t c = lane; c < d; c += kGroup) orow[c] = rms_apply<kDt>(xr[c], inv, weight, c);
      } else {
        // rms_norm_add: the same roundings as rms_norm, then add, then scale.
        float* rrow = residual + r * d;
        for (int64_t c = lane; c < d; c += kGroup) {
          rrow[c] = residual_update(rrow[c], rms_apply<kDt>(xr[c], inv, weight, c), post_scale);
        }
      }
    }
  }
}

// rms_norm_kernel over x f32 [..., d] (d = x's last dimension > 0, checked by
// the caller), in the thread pattern with_norm_rows picks for d: writes
// out = rms_norm(x)·weight, or with a residual (out null) updates
// residual = (residual + rms_norm(x)·weight)·post_scale.
void launch_rms_norm(const Tensor& x, const Tensor& weight, float eps, float* out, float* residual,
                     float post_scale, const char* name, cudaStream_t stream) {
  const int64_t d = x.dim(-1);
  const int64_t rows = x.numel() / d;
  const DType wdt = weight.empty() ? DType::kF32 : weight.dtype();
  with_float_dtype(wdt, [&](auto tag) {
    constexpr DType kDt = decltype(tag)::value;
    with_norm_rows(d, [&](auto group, auto per) {
      constexpr int kGroup = decltype(group)::value;
      constexpr int kBlock = norm_block_threads(kGroup);
      launch_pdl(rms_norm_kernel<kDt, kGroup, decltype(per)::value>,
                 grid_for(rows, kBlock / kGroup), kBlock, 0, stream, name, x.data_as<const float>(),
                 weight.data(), eps, out, rows, d, residual, post_scale);
    });
  });
}

// ---- rope ----

// One thread per (row, head, pair j): rotates (j, j + half) in place by
// float(position) * inv_freq[j], in f32 as the CPU (and HF) do (rope_rotate,
// shared with cuda_fused.cu).
__global__ void rope_kernel(float* x, const int32_t* positions, const float* inv_freq,
                            int64_t heads, int64_t half, int64_t total) {
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < total;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t j = i % half;
    const int64_t row_head = i / half;  // m * heads + h
    const int64_t m = row_head / heads;
    float* row = x + row_head * 2 * half;
    const float2 y = rope_rotate(row[j], row[j + half], positions[m], inv_freq[j]);
    row[j] = y.x;
    row[j + half] = y.y;
  }
}

// ---- element-wise maps ----
// Pointers are not __restrict__: out may be an input.

template <typename Op>
__global__ void map_unary_kernel(const float* x, float* out, int64_t n, Op op) {
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    out[i] = op(x[i]);
  }
}

template <typename Op>
__global__ void map_binary_kernel(const float* a, const float* b, float* out, int64_t n, Op op) {
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    out[i] = op(a[i], b[i]);
  }
}

struct GeluOp {
  __device__ float operator()(float v) const { return gelu_tanh(v); }
};
struct GeluMulOp {
  __device__ float operator()(float g, float u) const { return __fmul_rn(gelu_tanh(g), u); }
};
struct AddOp {
  __device__ float operator()(float u, float v) const { return __fadd_rn(u, v); }
};
struct MulOp {
  __device__ float operator()(float u, float v) const { return __fmul_rn(u, v); }
};
struct ScaleOp {
  float s;
  __device__ float operator()(float v) const { return __fmul_rn(v, s); }
};
struct SoftcapOp {
  float cap;
  // Same order as HF and the CPU: divide, tanh, multiply.
  __device__ float operator()(float v) const { return __fmul_rn(tanhf(__fdiv_rn(v, cap)), cap); }
};

template <typename Op>
void launch_unary(cudaStream_t stream, const Tensor& x, const Tensor& out, Op op,
                  const char* what) {
  const int64_t n = x.numel();
  if (n == 0) return;
  map_unary_kernel<<<grid_for(n, kThreads), kThreads, 0, stream>>>(x.data_as<const float>(),
                                                                   out.data_as<float>(), n, op);
  check_cuda(cudaGetLastError(), what);
}

template <typename Op>
void launch_binary(cudaStream_t stream, const Tensor& a, const Tensor& b, const Tensor& out, Op op,
                   const char* what) {
  const int64_t n = a.numel();
  if (n == 0) return;
  map_binary_kernel<<<grid_for(n, kThreads), kThreads, 0, stream>>>(
      a.data_as<const float>(), b.data_as<const float>(), out.data_as<float>(), n, op);
  check_cuda(cudaGetLastError(), what);
}

// ---- argmax_rows ----

// Running best of a row: largest value with the lowest index on ties (NaN is
// tracked separately). idx == n means "nothing yet" and loses every tie.
struct ArgBest {
  float value;
  int64_t idx;
};

__device__ __forceinline__ ArgBest better(ArgBest a, ArgBest b) {
  if (b.value > a.value || (b.value == a.value && b.idx < a.idx)) return b;
  return a;
}

// The CPU scans left to right, stops at the first NaN and otherwise keeps the
// first strict maximum; equivalently: the first NaN if the row has one, else
// the lowest index holding the maximum. That answer does not depend on how the
// row is split, so a row is cut into `parts` slices reduced by separate blocks
// (a 262,144-wide vocabulary row in one block took ~190 us, latency bound), and
// a second kernel merges the slices' partials.
struct ArgPartial {
  float value;
  int64_t idx;
  int64_t first_nan;
};

// Grid (parts, rows): block (p, r) reduces slice p of row r to partials[r·parts + p].
__global__ void __launch_bounds__(kThreads)
    argmax_slices_kernel(const float* x, ArgPartial* partials, int64_t n, int parts,
                         int64_t slice) {
  __shared__ ArgPartial part[kThreads / 32];
  const int warp = threadIdx.x / 32;
  const int64_t r = blockIdx.y;
  const float* row = x + r * n;
  const int64_t begin = static_cast<int64_t>(blockIdx.x) * slice;
  const int64_t end = min(n, begin + slice);
  ArgBest best{-std::numeric_limits<float>::infinity(), n};
  int64_t first_nan = n;
  for (int64_t j = begin + threadIdx.x; j < end; j += kThreads) {
    const float v = row[j];
    if (isnan(v)) {
      if (j < first_nan) first_nan = j;
    } else {
      best = better(best, ArgBest{v, j});
    }
  }
  for (int m = 16; m > 0; m >>= 1) {
    const ArgBest other{__shfl_xor_sync(0xffffffffu, best.value, m),
                        __shfl_xor_sync(0xffffffffu, best.idx, m)};
    best = better(best, other);
    const int64_t other_nan = __shfl_xor_sync(0xffffffffu, first_nan, m);
    if (other_nan < first_nan) first_nan = other_nan;
  }
  if (threadIdx.x % 32 == 0) part[warp] = ArgPartial{best.value, best.idx, first_nan};
  __syncthreads();
  if (threadIdx.x == 0) {
    ArgPartial total = part[0];
    for (int w = 1; w < kThreads / 32; ++w) {
      const ArgBest b =
          better(ArgBest{total.value, total.idx}, ArgBest{part[w].value, part[w].idx});
      total.value = b.value;
      total.idx = b.idx;
      if (part[w].first_nan < total.first_nan) total.first_nan = part[w].first_nan;
    }
    partials[r * parts + blockIdx.x] = total;
  }
}

// One thread per row: merges the row's `parts` partials (order does not matter
// for the answer; they are taken in slice order).
__global__ void argmax_merge_kernel(const ArgPartial* partials, int32_t* out, int64_t rows,
                                    int64_t n, int parts) {
  const int64_t r = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (r >= rows) return;
  const ArgPartial* p = partials + r * parts;
  ArgBest total{p[0].value, p[0].idx};
  int64_t nan_idx = p[0].first_nan;
  for (int i = 1; i < parts; ++i) {
    total = better(total, ArgBest{p[i].value, p[i].idx});
    if (p[i].first_nan < nan_idx) nan_idx = p[i].first_nan;
  }
  out[r] = static_cast<int32_t>(nan_idx < n ? nan_idx : total.idx);
}

// ---- softmax_rows ----

// One block per row: max (ignoring NaN, as std::max), e = exp(x - max) in f32
// written to out, the sum of the f32 e in double, then out /= float(sum). A row
// whose max is -inf (all -inf, or NaN and -inf only) becomes zeros, as on the CPU.
__global__ void __launch_bounds__(kThreads)
    softmax_rows_kernel(const float* x, float* out, int64_t rows, int64_t n) {
  __shared__ float max_partials[kThreads / 32];
  __shared__ double sum_partials[kThreads / 32];
  for (int64_t r = blockIdx.x; r < rows; r += gridDim.x) {
    const float* xr = x + r * n;
    float* orow = out + r * n;
    float m = -std::numeric_limits<float>::infinity();
    for (int64_t j = threadIdx.x; j < n; j += kThreads) m = max_keep(m, xr[j]);
    m = block_max(m, max_partials);
    if (m == -std::numeric_limits<float>::infinity()) {
      for (int64_t j = threadIdx.x; j < n; j += kThreads) orow[j] = 0.0f;
      continue;  // uniform: every thread saw the same m
    }
    // Each element is read, then written, by one thread: out may be x.
    double sum = 0.0;
    for (int64_t j = threadIdx.x; j < n; j += kThreads) {
      const float e = exp_f32(__fsub_rn(xr[j], m));
      orow[j] = e;
      sum += e;
    }
    const auto denom = static_cast<float>(block_sum(sum, sum_partials));
    for (int64_t j = threadIdx.x; j < n; j += kThreads) orow[j] = __fdiv_rn(orow[j], denom);
  }
}

// ---- transpose01 ----

// One thread per output element out[b, a, c] = x[a, b, c].
__global__ void transpose01_kernel(const float* __restrict__ x, float* __restrict__ out, int64_t A,
                                   int64_t B, int64_t C) {
  const int64_t total = A * B * C;
  for (int64_t o = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; o < total;
       o += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t c = o % C;
    const int64_t ba = o / C;  // b * A + a
    const int64_t a = ba % A;
    const int64_t b = ba / A;
    out[o] = x[(a * B + b) * C + c];
  }
}

// ---- top_k_rows ----

// A row element as one 64-bit key whose order is torch.topk's order: the high
// half orders the values (every NaN above +inf, -0 equal to +0), the low half
// is 0xfffffffe - index so that equal values put the lower index first (and no
// key reaches ~0, the first pass's bound; none is 0 either). Keys of one row
// are distinct, so the i-th largest is the largest key below the (i-1)-th.
__device__ __forceinline__ unsigned long long top_k_key(float v, int64_t j) {
  uint32_t high;
  if (isnan(v)) {
    high = 0xffffffffu;
  } else {
    uint32_t bits = __float_as_uint(v == 0.0f ? 0.0f : v);
    high = (bits & 0x80000000u) ? ~bits : (bits | 0x80000000u);
  }
  return (static_cast<unsigned long long>(high) << 32) | (0xfffffffeu - static_cast<uint32_t>(j));
}

// One block per row, k passes: each finds the largest key below the last one.
__global__ void __launch_bounds__(kThreads)
    top_k_rows_kernel(const float* __restrict__ x, int32_t* __restrict__ out, int64_t n,
                      int64_t k) {
  __shared__ unsigned long long warp_best[kThreads / 32];
  const float* row = x + static_cast<int64_t>(blockIdx.x) * n;
  int32_t* o = out + static_cast<int64_t>(blockIdx.x) * k;
  unsigned long long last = ~0ull;  // above every key
  for (int64_t i = 0; i < k; ++i) {
    unsigned long long best = 0;
    for (int64_t j = threadIdx.x; j < n; j += kThreads) {
      const unsigned long long key = top_k_key(row[j], j);
      if (key < last && key > best) best = key;
    }
    for (int m = 16; m > 0; m >>= 1) {
      const unsigned long long other = __shfl_xor_sync(0xffffffffu, best, m);
      if (other > best) best = other;
    }
    if (threadIdx.x % 32 == 0) warp_best[threadIdx.x / 32] = best;
    __syncthreads();
    best = warp_best[0];
    for (int w = 1; w < kThreads / 32; ++w) best = warp_best[w] > best ? warp_best[w] : best;
    __syncthreads();  // every thread has read warp_best before the next pass writes it
    if (threadIdx.x == 0) o[i] = static_cast<int32_t>(0xfffffffeu - static_cast<uint32_t>(best));
    last = best;
  }
}

// ---- logprob_rows ----

// One block per output row m of logprob_rows: the row's max and Σ exp(x - max)
// (in double, as the CPU), the candidates' logprobs, then the top n by n passes
// of top_k_rows' keys, each the largest key below the last.
__global__ void __launch_bounds__(kThreads)
    logprob_rows_kernel(const float* __restrict__ logits, const int32_t* __restrict__ rows,
                        const int32_t* __restrict__ ids, float* __restrict__ logprobs,
                        int32_t* __restrict__ top_ids, float* __restrict__ top_values, int64_t R,
                        int64_t V, int64_t C, int64_t n) {
  __shared__ float max_partials[kThreads / 32];
  __shared__ double sum_partials[kThreads / 32];
  __shared__ unsigned long long warp_best[kThreads / 32];
  const int64_t m = blockIdx.x;
  const int32_t r = rows[m];
  if (r < 0 || r >= R) return;  // uniform across the block
  const float* x = logits + static_cast<int64_t>(r) * V;
  float mx = -std::numeric_limits<float>::infinity();
  for (int64_t j = threadIdx.x; j < V; j += kThreads) mx = max_keep(mx, x[j]);
  mx = block_max(mx, max_partials);
  double sum = 0.0;
  for (int64_t j = threadIdx.x; j < V; j += kThreads) sum += exp_f32(__fsub_rn(x[j], mx));
  const auto log_sum = static_cast<float>(log(block_sum(sum, sum_partials)));
  for (int64_t c = threadIdx.x; c < C; c += kThreads) {
    const int32_t id = ids[m * C + c];
    logprobs[m * C + c] = id >= 0 && id < V ? __fsub_rn(__fsub_rn(x[id], mx), log_sum)
                                            : std::numeric_limits<float>::quiet_NaN();
  }
  unsigned long long last = ~0ull;  // above every key
  for (int64_t i = 0; i < n; ++i) {
    unsigned long long best = 0;
    for (int64_t j = threadIdx.x; j < V; j += kThreads) {
      const unsigned long long key = top_k_key(x[j], j);
      if (key < last && key > best) best = key;
    }
    for (int s = 16; s > 0; s >>= 1) {
      const unsigned long long other = __shfl_xor_sync(0xffffffffu, best, s);
      if (other > best) best = other;
    }
    if (threadIdx.x % 32 == 0) warp_best[threadIdx.x / 32] = best;
    __syncthreads();
    best = warp_best[0];
    for (int w = 1; w < kThreads / 32; ++w) best = warp_best[w] > best ? warp_best[w] : best;
    __syncthreads();  // every thread has read warp_best before the next pass writes it
    if (threadIdx.x == 0) {
      const auto id = static_cast<int32_t>(0xfffffffeu - static_cast<uint32_t>(best));
      top_ids[m * n + i] = id;
      top_values[m * n + i] = __fsub_rn(__fsub_rn(x[id], mx), log_sum);
    }
    last = best;
  }
}

// ---- fill_scatter_rows ----

// The smallest non-NaN value of a row of n (+inf when there is none), the same
// on every block that asks: min is exact, so the order of the scan is free.
__device__ float row_min_skip_nan(const float* __restrict__ v, int64_t n) {
  __shared__ float warp_min[kThreads / 32];
  float m = std::numeric_limits<float>::infinity();
  for (int64_t j = threadIdx.x; j < n; j += kThreads) {
    const float x = v[j];
    if (x < m) m = x;
  }
  for (int s = 16; s > 0; s >>= 1) m = fminf(m, __shfl_xor_sync(0xffffffffu, m, s));
  if (threadIdx.x % 32 == 0) warp_min[threadIdx.x / 32] = m;
  __syncthreads();
  m = warp_min[0];
  for (int w = 1; w < kThreads / 32; ++w) m = fminf(m, warp_min[w]);
  return m;
}

constexpr int64_t kFillChunk = 8192;  // columns each block of fill_rows_kernel writes

// Grid (chunks, rows): block (c, r) writes min(values[r]) - 1 over its chunk of row r.
__global__ void __launch_bounds__(kThreads)
    fill_rows_kernel(const float* __restrict__ values, float* __restrict__ out, int64_t n,
                     int64_t width) {
  const int64_t r = blockIdx.y;
  const float fill = __fsub_rn(row_min_skip_nan(values + r * n, n), 1.0f);
  const int64_t begin = static_cast<int64_t>(blockIdx.x) * kFillChunk;
  const int64_t end = min(width, begin + kFillChunk);
  float* o = out + r * width;
  for (int64_t j = begin + threadIdx.x; j < end; j += kThreads) o[j] = fill;
}

// Grid rows: out[r, ids[r, j]] = values[r, j] (after fill_rows_kernel).
__global__ void __launch_bounds__(kThreads)
    scatter_rows_kernel(const float* __restrict__ values, const int32_t* __restrict__ ids,
                        float* __restrict__ out, int64_t n, int64_t width) {
  const int64_t r = blockIdx.x;
  for (int64_t j = threadIdx.x; j < n; j += kThreads) {
    const int32_t id = ids[r * n + j];
    if (id >= 0 && id < width) out[r * width + id] = values[r * n + j];
  }
}

// ---- gather_rows ----

// Blocks stride over (row, piece) pairs, a piece being kGatherPiece 4-byte
// words of a row, so that a few wide rows (a vocabulary-wide logits row is
// 1 MB) spread over many SMs rather than one block each. An index outside
// [0, R) (a caller bug the CPU backend reports) leaves its row as it was
// rather than reading out of bounds.
constexpr int64_t kGatherPiece = 4096;
__global__ void gather_rows_kernel(const uint32_t* __restrict__ src,
                                   const int32_t* __restrict__ idx, uint32_t* __restrict__ out,
                                   int64_t rows, int64_t src_rows, int64_t row_words,
                                   int64_t pieces_per_row) {
  for (int64_t b = blockIdx.x; b < rows * pieces_per_row; b += gridDim.x) {
    const int64_t r = b / pieces_per_row;
    const int32_t from = idx[r];
    if (from < 0 || from >= src_rows) continue;
    const int64_t begin = (b % pieces_per_row) * kGatherPiece;
    const int64_t end = min(begin + kGatherPiece, row_words);
    const uint32_t* in = src + static_cast<int64_t>(from) * row_words;
    uint32_t* o = out + r * row_words;
    for (int64_t w = begin + threadIdx.x; w < end; w += blockDim.x) o[w] = in[w];
  }
}

// ---- fill_uniform ----

// Element i = uniform_at(seed, i, lo, hi) rounded to the tensor's dtype exactly
// as the CPU backend rounds it. 64-bit indices: weights reach ~3e10 elements.
template <DType kDt>
__global__ void fill_uniform_kernel(void* t, int64_t n, uint64_t seed, float lo, float hi) {
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const float v = uniform_at(seed, static_cast<uint64_t>(i), lo, hi);
    if constexpr (kDt == DType::kF32) {
      static_cast<float*>(t)[i] = v;
    } else if constexpr (kDt == DType::kBF16) {
      static_cast<uint16_t*>(t)[i] = bf16_bits(v);
    } else {
      static_cast<uint16_t*>(t)[i] = f16_bits(v);
    }
  }
}

}  // namespace

// RMSNorm over the last dimension. x, out f32 [..., D]; weight [D] f32|bf16|f16
// or empty (weightless); out may alias x. Rows up to 1024 wide get a warp each,
// wider rows a kNormBlockThreads block (the choice depends on D only).
void CudaBackend::rms_norm(const Tensor& x, const Tensor& weight, float eps, const Tensor& out) {
  OpTimer timer(*this, "rms_norm");
  constexpr const char* kOp = "rms_norm";
  check_unary(*this, kOp, x, out);
  if (x.rank() < 1) fail("rms_norm: x must have rank >= 1, got {}", x.describe());
  const int64_t d = x.dim(-1);
  if (d == 0 || x.numel() == 0) return;  // as the CPU: nothing to check the weight against
  if (!weight.empty()) {
    check_on(*this, kOp, "weight", weight);
    check_float(kOp, "weight", weight);
    if (weight.rank() != 1 || weight.dim(0) != d) {
      fail("rms_norm: weight {} must be [{}] to match the last dimension of x {}",
           weight.describe(), d, x.describe());
    }
  }
  launch_rms_norm(x, weight, eps, out.data_as<float>(), nullptr, 1.0f, "rms_norm_kernel", stream());
}

// residual = (residual + rms_norm(x)·weight) · post_scale in one kernel (x is
// left unchanged). Same roundings as rms_norm, add and scale in sequence.
void CudaBackend::rms_norm_add(const Tensor& x, const Tensor& weight, float eps,
                               const Tensor& residual, float post_scale) {
  OpTimer timer(*this, "rms_norm_add");
  constexpr const char* kOp = "rms_norm_add";
  check_unary(*this, kOp, x, residual);
  if (x.rank() < 1) fail("rms_norm_add: x must have rank >= 1, got {}", x.describe());
  const int64_t d = x.dim(-1);
  if (d == 0 || x.numel() == 0) return;
  if (!weight.empty()) {
    check_on(*this, kOp, "weight", weight);
    check_float(kOp, "weight", weight);
    if (weight.rank() != 1 || weight.dim(0) != d) {
      fail("rms_norm_add: weight {} must be [{}] to match the last dimension of x {}",
           weight.describe(), d, x.describe());
    }
  }
  if (x.data() == residual.data()) {
    fail("rms_norm_add: x {} and residual {} must be different buffers", x.describe(),
         residual.describe());
  }
  launch_rms_norm(x, weight, eps, nullptr, residual.data_as<float>(), post_scale,
                  "rms_norm_kernel (add)", stream());
}

// Rotate-half RoPE in place. x f32 [M, heads, D]; positions i32 [M] and
// inv_freq f32 [D/2] on the device.
void CudaBackend::rope(const Tensor& x, const Tensor& positions, const Tensor& inv_freq) {
  OpTimer timer(*this, "rope");
  constexpr const char* kOp = "rope";
  check_on(*this, kOp, "x", x);
  check_on(*this, kOp, "positions", positions);
  check_on(*this, kOp, "inv_freq", inv_freq);
  check_dtype(kOp, "x", x, DType::kF32);
  check_rank(kOp, "x", x, 3);
  check_dtype(kOp, "positions", positions, DType::kI32);
  check_dtype(kOp, "inv_freq", inv_freq, DType::kF32);
  const int64_t m_rows = x.dim(0);
  const int64_t heads = x.dim(1);
  const int64_t d = x.dim(2);
  if (d % 2 != 0) fail("rope: head dimension of x {} must be even", x.describe());
  const int64_t half = d / 2;
  if (positions.shape() != Shape({m_rows})) {
    fail("rope: positions {} must be i32[{}] for x {}", positions.describe(), m_rows, x.describe());
  }
  if (inv_freq.shape() != Shape({half})) {
    fail("rope: inv_freq {} must be f32[{}] (half the head dimension) for x {}",
         inv_freq.describe(), half, x.describe());
  }
  check_no_alias(kOp, "x", x, "positions", positions);
  check_no_alias(kOp, "x", x, "inv_freq", inv_freq);
  // The CPU backend's limit, kept so that both backends accept the same inputs.
  constexpr int64_t kMaxHalf = 1024;
  if (half > kMaxHalf) fail("rope: head dimension {} exceeds the supported {}", d, 2 * kMaxHalf);
  const int64_t total = m_rows * heads * half;
  if (total == 0) return;
  rope_kernel<<<grid_for(total, kThreads), kThreads, 0, stream()>>>(
      x.data_as<float>(), positions.data_as<const int32_t>(), inv_freq.data_as<const float>(),
      heads, half, total);
  check_cuda(cudaGetLastError(), "rope_kernel");
}

// out = gelu_tanh(gate) ⊙ up; f32, same shapes; out may alias gate or up.
void CudaBackend::gelu_mul(const Tensor& gate, const Tensor& up, const Tensor& out) {
  OpTimer timer(*this, "gelu_mul");
  check_binary(*this, "gelu_mul", "gate", gate, "up", up, out);
  launch_binary(stream(), gate, up, out, GeluMulOp{}, "gelu_mul kernel");
}

// out = gelu_tanh(x); f32; out may alias x.
void CudaBackend::gelu(const Tensor& x, const Tensor& out) {
  OpTimer timer(*this, "gelu");
  check_unary(*this, "gelu", x, out);
  launch_unary(stream(), x, out, GeluOp{}, "gelu kernel");
}

// out = a + b; f32, same shapes; out may alias a or b.
void CudaBackend::add(const Tensor& a, const Tensor& b, const Tensor& out) {
  OpTimer timer(*this, "add");
  check_binary(*this, "add", "a", a, "b", b, out);
  launch_binary(stream(), a, b, out, AddOp{}, "add kernel");
}

// out = a ⊙ b; f32, same shapes; out may alias a or b.
void CudaBackend::mul(const Tensor& a, const Tensor& b, const Tensor& out) {
  OpTimer timer(*this, "mul");
  check_binary(*this, "mul", "a", a, "b", b, out);
  launch_binary(stream(), a, b, out, MulOp{}, "mul kernel");
}

// out = x · s; f32; out may alias x.
void CudaBackend::scale(const Tensor& x, float s, const Tensor& out) {
  OpTimer timer(*this, "scale");
  check_unary(*this, "scale", x, out);
  launch_unary(stream(), x, out, ScaleOp{s}, "scale kernel");
}

// out = cap · tanh(x / cap); f32; out may alias x; cap positive and finite.
void CudaBackend::softcap(const Tensor& x, float cap, const Tensor& out) {
  OpTimer timer(*this, "softcap");
  check_unary(*this, "softcap", x, out);
  if (!(cap > 0.0f) || !std::isfinite(cap)) {
    fail("softcap: cap must be a positive finite number, got {} (x {})", cap, x.describe());
  }
  launch_unary(stream(), x, out, SoftcapOp{cap}, "softcap kernel");
}

// out[m] = index of the largest x[m, :] (lowest on ties; the first NaN if any).
// x f32 [M, N]; out i32 [M]. One 256-thread block per row.
void CudaBackend::argmax_rows(const Tensor& x, const Tensor& out) {
  OpTimer timer(*this, "argmax_rows");
  constexpr const char* kOp = "argmax_rows";
  check_on(*this, kOp, "x", x);
  check_on(*this, kOp, "out", out);
  check_dtype(kOp, "x", x, DType::kF32);
  check_rank(kOp, "x", x, 2);
  check_dtype(kOp, "out", out, DType::kI32);
  if (out.shape() != Shape({x.dim(0)})) {
    fail("argmax_rows: out {} must be i32[{}] for x {}", out.describe(), x.dim(0), x.describe());
  }
  const int64_t m = x.dim(0);
  const int64_t n = x.dim(1);
  if (m == 0) return;
  if (n == 0) fail("argmax_rows: x {} has empty rows; there is no largest element", x.describe());
  if (n > std::numeric_limits<int32_t>::max()) {
    fail("argmax_rows: x {} rows are too long for i32 indices", x.describe());
  }
  check_no_alias(kOp, "out", out, "x", x);
  // Slices of at least 4,096 elements (16 per thread), at most 64 per row.
  constexpr int64_t kMinSlice = 4096;
  constexpr int64_t kMaxParts = 64;
  const int64_t parts = std::clamp<int64_t>((n + kMinSlice - 1) / kMinSlice, 1, kMaxParts);
  const int64_t slice = (n + parts - 1) / parts;
  if (m > 65535)
    fail("argmax_rows: x {} has more rows than the CUDA kernel supports", x.describe());
  auto* partials = static_cast<ArgPartial*>(
      scratch(argmax_partials_, static_cast<size_t>(m * parts) * sizeof(ArgPartial)));
  argmax_slices_kernel<<<dim3(static_cast<unsigned>(parts), static_cast<unsigned>(m)), kThreads, 0,
                         stream()>>>(x.data_as<const float>(), partials, n, static_cast<int>(parts),
                                     slice);
  check_cuda(cudaGetLastError(), "argmax_slices_kernel");
  argmax_merge_kernel<<<grid_for(m, 128), 128, 0, stream()>>>(partials, out.data_as<int32_t>(), m,
                                                              n, static_cast<int>(parts));
  check_cuda(cudaGetLastError(), "argmax_merge_kernel");
}

// Row-wise softmax over the last dimension in f32; out may alias x. One
// 256-thread block per row.
void CudaBackend::softmax_rows(const Tensor& x, const Tensor& out) {
  OpTimer timer(*this, "softmax_rows");
  check_unary(*this, "softmax_rows", x, out);
  if (x.rank() < 1) fail("softmax_rows: x must have rank >= 1, got {}", x.describe());
  const int64_t n = x.dim(-1);
  if (n == 0 || x.numel() == 0) return;
  const int64_t rows = x.numel() / n;
  softmax_rows_kernel<<<grid_for(rows, 1), kThreads, 0, stream()>>>(x.data_as<const float>(),
                                                                    out.data_as<float>(), rows, n);
  check_cuda(cudaGetLastError(), "softmax_rows_kernel");
}

// out[b, a, :] = x[a, b, :]. x f32 [A, B, C], out f32 [B, A, C]; no aliasing.
void CudaBackend::transpose01(const Tensor& x, const Tensor& out) {
  OpTimer timer(*this, "transpose01");
  constexpr const char* kOp = "transpose01";
  check_on(*this, kOp, "x", x);
  check_on(*this, kOp, "out", out);
  check_dtype(kOp, "x", x, DType::kF32);
  check_dtype(kOp, "out", out, DType::kF32);
  check_rank(kOp, "x", x, 3);
  const int64_t a = x.dim(0), b = x.dim(1), c = x.dim(2);
  if (out.shape() != Shape{b, a, c}) {
    fail("transpose01: out {} must be [{}, {}, {}] for x {}", out.describe(), b, a, c,
         x.describe());
  }
  check_no_alias(kOp, "out", out, "x", x);
  const int64_t total = x.numel();
  if (total == 0) return;
  transpose01_kernel<<<grid_for(total, kThreads), kThreads, 0, stream()>>>(
      x.data_as<const float>(), out.data_as<float>(), a, b, c);
  check_cuda(cudaGetLastError(), "transpose01_kernel");
}

// Indices of each row's k largest values in torch.topk order; see Backend::top_k_rows.
void CudaBackend::top_k_rows(const Tensor& x, const Tensor& out) {
  OpTimer timer(*this, "top_k_rows");
  constexpr const char* kOp = "top_k_rows";
  check_on(*this, kOp, "x", x);
  check_on(*this, kOp, "out", out);
  const ops::TopKDims d = ops::check_top_k_rows(kOp, x, out);
  if (d.rows == 0) return;
  if (d.rows > std::numeric_limits<int32_t>::max())
    fail("{}: too many rows in {}", kOp, x.describe());
  top_k_rows_kernel<<<static_cast<unsigned>(d.rows), kThreads, 0, stream()>>>(
      x.data_as<const float>(), out.data_as<int32_t>(), d.n, d.k);
  check_cuda(cudaGetLastError(), "top_k_rows_kernel");
}

// Log-probabilities of raw logits; see Backend::logprob_rows (a row out of
// range is skipped, an id out of range gives NaN).
void CudaBackend::logprob_rows(const LogprobRowsParams& p) {
  OpTimer timer(*this, "logprob_rows");
  constexpr const char* kOp = "logprob_rows";
  check_on(*this, kOp, "logits", p.logits);
  check_on(*this, kOp, "rows", p.rows);
  if (!p.ids.empty()) check_on(*this, kOp, "ids", p.ids);
  if (!p.logprobs.empty()) check_on(*this, kOp, "logprobs", p.logprobs);
  if (!p.top_ids.empty()) check_on(*this, kOp, "top_ids", p.top_ids);
  if (!p.top_values.empty()) check_on(*this, kOp, "top_values", p.top_values);
  const ops::LogprobRowsDims d = ops::check_logprob_rows(kOp, p);
  if (d.rows == 0 || (d.ids == 0 && d.top == 0)) return;
  if (d.rows > std::numeric_limits<int32_t>::max())
    fail("{}: too many rows in {}", kOp, p.rows.describe());
  logprob_rows_kernel<<<static_cast<unsigned>(d.rows), kThreads, 0, stream()>>>(
      p.logits.data_as<const float>(), p.rows.data_as<const int32_t>(),
      d.ids > 0 ? p.ids.data_as<const int32_t>() : nullptr,
      d.ids > 0 ? p.logprobs.data_as<float>() : nullptr,
      d.top > 0 ? p.top_ids.data_as<int32_t>() : nullptr,
      d.top > 0 ? p.top_values.data_as<float>() : nullptr, d.logit_rows, d.vocab, d.ids, d.top);
  check_cuda(cudaGetLastError(), "logprob_rows_kernel");
}

// Candidate scores spread over rows filled with their minimum - 1; see
// Backend::fill_scatter_rows (ids outside [0, V) are skipped here).
void CudaBackend::fill_scatter_rows(const Tensor& values, const Tensor& ids, const Tensor& out) {
  OpTimer timer(*this, "fill_scatter_rows");
  constexpr const char* kOp = "fill_scatter_rows";
  check_on(*this, kOp, "values", values);
  check_on(*this, kOp, "ids", ids);
  check_on(*this, kOp, "out", out);
  const ops::FillScatterDims d = ops::check_fill_scatter_rows(kOp, values, ids, out);
  if (d.rows == 0) return;
  if (d.rows > 65535) fail("{}: at most 65,535 rows per call, got {}", kOp, d.rows);
  const dim3 grid(static_cast<unsigned>((d.width + kFillChunk - 1) / kFillChunk),
                  static_cast<unsigned>(d.rows));
  fill_rows_kernel<<<grid, kThreads, 0, stream()>>>(values.data_as<const float>(),
                                                    out.data_as<float>(), d.n, d.width);
  check_cuda(cudaGetLastError(), "fill_rows_kernel");
  scatter_rows_kernel<<<static_cast<unsigned>(d.rows), kThreads, 0, stream()>>>(
      values.data_as<const float>(), ids.data_as<const int32_t>(), out.data_as<float>(), d.n,
      d.width);
  check_cuda(cudaGetLastError(), "scatter_rows_kernel");
}

// out[i] = src[idx[i]] by rows; see Backend::gather_rows.
void CudaBackend::gather_rows(const Tensor& src, const Tensor& idx, const Tensor& out) {
  OpTimer timer(*this, "gather_rows");
  constexpr const char* kOp = "gather_rows";
  check_on(*this, kOp, "src", src);
  check_on(*this, kOp, "idx", idx);
  check_on(*this, kOp, "out", out);
  const ops::GatherRowsDims d = ops::check_gather_rows(kOp, src, idx, out);
  if (d.rows == 0 || d.row_words == 0) return;
  const int threads = d.row_words >= 256 ? 256 : 32;
  const int64_t pieces = (d.row_words + kGatherPiece - 1) / kGatherPiece;
  gather_rows_kernel<<<static_cast<unsigned>(std::min<int64_t>(d.rows * pieces, kMaxBlocks)),
                       threads, 0, stream()>>>(
      static_cast<const uint32_t*>(src.data()), idx.data_as<const int32_t>(),
      static_cast<uint32_t*>(out.data()), d.rows, d.src_rows, d.row_words, pieces);
  check_cuda(cudaGetLastError(), "gather_rows_kernel");
}

// Fills t (f32|bf16|f16) with uniform_at(seed, i, lo, hi) rounded to t's dtype:
// bit-identical to the CPU backend's fill_uniform.
void CudaBackend::fill_uniform(const Tensor& t, uint64_t seed, float lo, float hi) {
  ++op_seq_;
  check_on(*this, "fill_uniform", "t", t);
  check_float("fill_uniform", "t", t);
  const int64_t n = t.numel();
  if (n == 0) return;
  with_float_dtype(t.dtype(), [&](auto tag) {
    constexpr DType kDt = decltype(tag)::value;
    fill_uniform_kernel<kDt>
        <<<grid_for(n, kThreads), kThreads, 0, stream()>>>(t.data(), n, seed, lo, hi);
  });
  check_cuda(cudaGetLastError(), "fill_uniform_kernel");
}

}  // namespace specula::cuda
