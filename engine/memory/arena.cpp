// SPDX-License-Identifier: Apache-2.0
#include "engine/memory/arena.h"

#include <algorithm>

namespace specula {

Arena::Arena(size_t capacity_bytes, MemoryResource* memory) {
  if (memory == nullptr || memory->device().is_cpu()) {
    buffer_ = Buffer(capacity_bytes);
  } else {
    device_buffer_ = DeviceBuffer(*memory, capacity_bytes);
  }
}

Tensor Arena::alloc(DType dtype, Shape shape) {
  const size_t bytes = static_cast<size_t>(shape.numel()) * dtype_size(dtype);
  const size_t aligned = (bytes + Buffer::kAlignment - 1) / Buffer::kAlignment * Buffer::kAlignment;
  if (measuring_) {
    used_ += aligned;
    high_water_ = std::max(high_water_, used_);
    return Tensor(nullptr, dtype, shape);
  }
  if (used_ + aligned > capacity()) {
    fail("scratch arena exhausted: {} bytes requested for {}{}, {} of {} bytes in use", bytes,
         dtype_name(dtype), shape.str(), used_, capacity());
  }
  Tensor t = device_buffer_.data()
                 ? Tensor(static_cast<char*>(device_buffer_.data()) + used_, dtype, shape,
                          device_buffer_.device())
                 : Tensor(static_cast<char*>(buffer_.data()) + used_, dtype, shape);
  used_ += aligned;
  high_water_ = std::max(high_water_, used_);
  return t;
}

}  // namespace specula
