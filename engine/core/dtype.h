// SPDX-License-Identifier: Apache-2.0
// Element types and bf16/f16 conversions.
#pragma once

#include <fmt/format.h>

#include <cstdint>
#include <cstring>
#include <string_view>

namespace specula {

enum class DType : uint8_t { kF32, kBF16, kF16, kI32, kI64, kU8 };

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
      return 1;
  }
  return 0;
}

// Lower-case short name ("f32", "bf16", ...), used in every error message.
std::string_view dtype_name(DType t);

// safetensors spelling ("F32", "BF16", "F16", "I32", "I64", "U8"); parse returns
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

}  // namespace specula

template <>
struct fmt::formatter<specula::DType> : fmt::formatter<std::string_view> {
  auto format(specula::DType t, fmt::format_context& ctx) const {
    return fmt::formatter<std::string_view>::format(specula::dtype_name(t), ctx);
  }
};
