// SPDX-License-Identifier: Apache-2.0
// The CPU backend's innermost loops. They are written so GCC vectorises them
// without -ffast-math (explicit lanes instead of a reassociated reduction), and
// on x86-64 Linux each is also compiled for AVX2 and picked at load time, since
// the build does not assume any instruction set beyond the baseline. Both
// versions perform the same f32 operations in the same order, so results are
// identical whichever one runs.
#include <cstring>

#include "engine/backend/cpu/cpu_internal.h"

#if defined(__x86_64__) && defined(__linux__) && defined(__GNUC__) && !defined(__clang__) && \
    !defined(__SANITIZE_ADDRESS__)
#define SPECULA_CPU_CLONES __attribute__((target_clones("avx2", "default")))
#else
#define SPECULA_CPU_CLONES
#endif

namespace specula::cpu {

SPECULA_CPU_CLONES void dot_accumulate(const float* __restrict a, const float* __restrict b,
                                       int64_t n, float* __restrict lanes) {
  // `acc` is only ever indexed by constants so it lives in vector registers; the
  // tail goes straight to `lanes` (same per-lane order: main part, then tail).
  float acc[kLanes];
  for (int l = 0; l < kLanes; ++l) acc[l] = lanes[l];
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes) {
    for (int l = 0; l < kLanes; ++l) acc[l] += a[i + l] * b[i + l];
  }
  for (int l = 0; l < kLanes; ++l) lanes[l] = acc[l];
  for (int l = 0; i < n; ++i, ++l) lanes[l] += a[i] * b[i];
}

float reduce_lanes(const float* lanes) {
  float t[kLanes];
  for (int l = 0; l < kLanes; ++l) t[l] = lanes[l];
  for (int width = kLanes / 2; width >= 1; width /= 2) {
    for (int l = 0; l < width; ++l) t[l] += t[l + width];
  }
  return t[0];
}

float dot(const float* a, const float* b, int64_t n) {
  float lanes[kLanes] = {};
  dot_accumulate(a, b, n, lanes);
  return reduce_lanes(lanes);
}

SPECULA_CPU_CLONES void axpy(float alpha, const float* __restrict x, float* __restrict y,
                             int64_t n) {
  for (int64_t i = 0; i < n; ++i) y[i] += alpha * x[i];
}

namespace {

SPECULA_CPU_CLONES void bf16_row_to_f32(const uint16_t* __restrict src, float* __restrict dst,
                                        int64_t n) {
  for (int64_t i = 0; i < n; ++i) {
    const uint32_t bits = static_cast<uint32_t>(src[i]) << 16;
    std::memcpy(dst + i, &bits, 4);
  }
}

SPECULA_CPU_CLONES void f16_row_to_f32(const uint16_t* __restrict src, float* __restrict dst,
                                       int64_t n) {
  for (int64_t i = 0; i < n; ++i) dst[i] = f16_bits_to_f32(src[i]);
}

}  // namespace

void to_f32(const void* src, DType dtype, float* dst, int64_t n) {
  switch (dtype) {
    case DType::kF32:
      std::memcpy(dst, src, static_cast<size_t>(n) * 4);
      return;
    case DType::kBF16:
      bf16_row_to_f32(static_cast<const uint16_t*>(src), dst, n);
      return;
    case DType::kF16:
      f16_row_to_f32(static_cast<const uint16_t*>(src), dst, n);
      return;
    default:
      fail("to_f32: unsupported source dtype {}", dtype_name(dtype));
  }
}

ScratchPool::Lease::Lease(ScratchPool& pool, size_t n) : lock_(pool.mutex_, std::try_to_lock) {
  if (lock_.owns_lock()) {
    if (pool.buffer_.size() < n) pool.buffer_.resize(n);
    data_ = pool.buffer_.data();
  } else {
    own_.resize(n);
    data_ = own_.data();
  }
}

}  // namespace specula::cpu
