// SPDX-License-Identifier: Apache-2.0
// The CPU backend's innermost loops, written with explicit vectors and fixed
// lanes (no reassociated reductions, no -ffast-math). On x86-64 Linux each is
// also compiled for AVX2 and picked at load time, since the build assumes no
// instruction set beyond the baseline. Both versions perform the same f32
// operations in the same order, so results are identical whichever one runs.
#include <cstring>

#include "engine/backend/cpu/cpu_internal.h"

#if defined(__x86_64__) && defined(__linux__) && defined(__GNUC__) && !defined(__clang__) && \
    !defined(__SANITIZE_ADDRESS__)
#define SPECULA_CPU_CLONES __attribute__((target_clones("avx2", "default")))
#else
#define SPECULA_CPU_CLONES
#endif

// The 32-byte vector helpers below are always inlined and internal to this file,
// so the ABI note GCC gives for them (when AVX is off) does not apply.
#pragma GCC diagnostic ignored "-Wpsabi"

namespace specula::cpu {
namespace {

// GCC/Clang generic vectors: explicit 8-wide f32 arithmetic that compiles to
// AVX in the AVX2 clone and to SSE pairs otherwise, at any optimisation level
// (the auto-vectoriser is not relied on; RelWithDebInfo builds use -O2).
typedef float F8 __attribute__((vector_size(32)));
typedef uint32_t U32x8 __attribute__((vector_size(32)));
typedef int32_t I32x8 __attribute__((vector_size(32)));
typedef uint16_t U16x8 __attribute__((vector_size(16)));

static_assert(kLanes == 32, "dot_accumulate keeps four 8-wide accumulators");

[[gnu::always_inline]] inline F8 load8(const float* p) {
  F8 v;
  std::memcpy(&v, p, sizeof v);
  return v;
}
[[gnu::always_inline]] inline void store8(float* p, const F8& v) {
  std::memcpy(p, &v, sizeof v);
}
[[gnu::always_inline]] inline U32x8 load8_u16(const uint16_t* p) {
  U16x8 h;
  std::memcpy(&h, p, sizeof h);
  return __builtin_convertvector(h, U32x8);
}
[[gnu::always_inline]] inline void store8_bits(float* p, const U32x8& bits) {
  std::memcpy(p, &bits, sizeof bits);
}

}  // namespace

SPECULA_CPU_CLONES void dot_accumulate(const float* a, const float* b, int64_t n, float* lanes) {
  // Element i of the main part lands in lane i % 32: accumulator j holds lanes
  // [8j, 8j + 8). The tail continues the same lanes in order.
  F8 acc0 = load8(lanes), acc1 = load8(lanes + 8), acc2 = load8(lanes + 16),
     acc3 = load8(lanes + 24);
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes) {
    acc0 += load8(a + i) * load8(b + i);
    acc1 += load8(a + i + 8) * load8(b + i + 8);
    acc2 += load8(a + i + 16) * load8(b + i + 16);
    acc3 += load8(a + i + 24) * load8(b + i + 24);
  }
  store8(lanes, acc0);
  store8(lanes + 8, acc1);
  store8(lanes + 16, acc2);
  store8(lanes + 24, acc3);
  for (int l = 0; i < n; ++i, ++l) lanes[l] += a[i] * b[i];
}

SPECULA_CPU_CLONES void dot_accumulate3(const float* a0, const float* a1, const float* a2,
                                        const float* b, int64_t n, float* lanes0, float* lanes1,
                                        float* lanes2) {
  // Three rows against one weight vector: each b vector is loaded once for
  // three products (dot_accumulate is load-bound). Per row the operations and
  // their order are exactly dot_accumulate's, so results are identical.
  F8 p0 = load8(lanes0), p1 = load8(lanes0 + 8), p2 = load8(lanes0 + 16), p3 = load8(lanes0 + 24);
  F8 q0 = load8(lanes1), q1 = load8(lanes1 + 8), q2 = load8(lanes1 + 16), q3 = load8(lanes1 + 24);
  F8 r0 = load8(lanes2), r1 = load8(lanes2 + 8), r2 = load8(lanes2 + 16), r3 = load8(lanes2 + 24);
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes) {
    const F8 w0 = load8(b + i), w1 = load8(b + i + 8), w2 = load8(b + i + 16),
             w3 = load8(b + i + 24);
    p0 += load8(a0 + i) * w0;
    p1 += load8(a0 + i + 8) * w1;
    p2 += load8(a0 + i + 16) * w2;
    p3 += load8(a0 + i + 24) * w3;
    q0 += load8(a1 + i) * w0;
    q1 += load8(a1 + i + 8) * w1;
    q2 += load8(a1 + i + 16) * w2;
    q3 += load8(a1 + i + 24) * w3;
    r0 += load8(a2 + i) * w0;
    r1 += load8(a2 + i + 8) * w1;
    r2 += load8(a2 + i + 16) * w2;
    r3 += load8(a2 + i + 24) * w3;
  }
  store8(lanes0, p0);
  store8(lanes0 + 8, p1);
  store8(lanes0 + 16, p2);
  store8(lanes0 + 24, p3);
  store8(lanes1, q0);
  store8(lanes1 + 8, q1);
  store8(lanes1 + 16, q2);
  store8(lanes1 + 24, q3);
  store8(lanes2, r0);
  store8(lanes2 + 8, r1);
  store8(lanes2 + 16, r2);
  store8(lanes2 + 24, r3);
  for (int l = 0; i < n; ++i, ++l) {
    lanes0[l] += a0[i] * b[i];
    lanes1[l] += a1[i] * b[i];
    lanes2[l] += a2[i] * b[i];
  }
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

SPECULA_CPU_CLONES void axpy(float alpha, const float* x, float* y, int64_t n) {
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) store8(y + i, load8(y + i) + alpha * load8(x + i));
  for (; i < n; ++i) y[i] += alpha * x[i];
}

namespace {

SPECULA_CPU_CLONES void bf16_row_to_f32(const uint16_t* src, float* dst, int64_t n) {
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) store8_bits(dst + i, load8_u16(src + i) << 16);
  for (; i < n; ++i) dst[i] = bf16_to_f32(src[i]);
}

// The vector form of f16_bits_to_f32 (cpu_internal.h): same three cases.
SPECULA_CPU_CLONES void f16_row_to_f32(const uint16_t* src, float* dst, int64_t n) {
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const U32x8 h = load8_u16(src + i);
    const U32x8 exponent = h & 0x7c00u;
    const U32x8 mantissa = h & 0x03ffu;
    const U32x8 normal = ((h & 0x7fffu) << 13) + (112u << 23);
    const U32x8 inf_nan = (mantissa << 13) | 0x7f800000u;
    const F8 subnormal_value =
        __builtin_convertvector(__builtin_convertvector(mantissa, I32x8), F8) * 0x1p-24f;
    U32x8 subnormal;
    std::memcpy(&subnormal, &subnormal_value, sizeof subnormal);
    U32x8 bits = exponent == 0x7c00u ? inf_nan : (exponent == 0u ? subnormal : normal);
    bits |= (h & 0x8000u) << 16;
    store8_bits(dst + i, bits);
  }
  for (; i < n; ++i) dst[i] = f16_bits_to_f32(src[i]);
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

void ScratchPool::reserve(size_t n) {
  std::lock_guard<std::mutex> lock(mutex_);
  if (buffer_.size() < n) buffer_.resize(n);
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
