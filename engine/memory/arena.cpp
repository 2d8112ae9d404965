// SPDX-License-Identifier: Apache-2.0
#include "engine/memory/arena.h"

#include <algorithm>

namespace specula {

Tensor Arena::alloc(DType dtype, Shape shape) {
  const size_t bytes = static_cast<size_t>(shape.numel()) * dtype_size(dtype);
  const size_t aligned = (bytes + Buffer::kAlignment - 1) / Buffer::kAlignment * Buffer::kAlignment;
  if (measuring_) {
    used_ += aligned;
    high_water_ = std::max(high_water_, used_);
    return Tensor(nullptr, dtype, shape);
  }
  if (used_ + aligned > buffer_.size()) {
    fail("scratch arena exhausted: {} bytes requested for {}{}, {} of {} bytes in use", bytes,
         dtype_name(dtype), shape.str(), used_, buffer_.size());
  }
  Tensor t(static_cast<char*>(buffer_.data()) + used_, dtype, shape);
  used_ += aligned;
  high_water_ = std::max(high_water_, used_);
  return t;
}

}  // namespace specula
