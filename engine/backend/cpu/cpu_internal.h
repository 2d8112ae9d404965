// SPDX-License-Identifier: Apache-2.0
// Internals shared by the CPU backend's source files: argument checks, the
// vectorised inner kernels (dot products, dtype conversion) and the linear
// core that both `linear` and `moe_experts` use. Not part of any public API.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>
#include <mutex>
#include <vector>

#include "engine/backend/cpu/cpu_parallel.h"
#include "engine/core/tensor.h"

#include "engine/ops/op_checks.h"

namespace specula::cpu {

// ---- Argument checks. Each throws an Error naming the op and the tensor(s). ----

// `t` lives on the CPU and has memory behind it (an empty view is accepted only
// when it holds no elements).
void check_host(const char* op, const char* name, const Tensor& t);
// Every element of the i32 tensor `ids` (on the host) lies in [0, bound);
// otherwise an Error names the op, the tensor, the flat index and the value.
void check_ids_below(const char* op, const char* name, const Tensor& ids, int64_t bound);
// The device-independent checks (engine/ops/op_checks.h).
using ops::check_dtype;
using ops::check_exact_alias;
using ops::check_float;
using ops::check_no_alias;
using ops::check_rank;
using ops::check_same_shape;
using ops::check_weight;
// Whether `work` scalar operations are enough to pay for starting an OpenMP
// parallel region (used in `if` clauses).
bool worth_parallel(int64_t work);

// ---- Inner kernels (cpu_kernels.cpp). ----

// Dot products accumulate in kLanes f32 partial sums: element i goes to lane
// i % kLanes, and the lanes are summed in a fixed order. Splitting a vector into
// chunks whose lengths are multiples of kLanes gives bit-identical results to one
// pass, which is what keeps `linear` rows independent of the row count.
constexpr int kLanes = 32;

// lanes[i % kLanes] += a[i] * b[i] for i in [0, n).
void dot_accumulate(const float* a, const float* b, int64_t n, float* lanes);
// dot_accumulate for three rows a0, a1, a2 against the same b (bit-identical
// per row to three dot_accumulate calls, with a third of the loads of b).
void dot_accumulate3(const float* a0, const float* a1, const float* a2, const float* b, int64_t n,
                     float* lanes0, float* lanes1, float* lanes2);
// lanes[m][:] accumulate x[m * ldx + :n] · b for m in [0, m_rows), three rows at a time.
inline void dot_accumulate_rows(const float* x, int64_t ldx, int64_t m_rows, const float* b,
                                int64_t n, float (*lanes)[kLanes]) {
  int64_t m = 0;
  for (; m + 3 <= m_rows; m += 3) {
    dot_accumulate3(x + m * ldx, x + (m + 1) * ldx, x + (m + 2) * ldx, b, n, lanes[m], lanes[m + 1],
                    lanes[m + 2]);
  }
  for (; m < m_rows; ++m) dot_accumulate(x + m * ldx, b, n, lanes[m]);
}
float reduce_lanes(const float* lanes);
// y[m · ldy] = reduce_lanes(lanes of dot_accumulate(x + m · ldx, to_f32(w), k))
// for m in [0, m_rows), bit for bit, with the weight row w (k elements, f32 or
// bf16: dtype) loaded and widened once per three rows and the lanes kept in
// registers. What linear runs per weight row.
void dot_rows_reduce(const void* w, DType dtype, const float* x, int64_t ldx, int64_t m_rows,
                     int64_t k, float* y, int64_t ldy);
float dot(const float* a, const float* b, int64_t n);
// y[i] += alpha * x[i].
void axpy(float alpha, const float* x, float* y, int64_t n);
// dst[i] = float(src[i]) for an f32, bf16 or f16 source of n elements.
void to_f32(const void* src, DType dtype, float* dst, int64_t n);
// dst[i] = decode(src[i]) · scale (one f32 product, rounded once) for n
// elements of a quantized row (i8: the integer; f8e4m3: e4m3_to_f32).
void dequantize_to_f32(const void* src, DType dtype, float scale, float* dst, int64_t n);
// Row r of weight w, elements [k0, k0 + n), as f32: to_f32 for float dtypes,
// dequantize_to_f32 with the row's scale for quantized ones.
inline void weight_row_to_f32(const Tensor& w, int64_t r, int64_t k0, float* dst, int64_t n) {
  const size_t elt = dtype_size(w.dtype());
  const char* src =
      static_cast<const char*>(w.data()) + (static_cast<size_t>(r * w.dim(1) + k0)) * elt;
  if (is_quantized(w.dtype())) {
    dequantize_to_f32(src, w.dtype(), w.scale_data()[r], dst, n);
  } else {
    to_f32(src, w.dtype(), dst, n);
  }
}

// Exact f16 → f32, written as selects rather than branches so loops over it
// vectorise; agrees with core's f16_to_f32 on all 65536 inputs (tested).
inline float f16_bits_to_f32(uint16_t h) {
  const uint32_t exponent = h & 0x7c00u;
  const uint32_t mantissa = h & 0x03ffu;
  // Normal numbers: re-bias the exponent from 15 to 127.
  const uint32_t normal = (static_cast<uint32_t>(h & 0x7fffu) << 13) + (112u << 23);
  const uint32_t inf_nan = 0x7f800000u | (mantissa << 13);                // keeps the NaN payload
  const float subnormal_value = static_cast<float>(mantissa) * 0x1p-24f;  // exact (and zero)
  uint32_t subnormal;
  std::memcpy(&subnormal, &subnormal_value, 4);
  uint32_t bits = exponent == 0x7c00u ? inf_nan : (exponent == 0 ? subnormal : normal);
  bits |= static_cast<uint32_t>(h & 0x8000u) << 16;
  float value;
  std::memcpy(&value, &bits, 4);
  return value;
}

// gelu_pytorch_tanh in f32 (gemma4-architecture.md §2.2).
inline float gelu_tanh(float x) {
  constexpr float kBeta = 0.7978845608028654f;  // sqrt(2 / pi)
  constexpr float kKappa = 0.044715f;
  const float inner = kBeta * (x + kKappa * x * x * x);
  return 0.5f * x * (1.0f + std::tanh(inner));
}

// Reads element i of a float tensor of any supported float dtype.
inline float load_float(const Tensor& t, int64_t i) {
  switch (t.dtype()) {
    case DType::kF32:
      return t.data_as<const float>()[i];
    case DType::kBF16:
      return bf16_to_f32(t.data_as<const uint16_t>()[i]);
    case DType::kF16:
      return f16_bits_to_f32(t.data_as<const uint16_t>()[i]);
    default:
      return NAN;  // unreachable: callers check_float first
  }
}

// A growable f32 buffer that one caller at a time borrows, so steady-state
// calls do not allocate. A caller that finds it busy (another thread is inside
// an op on the same backend) gets a private buffer instead of waiting.
class ScratchPool {
 public:
  // Grows the shared buffer to at least n floats (e.g. at model load).
  void reserve(size_t n);
  class Lease {
   public:
    Lease(ScratchPool& pool, size_t n);
    Lease(const Lease&) = delete;
    Lease& operator=(const Lease&) = delete;
    float* data() { return data_; }

   private:
    std::unique_lock<std::mutex> lock_;
    std::vector<float> own_;
    float* data_ = nullptr;
  };

 private:
  std::mutex mutex_;
  std::vector<float> buffer_;
};

// y[m, :] = x[m, :] · wᵀ for m in [0, m_rows); x rows are k floats apart, y rows
// n floats apart (n = w.dim(0)); w [n, k] f32|bf16|f16 is already checked.
// Every element is one fixed-order dot product, so a row's result does not
// depend on m_rows (decode and speculative verification agree bit for bit). Up
// to kGemvMaxRows rows stream each weight row once in chunks; more rows widen
// each weight row once into `scratch` and dot it with every activation row.
// Opens its own OpenMP region: call it from outside one.
constexpr int64_t kGemvMaxRows = 8;
void linear_rows(const float* x, int64_t m_rows, const Tensor& w, float* y, ScratchPool& scratch);

}  // namespace specula::cpu
