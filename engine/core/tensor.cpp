// SPDX-License-Identifier: Apache-2.0
#include "engine/core/tensor.h"

namespace specula {

Tensor Tensor::reshape(Shape shape) const {
  if (shape.numel() != numel()) {
    fail("cannot reshape {} to {}: element counts {} and {} differ", describe(), shape.str(),
         numel(), shape.numel());
  }
  Tensor out(data_, dtype_, shape, device_);
  if (scales_ != nullptr && rank() > 0 && shape.rank() > 0 &&
      shape[shape.rank() - 1] == shape_[rank() - 1])
    out.scales_ = scales_;
  return out;
}

Tensor Tensor::with_scales(const float* scales) const {
  if (!is_quantized(dtype_)) fail("only quantized tensors carry scales, not {}", describe());
  Tensor out = *this;
  out.scales_ = scales;
  return out;
}

int64_t Tensor::scale_count() const {
  if (rank() == 0) return 0;
  const int64_t last = shape_[rank() - 1];
  return last == 0 ? 0 : numel() / last;
}

Tensor Tensor::scales() const {
  if (scales_ == nullptr || rank() == 0) return Tensor();
  return Tensor(const_cast<float*>(scales_), DType::kF32, Shape{scale_count()}, device_);
}

Tensor Tensor::slice_rows(int64_t begin, int64_t end) const {
  if (rank() == 0 || begin < 0 || end < begin || end > shape_[0]) {
    fail("row slice [{}, {}) out of range for {}", begin, end, describe());
  }
  Shape s = shape_;
  s[0] = end - begin;
  const size_t row_bytes = shape_[0] == 0 ? 0 : nbytes() / static_cast<size_t>(shape_[0]);
  Tensor out(static_cast<char*>(data_) + static_cast<size_t>(begin) * row_bytes, dtype_, s,
             device_);
  if (scales_ != nullptr) {
    // Scales per row of the last dimension: rows of dim 0 hold numel / (dim 0 · last) each.
    const int64_t per_row = shape_[0] == 0 ? 0 : scale_count() / shape_[0];
    out.scales_ = scales_ + begin * per_row;
  }
  return out;
}

Tensor Tensor::row(int64_t i) const {
  Tensor r = slice_rows(i, i + 1);
  auto dims = shape_.dims().subspan(1);
  // A quantized row loses its scale (a one-row view has no rows of its own).
  return Tensor(r.data(), dtype_, Shape(dims), device_);
}

std::span<float> Tensor::f32() const {
  if (dtype_ != DType::kF32) fail("expected an f32 tensor, got {}", describe());
  return {static_cast<float*>(data_), static_cast<size_t>(numel())};
}

std::span<const int32_t> Tensor::i32() const {
  if (dtype_ != DType::kI32) fail("expected an i32 tensor, got {}", describe());
  return {static_cast<const int32_t*>(data_), static_cast<size_t>(numel())};
}

std::string Tensor::describe() const {
  return fmt::format("{}{}", dtype_name(dtype_), shape_.str());
}

float host_scalar(const Tensor& t, const std::string& what) {
  if (t.numel() != 1 || !t.device().is_cpu())
    fail("{} must be one host value, got {}", what, t.describe());
  switch (t.dtype()) {
    case DType::kF32:
      return *t.data_as<const float>();
    case DType::kBF16:
      return bf16_to_f32(*t.data_as<const uint16_t>());
    case DType::kF16:
      return f16_to_f32(*t.data_as<const uint16_t>());
    default:
      fail("{} has dtype {}, expected a float type", what, t.dtype());
  }
}

void check_tensor(const Tensor& t, const Shape& shape, DType dtype, const char* what) {
  if (t.shape() != shape || t.dtype() != dtype) {
    fail("{}: expected {}{}, got {}", what, dtype_name(dtype), shape.str(), t.describe());
  }
}

}  // namespace specula
