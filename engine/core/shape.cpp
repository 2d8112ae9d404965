// SPDX-License-Identifier: Apache-2.0
#include "engine/core/shape.h"

#include "engine/core/error.h"

namespace specula {

Shape::Shape(std::initializer_list<int64_t> dims)
    : Shape(std::span<const int64_t>(dims.begin(), dims.size())) {}

Shape::Shape(std::span<const int64_t> dims) {
  if (dims.size() > kMaxDims)
    fail("shape of rank {} exceeds the maximum rank {}", dims.size(), kMaxDims);
  for (size_t i = 0; i < dims.size(); ++i) {
    if (dims[i] < 0) fail("shape has a negative extent {} at dimension {}", dims[i], i);
    dims_[i] = dims[i];
  }
  rank_ = static_cast<int>(dims.size());
}

int64_t Shape::numel() const {
  int64_t n = 1;
  for (int i = 0; i < rank_; ++i) n *= dims_[static_cast<size_t>(i)];
  return n;
}

std::string Shape::str() const {
  return fmt::format("[{}]", fmt::join(dims(), ", "));
}

bool Shape::operator==(const Shape& other) const {
  if (rank_ != other.rank_) return false;
  for (int i = 0; i < rank_; ++i) {
    if (dims_[static_cast<size_t>(i)] != other.dims_[static_cast<size_t>(i)]) return false;
  }
  return true;
}

}  // namespace specula
