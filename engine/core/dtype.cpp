// SPDX-License-Identifier: Apache-2.0
#include "engine/core/dtype.h"

#include <algorithm>
#include <cmath>

namespace specula {

std::string_view dtype_name(DType t) {
  switch (t) {
    case DType::kF32:
      return "f32";
    case DType::kBF16:
      return "bf16";
    case DType::kF16:
      return "f16";
    case DType::kI32:
      return "i32";
    case DType::kI64:
      return "i64";
    case DType::kU8:
      return "u8";
    case DType::kI8:
      return "i8";
    case DType::kF8E4M3:
      return "f8e4m3";
  }
  return "?";
}

std::string_view dtype_safetensors_name(DType t) {
  switch (t) {
    case DType::kF32:
      return "F32";
    case DType::kBF16:
      return "BF16";
    case DType::kF16:
      return "F16";
    case DType::kI32:
      return "I32";
    case DType::kI64:
      return "I64";
    case DType::kU8:
      return "U8";
    case DType::kI8:
      return "I8";
    case DType::kF8E4M3:
      return "F8_E4M3";
  }
  return "?";
}

bool dtype_from_safetensors(std::string_view name, DType* out) {
  static constexpr DType kAll[] = {DType::kF32, DType::kBF16, DType::kF16, DType::kI32,
                                   DType::kI64, DType::kU8,   DType::kI8,  DType::kF8E4M3};
  for (DType t : kAll) {
    if (dtype_safetensors_name(t) == name) {
      *out = t;
      return true;
    }
  }
  return false;
}

float f16_to_f32(uint16_t h) {
  const uint32_t sign = (h >> 15) & 1u;
  const int exponent = (h >> 10) & 0x1f;
  const uint32_t mantissa = h & 0x3ffu;
  float value;
  if (exponent == 0) {
    value = std::ldexp(static_cast<float>(mantissa), -24);
  } else if (exponent == 31) {
    value = mantissa ? NAN : INFINITY;
  } else {
    value = std::ldexp(static_cast<float>(mantissa | 0x400u), exponent - 25);
  }
  return sign ? -value : value;
}

uint16_t f32_to_f16(float f) {
  uint32_t bits;
  std::memcpy(&bits, &f, 4);
  const uint32_t sign = (bits >> 16) & 0x8000u;
  const int exponent = static_cast<int>((bits >> 23) & 0xff) - 127 + 15;
  uint32_t mantissa = bits & 0x7fffffu;
  if (((bits >> 23) & 0xff) == 0xff)
    return static_cast<uint16_t>(sign | 0x7c00u | (mantissa ? 0x200u : 0));
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

uint8_t f32_to_e4m3(float f) {
  uint32_t bits;
  std::memcpy(&bits, &f, 4);
  const uint8_t sign = static_cast<uint8_t>((bits >> 24) & 0x80u);
  if (std::isnan(f)) return static_cast<uint8_t>(sign | 0x7f);
  const float a = std::fabs(f);
  if (a >= 448.0f) return static_cast<uint8_t>(sign | 0x7e);
  // Below 2^-6 the grid is the subnormals' (steps of 2^-9); above, 8 steps per
  // binade. Scaling to the grid and rounding with nearbyint (ties to even under
  // the default rounding mode) is exact: every product here is a power-of-two scaling.
  int e;
  std::frexp(a, &e);  // a = m · 2^e, m in [0.5, 1)
  const int exponent = std::max(e - 1, -6);
  const float step = std::ldexp(1.0f, exponent - 3);
  const float units = std::nearbyint(a / step);  // in [0, 16] steps of the binade
  if (units == 0) return sign;
  if (exponent == -6 && units < 8) return static_cast<uint8_t>(sign | static_cast<int>(units));
  // units == 16 rounds up into the next binade (never past 448: checked above).
  const int biased = exponent + 7 + (units >= 16 ? 1 : 0);
  const int mantissa = units >= 16 ? 0 : static_cast<int>(units) - 8;
  return static_cast<uint8_t>(sign | (biased << 3) | mantissa);
}

void kv_e4m3_quantize_row(const float* x, int64_t n, uint8_t* q, float* scale) {
  float amax = 0.0f;
  for (int64_t i = 0; i < n; ++i) {
    if (std::isfinite(x[i])) amax = std::max(amax, std::fabs(x[i]));
  }
  const float s = kv_e4m3_scale(amax);
  for (int64_t i = 0; i < n; ++i) q[i] = kv_e4m3_encode(x[i], s);
  *scale = s;
}

}  // namespace specula
