// SPDX-License-Identifier: Apache-2.0
#include "engine/core/buffer.h"

#include <cstdlib>
#include <cstring>
#include <new>

namespace specula {

void Buffer::Free::operator()(void* p) const {
  std::free(p);
}

Buffer::Buffer(size_t nbytes) : size_(nbytes) {
  const size_t rounded = (nbytes + kAlignment - 1) / kAlignment * kAlignment;
  void* p = std::aligned_alloc(kAlignment, rounded == 0 ? kAlignment : rounded);
  if (p == nullptr) fail("out of host memory allocating {} bytes", nbytes);
  std::memset(p, 0, rounded == 0 ? kAlignment : rounded);
  data_.reset(p);
}

HostTensor::HostTensor(DType dtype, Shape shape)
    : buffer_(static_cast<size_t>(shape.numel()) * dtype_size(dtype)),
      view_(buffer_.data(), dtype, shape) {}

}  // namespace specula
