// SPDX-License-Identifier: Apache-2.0
// The CPU backend's innermost loops, written with explicit vectors and fixed
// lanes (no reassociated reductions, no -ffast-math). On x86-64 Linux each is
// also compiled for AVX2 and picked at load time, since the build assumes no
// instruction set beyond the baseline. Both versions perform the same f32
// operations in the same order, so results are identical whichever one runs.
#include <array>
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

namespace {

typedef float F4 __attribute__((vector_size(16)));

// The fixed lane tree of reduce_lanes (t[l] += t[l + w] for w = 16, 8, 4, 2,
// 1) on lanes held as four vectors (lanes 8j .. 8j + 7 in a_j): the same
// additions of the same operands, so the same bits, without a round trip
// through memory.
[[gnu::always_inline]] inline float reduce_vectors(F8 a0, F8 a1, F8 a2, F8 a3) {
  a0 += a2;  // width 16: lanes 0-7 and 8-15 take 16-23 and 24-31
  a1 += a3;
  a0 += a1;  // width 8
  const F4 lo = __builtin_shufflevector(a0, a0, 0, 1, 2, 3);
  const F4 hi = __builtin_shufflevector(a0, a0, 4, 5, 6, 7);
  const F4 s = lo + hi;          // width 4
  const float t0 = s[0] + s[2];  // width 2
  const float t1 = s[1] + s[3];
  return t0 + t1;  // width 1
}

}  // namespace

SPECULA_CPU_CLONES float reduce_lanes(const float* lanes) {
  return reduce_vectors(load8(lanes), load8(lanes + 8), load8(lanes + 16), load8(lanes + 24));
}

namespace {

// Eight weights at w + i as f32: bf16 widened exactly, or f32 as is.
template <bool kBf16>
[[gnu::always_inline]] inline F8 load_w8(const void* w, int64_t i) {
  if constexpr (kBf16) {
    const U32x8 bits = load8_u16(static_cast<const uint16_t*>(w) + i) << 16;
    F8 v;
    std::memcpy(&v, &bits, sizeof v);
    return v;
  } else {
    return load8(static_cast<const float*>(w) + i);
  }
}

template <bool kBf16>
[[gnu::always_inline]] inline float load_w1(const void* w, int64_t i) {
  if constexpr (kBf16) {
    return bf16_to_f32(static_cast<const uint16_t*>(w)[i]);
  } else {
    return static_cast<const float*>(w)[i];
  }
}

// y[m · ldy] = reduce_lanes of the lanes dot_accumulate leaves for x row m
// (rows ldx apart) against the weight row w of k elements, for M rows at once:
// every weight vector is loaded (and widened) once for the M rows, and the
// lanes never leave the registers. Per row, the multiplications, the additions
// into each lane and the final tree are exactly those of to_f32 +
// dot_accumulate + reduce_lanes, so the bits are theirs.
template <int M, bool kBf16>
[[gnu::always_inline]] inline void dot_rows_reduced(const void* w, const float* x, int64_t ldx,
                                                    int64_t k, float* y, int64_t ldy) {
  F8 acc[M][4];
#pragma GCC unroll 4
  for (int m = 0; m < M; ++m) {
    for (int j = 0; j < 4; ++j) acc[m][j] = F8{};
  }
  int64_t i = 0;
  for (; i + kLanes <= k; i += kLanes) {
    const F8 w0 = load_w8<kBf16>(w, i), w1 = load_w8<kBf16>(w, i + 8),
             w2 = load_w8<kBf16>(w, i + 16), w3 = load_w8<kBf16>(w, i + 24);
#pragma GCC unroll 4
    for (int m = 0; m < M; ++m) {
      const float* xm = x + m * ldx + i;
      acc[m][0] += load8(xm) * w0;
      acc[m][1] += load8(xm + 8) * w1;
      acc[m][2] += load8(xm + 16) * w2;
      acc[m][3] += load8(xm + 24) * w3;
    }
  }
  if (i == k) {
#pragma GCC unroll 4
    for (int m = 0; m < M; ++m) {
      y[m * ldy] = reduce_vectors(acc[m][0], acc[m][1], acc[m][2], acc[m][3]);
    }
    return;
  }
  // A partial last step: element i + l goes to lane l, as in dot_accumulate.
#pragma GCC unroll 4
  for (int m = 0; m < M; ++m) {
    float lanes[kLanes];
    for (int j = 0; j < 4; ++j) store8(lanes + 8 * j, acc[m][j]);
    for (int64_t e = i; e < k; ++e) lanes[e - i] += x[m * ldx + e] * load_w1<kBf16>(w, e);
    y[m * ldy] =
        reduce_vectors(load8(lanes), load8(lanes + 8), load8(lanes + 16), load8(lanes + 24));
  }
}

}  // namespace

// Entry points per row count (target_clones needs plain functions; the
// always-inline body above is compiled into each clone).
#define SPECULA_DOT_ROWS(M, NAME, BF16)                                                         \
  SPECULA_CPU_CLONES void NAME(const void* w, const float* x, int64_t ldx, int64_t k, float* y, \
                               int64_t ldy) {                                                   \
    dot_rows_reduced<M, BF16>(w, x, ldx, k, y, ldy);                                            \
  }
SPECULA_DOT_ROWS(1, dot_rows1_bf16, true)
SPECULA_DOT_ROWS(2, dot_rows2_bf16, true)
SPECULA_DOT_ROWS(3, dot_rows3_bf16, true)
SPECULA_DOT_ROWS(1, dot_rows1_f32, false)
SPECULA_DOT_ROWS(2, dot_rows2_f32, false)
SPECULA_DOT_ROWS(3, dot_rows3_f32, false)
#undef SPECULA_DOT_ROWS

float dot(const float* a, const float* b, int64_t n) {
  float y;
  dot_rows1_f32(b, a, 0, n, &y, 0);  // a · b lane by lane, as dot_accumulate + reduce_lanes
  return y;
}

void dot_rows_reduce(const void* w, DType dtype, const float* x, int64_t ldx, int64_t m_rows,
                     int64_t k, float* y, int64_t ldy) {
  const bool bf16 = dtype == DType::kBF16;
  int64_t m = 0;
  for (; m + 3 <= m_rows; m += 3) {
    (bf16 ? dot_rows3_bf16 : dot_rows3_f32)(w, x + m * ldx, ldx, k, y + m * ldy, ldy);
  }
  if (m_rows - m == 2) {
    (bf16 ? dot_rows2_bf16 : dot_rows2_f32)(w, x + m * ldx, ldx, k, y + m * ldy, ldy);
  } else if (m_rows - m == 1) {
    (bf16 ? dot_rows1_bf16 : dot_rows1_f32)(w, x + m * ldx, ldx, k, y + m * ldy, ldy);
  }
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

void dequantize_to_f32(const void* src, DType dtype, float scale, float* dst, int64_t n) {
  switch (dtype) {
    case DType::kI8: {
      const auto* q = static_cast<const int8_t*>(src);
      for (int64_t i = 0; i < n; ++i) dst[i] = static_cast<float>(q[i]) * scale;
      return;
    }
    case DType::kF8E4M3: {
      // e4m3_to_f32 of every code, once: a lookup per element instead of the decode.
      static const std::array<float, 256> kDecoded = [] {
        std::array<float, 256> t{};
        for (int c = 0; c < 256; ++c)
          t[static_cast<size_t>(c)] = e4m3_to_f32(static_cast<uint8_t>(c));
        return t;
      }();
      const auto* q = static_cast<const uint8_t*>(src);
      for (int64_t i = 0; i < n; ++i) dst[i] = kDecoded[q[i]] * scale;
      return;
    }
    default:
      fail("dequantize_to_f32: {} is not a quantized dtype", dtype_name(dtype));
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
