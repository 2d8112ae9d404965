// SPDX-License-Identifier: Apache-2.0
// Tensor: a non-owning, contiguous, row-major view of typed memory on a device.
// Whoever created the memory (a Buffer, an Arena, a mapped file) owns it and must
// outlive every view.
#pragma once

#include <cstdint>
#include <span>
#include <string>

#include "engine/core/device.h"
#include "engine/core/dtype.h"
#include "engine/core/error.h"
#include "engine/core/shape.h"

namespace specula {

class Tensor {
 public:
  Tensor() = default;
  Tensor(void* data, DType dtype, Shape shape, Device device = Device::cpu())
      : data_(data), dtype_(dtype), shape_(shape), device_(device) {}

  bool empty() const { return data_ == nullptr; }
  void* data() const { return data_; }
  template <typename T>
  T* data_as() const {
    return static_cast<T*>(data_);
  }
  DType dtype() const { return dtype_; }
  const Shape& shape() const { return shape_; }
  Device device() const { return device_; }
  int rank() const { return shape_.rank(); }
  int64_t dim(int i) const { return shape_.dim(i); }
  int64_t numel() const { return shape_.numel(); }
  size_t nbytes() const { return static_cast<size_t>(numel()) * dtype_size(dtype_); }

  // Quantized tensors (is_quantized(dtype): i8, f8e4m3) carry one f32 scale
  // per row of their last dimension, on the same device, owned with the data:
  // numel / dim(rank - 1) scales in row-major order. A matrix [R, C] has
  // scales [R] and element [r, c] stands for decode(q[r, c]) · scales[r]; an
  // fp8 KV cache [T, KV, D] has scales [T · KV], one per (token, kv head).
  // Views of other dtypes have none.
  Tensor with_scales(const float* scales) const;
  const float* scale_data() const { return scales_; }
  // The scales as a view, f32 [numel / dim(rank - 1)] (empty when there are none).
  Tensor scales() const;
  // How many scales a quantized view of this shape has: numel / dim(rank - 1).
  int64_t scale_count() const;

  // Same memory, another shape with the same element count. A quantized view
  // keeps its scales only when its rows stay the same (last dimension unchanged).
  Tensor reshape(Shape shape) const;
  // Rows [begin, end) along dimension 0 (with their scales, when quantized).
  Tensor slice_rows(int64_t begin, int64_t end) const;
  // Row i along dimension 0, with that dimension dropped.
  Tensor row(int64_t i) const;

  // f32 element span (CPU only); throws if the dtype differs.
  std::span<float> f32() const;
  std::span<const int32_t> i32() const;

  // "f32[2, 3]": used in error messages.
  std::string describe() const;

 private:
  void* data_ = nullptr;
  DType dtype_ = DType::kF32;
  Shape shape_;
  Device device_;
  const float* scales_ = nullptr;  // quantized dtypes only: f32 [scale_count()]
};

// The value of a one-element float tensor in host memory (f32, bf16 or f16),
// as f32. Throws an Error naming `what` otherwise.
float host_scalar(const Tensor& t, const std::string& what);

// Throws an Error naming `what` unless `t` has exactly `shape` and `dtype`.
void check_tensor(const Tensor& t, const Shape& shape, DType dtype, const char* what);

}  // namespace specula
