// SPDX-License-Identifier: Apache-2.0
// Buffer: owning, aligned host memory (move-only). Device memory is owned by the
// memory layer's allocators; a Buffer is host-side only.
#pragma once

#include <cstddef>
#include <memory>

#include "engine/core/tensor.h"

namespace specula {

class Buffer {
 public:
  static constexpr size_t kAlignment = 64;

  Buffer() = default;
  explicit Buffer(size_t nbytes);  // zero-filled
  Buffer(Buffer&&) noexcept = default;
  Buffer& operator=(Buffer&&) noexcept = default;
  Buffer(const Buffer&) = delete;
  Buffer& operator=(const Buffer&) = delete;

  void* data() const { return data_.get(); }
  size_t size() const { return size_; }

 private:
  struct Free {
    void operator()(void* p) const;
  };
  std::unique_ptr<void, Free> data_;
  size_t size_ = 0;
};

// A Buffer with the tensor that views all of it: the usual way to own a tensor.
class HostTensor {
 public:
  HostTensor() = default;
  HostTensor(DType dtype, Shape shape);  // zero-filled
  HostTensor(HostTensor&&) noexcept = default;
  HostTensor& operator=(HostTensor&&) noexcept = default;

  const Tensor& view() const { return view_; }
  operator const Tensor&() const { return view_; }  // NOLINT: a HostTensor is usable as a view
  template <typename T>
  T* data() const {
    return view_.data_as<T>();
  }
  std::span<float> f32() const { return view_.f32(); }
  const Shape& shape() const { return view_.shape(); }
  DType dtype() const { return view_.dtype(); }
  int64_t numel() const { return view_.numel(); }

 private:
  Buffer buffer_;
  Tensor view_;
};

}  // namespace specula
