// SPDX-License-Identifier: Apache-2.0
// Element types and bf16/f16 conversions.
#pragma once

#include <fmt/format.h>

#include <cstdint>
#include <cstring>
#include <string_view>

namespace specula {

// kI8 and kF8E4M3 are quantized weight matrices: a Tensor of either carries
// per-row f32 scales (Tensor::scales), and element [r, c] stands for
// decode(q[r, c]) · scale[r] (docs/architecture.md, "Quantized drafters").
enum class DType : uint8_t { kF32, kBF16, kF16, kI32, kI64, kU8, kI8, kF8E4M3 };

// Size in bytes of one element.
constexpr size_t dtype_size(DType t) {
  switch (t) {
    case DType::kF32:
      return 4;
    case DType::kBF16:
      return 2;
    case DType::kF16:
      return 2;
    case DType::kI32:
      return 4;
    case DType::kI64:
      return 8;
    case DType::kU8:
    case DType::kI8:
    case DType::kF8E4M3:
      return 1;
  }
  return 0;
}

// Quantized weight dtypes (int8, fp8 e4m3): one byte an element plus per-row scales.
constexpr bool is_quantized(DType t) {
  return t == DType::kI8 || t == DType::kF8E4M3;
}

// Lower-case short name ("f32", "bf16", ...), used in every error message.
std::string_view dtype_name(DType t);

// safetensors spelling ("F32", "BF16", "F16", "I32", "I64", "U8", "I8", "F8_E4M3"); parse returns
// false for a dtype the engine does not support.
std::string_view dtype_safetensors_name(DType t);
bool dtype_from_safetensors(std::string_view name, DType* out);

// bf16 is the upper half of an IEEE f32; conversion back rounds to nearest even
// (what torch does), and keeps NaN a NaN.
inline float bf16_to_f32(uint16_t v) {
  uint32_t bits = static_cast<uint32_t>(v) << 16;
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}
inline uint16_t f32_to_bf16(float f) {
  uint32_t bits;
  std::memcpy(&bits, &f, 4);
  if ((bits & 0x7f800000u) == 0x7f800000u && (bits & 0x007fffffu)) return 0x7fc0;
  bits += 0x7fffu + ((bits >> 16) & 1u);
  return static_cast<uint16_t>(bits >> 16);
}
float f16_to_f32(uint16_t v);
uint16_t f32_to_f16(float f);

// OCP fp8 e4m3 (E4M3FN, torch.float8_e4m3fn): sign, 4 exponent bits (bias 7),
// 3 mantissa bits, no infinities; S.1111.111 is NaN; the largest finite value
// is 448. Decoding is exact. Encoding rounds to nearest even and saturates
// finite values beyond ±448 to ±448 (NaN stays NaN), as quantizers do.
inline float e4m3_to_f32(uint8_t v) {
  const int exponent = (v >> 3) & 0xf;
  const int mantissa = v & 0x7;
  float magnitude;
  if (exponent == 0xf && mantissa == 0x7) {
    magnitude = __builtin_nanf("");
  } else if (exponent == 0) {
    magnitude = static_cast<float>(mantissa) * 0x1p-9f;  // subnormal: m · 2^-9
  } else {
    // (8 + m) · 2^(e - 10), built from its bits: exact.
    const uint32_t bits =
        (static_cast<uint32_t>(exponent + 120) << 23) | (static_cast<uint32_t>(mantissa) << 20);
    std::memcpy(&magnitude, &bits, 4);
  }
  return (v & 0x80) ? -magnitude : magnitude;
}
uint8_t f32_to_e4m3(float f);

// fp8 KV cache rows (KvCacheSpec::dtype == kF8E4M3): each cached (token, kv
// head) vector of head_dim values is stored as e4m3 codes plus one f32 scale,
// and element i stands for e4m3_to_f32(q[i]) · scale (one f32 product), the
// convention of quantized weights. Every backend quantizes with these rules,
// in f32, so that stores are bit-equal across backends:
// - scale = amax / 448 (an IEEE f32 division, rounded to nearest), amax the
//   largest |x| over the row's finite elements; 1 when that quotient is not a
//   positive number (amax 0, or so small that amax / 448 underflows to 0), so
//   that a row of zeros stores zeros;
// - q[i] = f32_to_e4m3(x[i] / scale) (an IEEE f32 division, then round to
//   nearest even; finite values past ±448 saturate to ±448);
// - non-finite elements (NaN, ±inf) store the e4m3 NaN of their sign (0x7f /
//   0xff): e4m3fn has no infinity, and a cache must not turn an overflow into a
//   plausible finite key. They are left out of amax so that one bad element
//   does not flush its finite neighbours to zero.
inline float kv_e4m3_scale(float amax) {
  const float scale = amax / 448.0f;
  return scale > 0.0f ? scale : 1.0f;
}
inline uint8_t kv_e4m3_encode(float x, float scale) {
  uint32_t bits;
  std::memcpy(&bits, &x, 4);
  if ((bits & 0x7f800000u) == 0x7f800000u)
    return static_cast<uint8_t>(((bits >> 24) & 0x80u) | 0x7f);
  return f32_to_e4m3(x / scale);
}
// Quantizes one row of n values into q[n] and *scale by the rules above.
void kv_e4m3_quantize_row(const float* x, int64_t n, uint8_t* q, float* scale);

}  // namespace specula

template <>
struct fmt::formatter<specula::DType> : fmt::formatter<std::string_view> {
  auto format(specula::DType t, fmt::format_context& ctx) const {
    return fmt::formatter<std::string_view>::format(specula::dtype_name(t), ctx);
  }
};
