// SPDX-License-Identifier: Apache-2.0
// Device helpers shared by the CUDA op files (included only by .cu files):
// dtype dispatch, exact widening loads, the CPU's GELU and exp, warp sums.
#pragma once

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

// A 16-bit float's bits (in the low half of `bits`) widened exactly to f32.
template <DType kDt>
__device__ __forceinline__ float widen16(uint32_t bits) {
  if constexpr (kDt == DType::kBF16) {
    return __uint_as_float(bits << 16);
  } else {
    return __half2float(__ushort_as_half(static_cast<unsigned short>(bits)));
  }
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

}  // namespace specula::cuda
