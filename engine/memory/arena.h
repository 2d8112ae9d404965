// SPDX-License-Identifier: Apache-2.0
// Arena: a bump allocator for per-step scratch, on the host or on a device
// (given a MemoryResource, e.g. the Backend). Reserve once from the
// worst-case step, then `reset()` at the start of every step: steady-state
// decode allocates nothing. Allocation beyond the reservation throws (a sizing
// bug, not a runtime condition), so growth never happens silently.
#pragma once

#include <cstddef>

#include "engine/core/buffer.h"
#include "engine/memory/memory_resource.h"

namespace specula {

class Arena {
 public:
  Arena() = default;
  explicit Arena(size_t capacity_bytes) : buffer_(capacity_bytes) {}
  // Device scratch from `memory` (which must outlive the arena); a CPU
  // resource or null gives host memory.
  Arena(size_t capacity_bytes, MemoryResource* memory);
  // An arena that only measures: alloc() returns views with no memory and
  // counts the bytes a real arena would need (for sizing from a dry run).
  static Arena measuring() {
    Arena a;
    a.measuring_ = true;
    return a;
  }

  // Drops every allocation; views handed out before become invalid.
  void reset() { used_ = 0; }
  // Uninitialised memory for `shape` (contents are whatever the last step left).
  Tensor alloc(DType dtype, Shape shape);
  size_t used() const { return used_; }
  size_t capacity() const { return device_buffer_.data() ? device_buffer_.size() : buffer_.size(); }
  size_t high_water() const { return high_water_; }
  // Start of the memory behind the views (null for a measuring arena).
  const void* base() const {
    return device_buffer_.data() ? device_buffer_.data() : static_cast<const void*>(buffer_.data());
  }

 private:
  Buffer buffer_;
  DeviceBuffer device_buffer_;  // used instead of buffer_ for device scratch
  size_t used_ = 0;
  size_t high_water_ = 0;
  bool measuring_ = false;
};

}  // namespace specula
