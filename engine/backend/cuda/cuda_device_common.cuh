// SPDX-License-Identifier: Apache-2.0
// Device helpers shared by the CUDA op files (included only by .cu files):
// dtype dispatch, exact widening loads, the CPU's GELU and exp, warp and block
// sums, and the per-element RMSNorm and RoPE arithmetic.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <type_traits>

#include "engine/core/dtype.h"

namespace specula::cuda {

// Calls f(std::integral_constant<DType, d>{}) for an f32|bf16|f16 dtype
// (anything else is treated as f16: callers check_float first).
template <typename F>
void with_float_dtype(DType d, F&& f) {
  switch (d) {
    case DType::kF32:
      f(std::integral_constant<DType, DType::kF32>{});
      break;
    case DType::kBF16:
      f(std::integral_constant<DType, DType::kBF16>{});
      break;
    default:
      f(std::integral_constant<DType, DType::kF16>{});
      break;
  }
}

// v widened exactly to f32 (float, __nv_bfloat16 or __half).
template <typename T>
__device__ __forceinline__ float to_f32(T v) {
  if constexpr (std::is_same_v<T, float>) {
    return v;
  } else if constexpr (std::is_same_v<T, __nv_bfloat16>) {
    return __bfloat162float(v);
  } else {
    return __half2float(v);
  }
}

// A 16-bit float's bits (in the low half of `bits`) widened exactly to f32.
template <DType kDt>
__device__ __forceinline__ float widen16(uint32_t bits) {
  if constexpr (kDt == DType::kBF16) {
    return __uint_as_float(bits << 16);
  } else {
    return __half2float(__ushort_as_half(static_cast<unsigned short>(bits)));
  }
}

// f32 to bf16 bits, rounded to nearest even with NaN kept a NaN (0x7fc0):
// f32_to_bf16 of engine/core/dtype.h, so a bf16 KV cache holds the same bits on
// every backend.
__device__ __forceinline__ uint16_t f32_to_bf16_bits(float f) {
  uint32_t bits = __float_as_uint(f);
  if ((bits & 0x7f800000u) == 0x7f800000u && (bits & 0x007fffffu)) return 0x7fc0;
  bits += 0x7fffu + ((bits >> 16) & 1u);
  return static_cast<uint16_t>(bits >> 16);
}
__device__ __forceinline__ float bf16_bits_to_f32(uint32_t bits) {
  return __uint_as_float(bits << 16);
}

// fp8 KV cache rows (engine/core/dtype.h, kv_e4m3_quantize_row): the same
// rules, in the same f32 operations, so that a cache store is bit-equal to the
// CPU's. e4m3 code to f32, exactly (e4m3_to_f32).
__device__ __forceinline__ float e4m3_bits_to_f32(uint32_t code) {
  const uint32_t exponent = (code >> 3) & 0xfu;
  const uint32_t mantissa = code & 0x7u;
  float magnitude;
  if (exponent == 0xfu && mantissa == 0x7u) {
    magnitude = __uint_as_float(0x7fc00000u);
  } else if (exponent == 0) {
    magnitude = __fmul_rn(static_cast<float>(mantissa), 0x1p-9f);
  } else {
    magnitude = __uint_as_float(((exponent + 120u) << 23) | (mantissa << 20));
  }
  return (code & 0x80u) ? -magnitude : magnitude;
}
// One cached fp8 element dequantized: e4m3(code) · scale (one f32 product), as
// the CPU computes it. A NaN code gives the decoded NaN itself (sign and
// payload): the CPU's product passes a NaN operand through, whereas the GPU's
// multiply would return its canonical NaN, other bits.
__device__ __forceinline__ float e4m3_dequant(uint32_t code, float scale) {
  const float v = e4m3_bits_to_f32(code);
  return v != v ? v : __fmul_rn(v, scale);
}
// kv_e4m3_scale: amax / 448 (IEEE division), 1 unless positive.
__device__ __forceinline__ float kv_e4m3_scale_dev(float amax) {
  const float scale = __fdiv_rn(amax, 448.0f);
  return scale > 0.0f ? scale : 1.0f;
}
// f32_to_e4m3 of x / scale (round to nearest even, finite values saturate to
// ±448), non-finite x the e4m3 NaN of its sign: kv_e4m3_encode. The grid
// arithmetic is f32_to_e4m3's: frexp, a power-of-two step, rint (ties to even).
__device__ __forceinline__ uint8_t kv_e4m3_encode_dev(float x, float scale) {
  const uint32_t xb = __float_as_uint(x);
  const uint32_t sign = (xb >> 24) & 0x80u;
  if ((xb & 0x7f800000u) == 0x7f800000u) return static_cast<uint8_t>(sign | 0x7fu);
  const float f = __fdiv_rn(x, scale);
  if (f != f) return static_cast<uint8_t>(sign | 0x7fu);  // (not reached: x finite, scale > 0)
  const uint32_t fsign = (__float_as_uint(f) >> 24) & 0x80u;
  const float a = fabsf(f);
  if (a >= 448.0f) return static_cast<uint8_t>(fsign | 0x7eu);
  int e;
  frexpf(a, &e);
  const int exponent = max(e - 1, -6);
  const float step = ldexpf(1.0f, exponent - 3);
  const float units = rintf(__fdiv_rn(a, step));
  if (units == 0.0f) return static_cast<uint8_t>(fsign);
  if (exponent == -6 && units < 8.0f)
    return static_cast<uint8_t>(fsign | static_cast<uint32_t>(units));
  const int biased = exponent + 7 + (units >= 16.0f ? 1 : 0);
  const int mantissa = units >= 16.0f ? 0 : static_cast<int>(units) - 8;
  return static_cast<uint8_t>(fsign | (static_cast<uint32_t>(biased) << 3) |
                              static_cast<uint32_t>(mantissa));
}

// Element i of an f32|bf16|f16 array, exactly widened to f32.
template <DType kDt>
__device__ __forceinline__ float load_float(const void* p, int64_t i) {
  if constexpr (kDt == DType::kF32) {
    return static_cast<const float*>(p)[i];
  } else {
    return widen16<kDt>(static_cast<const uint16_t*>(p)[i]);
  }
}

// cpu::gelu_tanh operation for operation (gelu_pytorch_tanh in f32, no FMA
// contraction).
__device__ __forceinline__ float gelu_tanh(float x) {
  constexpr float kBeta = 0.7978845608028654f;  // sqrt(2 / pi)
  constexpr float kKappa = 0.044715f;
  const float cube = __fmul_rn(__fmul_rn(__fmul_rn(kKappa, x), x), x);
  const float inner = __fmul_rn(kBeta, __fadd_rn(x, cube));
  return __fmul_rn(__fmul_rn(0.5f, x), __fadd_rn(1.0f, tanhf(inner)));
}

// exp in f32 as an accurate double exp rounded once: the closest match to the
// CPU's (nearly correctly rounded) glibc expf; CUDA's expf may be 2 ulp off.
__device__ __forceinline__ float exp_f32(float x) {
  return static_cast<float>(exp(static_cast<double>(x)));
}

// Butterfly sums: every lane ends with the same value (IEEE addition commutes).
__device__ __forceinline__ float warp_sum(float v) {
  for (int m = 16; m > 0; m >>= 1) v += __shfl_xor_sync(0xffffffffu, v, m);
  return v;
}
__device__ __forceinline__ double warp_sum(double v) {
  for (int m = 16; m > 0; m >>= 1) v += __shfl_xor_sync(0xffffffffu, v, m);
  return v;
}

// Sum over a whole block of kBlockThreads threads in a fixed order: warp
// butterflies, then every thread adds the warp partials in warp order. All
// threads must call it; `partials` is kBlockThreads / 32 doubles of shared memory.
template <int kBlockThreads>
__device__ __forceinline__ double fixed_block_sum(double v, double* partials) {
  v = warp_sum(v);
  const int warp = threadIdx.x / 32;
  if (threadIdx.x % 32 == 0) partials[warp] = v;
  __syncthreads();
  double total = 0.0;
  for (int w = 0; w < kBlockThreads / 32; ++w) total += partials[w];
  __syncthreads();  // partials may be reused by the caller's next reduction
  return total;
}

// ---- RMSNorm and RoPE arithmetic ----
// One definition for every kernel that normalises or rotates a row (rms_norm,
// rms_norm_add, rope in cuda_elementwise.cu; the fused ops in cuda_fused.cu), so
// a fused kernel rounds exactly as the separate ops do: same operations, same
// order, as long as it also gives each row the same thread pattern (element c of
// a row handled by lane c % kGroup, in increasing c).

// Threads of the block that normalises one row wider than a warp's (rms_norm,
// rms_norm_add and rms_norm_add_norm past 1,024 elements): part of the
// numerics, as element c of the row is summed by thread c % kNormBlockThreads
// before the fixed block sum. 512 rather than 256: at one row (decode) the
// norm sits between two products on the critical path, and half the elements
// per thread shortened it. 31B decode step on an H200, same run: 17.39-17.45
// ms with 256, 17.25-17.32 with 512, 17.81-17.83 with 1,024.
inline constexpr int kNormBlockThreads = 512;

// Rows up to this wide are normalised by one warp (eight rows to a 256-thread
// block), wider ones by a whole kNormBlockThreads block.
inline constexpr int64_t kWarpRowMax = 1024;

// Block size of a norm kernel whose rows take `group` threads each.
__host__ __device__ constexpr int norm_block_threads(int group) {
  return group == 32 ? 256 : group;
}

// Rows normalised by a whole block keep up to this many elements per thread
// in registers between the norm's passes (rows of up to 6,144 floats); wider
// rows loop over memory. Either form gives the same bits.
inline constexpr int kRegisterElems = 6144 / kNormBlockThreads;

// The one choice of thread pattern for a norm over rows of d floats, shared by
// rms_norm, rms_norm_add and rms_norm_add_norm so that the fused op keeps the
// separate ops' bits: calls f(kGroup, kPer) as integral constants (kGroup
// threads a row: 32 or kNormBlockThreads; kPer elements a thread held in
// registers, 0 for rows that loop over memory). A kernel instantiated for them
// runs in blocks of norm_block_threads(kGroup) threads.
template <typename F>
void with_norm_rows(int64_t d, F&& f) {
  if (d <= kWarpRowMax) {
    f(std::integral_constant<int, 32>{}, std::integral_constant<int, 0>{});
  } else if (d <= int64_t{kRegisterElems} * kNormBlockThreads) {
    f(std::integral_constant<int, kNormBlockThreads>{},
      std::integral_constant<int, kRegisterElems>{});
  } else {
    f(std::integral_constant<int, kNormBlockThreads>{}, std::integral_constant<int, 0>{});
  }
}

// v[i] = p[lane + i·kStride] for the kPer elements a thread holds of a row of
// n (> 0) elements of dtype kDt (f32, or a 16-bit float widened exactly), 0
// past the row; with a null p, all 0. The loads are unconditional (the index
// is clamped into the row, then the values past it are zeroed) and use 32-bit
// indices (held rows are short), so the code is straight-line at low register
// pressure. Why: with a condition per element and 64-bit indices ptxas
// interleaved each load with the sums that use it, one memory round trip per
// element (rms_norm_add_norm at 5,376 elements: 24 round trips, ~5 us of a
// ~7 us call on an H200).
template <int kPer, int kStride, DType kDt = DType::kF32>
__device__ __forceinline__ void load_held(const void* p, int lane, int n, float (&v)[kPer]) {
  if (p == nullptr) {
#pragma unroll
    for (int i = 0; i < kPer; ++i) v[i] = 0.0f;
    return;
  }
#pragma unroll
  for (int i = 0; i < kPer; ++i) v[i] = load_float<kDt>(p, min(lane + i * kStride, n - 1));
#pragma unroll
  for (int i = 0; i < kPer; ++i) {
    if (lane + i * kStride >= n) v[i] = 0.0f;
  }
}

// Adds x² to a thread's running sum of squares (kept in double, like the CPU's).
__device__ __forceinline__ void rms_accumulate(double& sum, float x) {
  const double v = x;
  sum += v * v;
}

// The sum of squares of one row over its kGroup threads (32: a warp, or the
// whole block of kBlockThreads); every thread of the group gets the total.
template <int kGroup, int kBlockThreads>
__device__ __forceinline__ double rms_group_sum(double partial, double* partials) {
  if constexpr (kGroup == 32) {
    return warp_sum(partial);
  } else {
    static_assert(kGroup == kBlockThreads, "a row group is a warp or the whole block");
    return fixed_block_sum<kBlockThreads>(partial, partials);
  }
}

// The sum of squares of a row of d floats held by one warp as load_held<kPer,
// 32> leaves it (lane holds elements lane + 32 i): each lane sums its squares
// in increasing element order, then the warp butterfly. The warp rows of
// rms_norm (d <= 1,024) and the attention-input kernels sum this way.
template <int kPer>
__device__ __forceinline__ double warp_row_sum_squares(const float (&vals)[kPer], int64_t d,
                                                       int lane) {
  double sum = 0.0;
#pragma unroll
  for (int i = 0; i < kPer; ++i) {
    if (lane + 32 * i < d) rms_accumulate(sum, vals[i]);
  }
  return warp_sum(sum);
}

// (mean + eps)^-1/2 of a row of d floats whose squares sum to `sum`, rounded
// once from double: as close as f32 gets to the CPU's powf(mean + eps, -0.5f).
__device__ __forceinline__ float rms_inv(double sum, int64_t d, float eps) {
  const float mean = static_cast<float>(sum / static_cast<double>(d));
  return static_cast<float>(1.0 / sqrt(static_cast<double>(__fadd_rn(mean, eps))));
}

// Normalised element c of a row: x · inv, then · weight[c] unless weight is null.
// rms_apply_loaded takes the weight element already loaded (w is ignored
// without a weight): the register-resident norms load weights ahead of time.
__device__ __forceinline__ float rms_apply_loaded(float x, float inv, bool has_weight, float w) {
  const float v = __fmul_rn(x, inv);
  return has_weight ? __fmul_rn(v, w) : v;
}
template <DType kDt>
__device__ __forceinline__ float rms_apply(float x, float inv, const void* weight, int64_t c) {
  const bool has_weight = weight != nullptr;
  return rms_apply_loaded(x, inv, has_weight, has_weight ? load_float<kDt>(weight, c) : 0.0f);
}

// rms_norm_add's residual update of one element: (r + v), then · post_scale
// unless post_scale is 1 (as add, then scale only when asked).
__device__ __forceinline__ float residual_update(float r, float v, float post_scale) {
  float sum = __fadd_rn(r, v);
  if (post_scale != 1.0f) sum = __fmul_rn(sum, post_scale);
  return sum;
}

// Rotate-half RoPE of one pair (x1, x2) = (row[j], row[j + D/2]) by the angle
// float(position) · inv_freq[j], in f32 as the CPU (and HF) do. Returns the new
// (row[j], row[j + D/2]).
__device__ __forceinline__ float2 rope_rotate(float x1, float x2, int32_t position,
                                              float inv_freq) {
  const float angle = __fmul_rn(static_cast<float>(position), inv_freq);
  float s, c;
  sincosf(angle, &s, &c);
  return make_float2(__fsub_rn(__fmul_rn(x1, c), __fmul_rn(x2, s)),
                     __fadd_rn(__fmul_rn(x2, c), __fmul_rn(x1, s)));
}

// ---- one attention head row held by a warp ----
// vals[i] is element lane + 32 i of a row of d <= 32 kPer floats (load_held<kPer, 32>).

// out[c], and out2[c] unless null, = rms_apply(vals, inv), weightless (the v norm).
template <int kPer>
__device__ __forceinline__ void write_plain_norm(const float (&vals)[kPer], float inv, int64_t d,
                                                 int lane, float* out, float* out2) {
#pragma unroll
  for (int i = 0; i < kPer; ++i) {
    const int64_t c = lane + 32 * i;
    if (c < d) {
      const float y = rms_apply_loaded(vals[i], inv, false, 0.0f);
      out[c] = y;
      if (out2 != nullptr) out2[c] = y;
    }
  }
}

// row (the warp's shared row), and out / out2 unless null, = rope(rms_apply(
// vals, inv) · w): weight_at(i, c) is the weight of element c = lane + 32 i
// (ignored without a weight), freq_at(i, j) the frequency of pair j = lane +
// 32 i. The normalised row goes through `row` because RoPE pairs element j
// with j + d/2, which another lane may hold; each lane then rotates only its
// own pairs, in place.
template <int kPer, typename WeightAt, typename FreqAt>
__device__ __forceinline__ void write_norm_rope(const float (&vals)[kPer], float inv,
                                                bool has_weight, WeightAt weight_at, int64_t d,
                                                int lane, float* row, int32_t position,
                                                FreqAt freq_at, float* out, float* out2) {
#pragma unroll
  for (int i = 0; i < kPer; ++i) {
    const int c = lane + 32 * i;
    if (c < d) row[c] = rms_apply_loaded(vals[i], inv, has_weight, weight_at(i, c));
  }
  __syncwarp();
  const int half = static_cast<int>(d / 2);
#pragma unroll
  for (int i = 0; i < kPer / 2; ++i) {
    const int j = lane + 32 * i;
    if (j >= half) break;
    const float2 y = rope_rotate(row[j], row[j + half], position, freq_at(i, j));
    row[j] = y.x;
    row[j + half] = y.y;
    if (out != nullptr) {
      out[j] = y.x;
      out[j + half] = y.y;
    }
    if (out2 != nullptr) {
      out2[j] = y.x;
      out2[j + half] = y.y;
    }
  }
  __syncwarp();  // the row may be rewritten for the warp's next one
}

}  // namespace specula::cuda
