// SPDX-License-Identifier: Apache-2.0
// Shape: up to kMaxDims int64 extents, row-major.
#pragma once

#include <fmt/format.h>

#include <array>
#include <cstdint>
#include <initializer_list>
#include <span>
#include <string>
#include <vector>

namespace specula {

class Shape {
 public:
  static constexpr int kMaxDims = 6;

  Shape() = default;
  Shape(std::initializer_list<int64_t> dims);
  explicit Shape(std::span<const int64_t> dims);

  int rank() const { return rank_; }
  int64_t operator[](int i) const { return dims_[static_cast<size_t>(i)]; }
  int64_t& operator[](int i) { return dims_[static_cast<size_t>(i)]; }
  // Negative indices count from the end (-1 = last dimension).
  int64_t dim(int i) const { return dims_[static_cast<size_t>(i < 0 ? rank_ + i : i)]; }
  int64_t numel() const;
  std::span<const int64_t> dims() const { return {dims_.data(), static_cast<size_t>(rank_)}; }
  std::vector<int64_t> to_vector() const { return {dims_.begin(), dims_.begin() + rank_}; }
  std::string str() const;  // "[2, 3]"

  bool operator==(const Shape& other) const;
  bool operator!=(const Shape& other) const { return !(*this == other); }

 private:
  std::array<int64_t, kMaxDims> dims_{};
  int rank_ = 0;
};

}  // namespace specula

template <>
struct fmt::formatter<specula::Shape> : fmt::formatter<std::string> {
  auto format(const specula::Shape& s, fmt::format_context& ctx) const {
    return fmt::formatter<std::string>::format(s.str(), ctx);
  }
};
