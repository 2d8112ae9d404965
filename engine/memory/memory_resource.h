// SPDX-License-Identifier: Apache-2.0
// MemoryResource: where device memory comes from (a Backend is one), and
// DeviceBuffer, the RAII owner of one allocation from it.
//
// CachingPool keeps released blocks for reuse by size, so that sequences that
// come and go (the KV cache of finished requests) do not return to the device
// allocator in steady state.
#pragma once

#include <cstddef>
#include <cstdint>
#include <map>
#include <mutex>

#include "engine/core/device.h"
#include "engine/core/tensor.h"

namespace specula {

class MemoryResource {
 public:
  virtual ~MemoryResource() = default;
  virtual Device device() const = 0;
  // Uninitialised memory of `bytes` (≥ 256-byte aligned) on device(); throws an
  // Error naming the size (and what is free, where known) on failure.
  virtual void* allocate(size_t bytes) = 0;
  // Returns memory from allocate(); null is ignored.
  virtual void release(void* p) noexcept = 0;
};

// Move-only owner of `bytes` from a MemoryResource (which must outlive it).
class DeviceBuffer {
 public:
  DeviceBuffer() = default;
  DeviceBuffer(MemoryResource& memory, size_t bytes);
  ~DeviceBuffer() { reset(); }
  DeviceBuffer(DeviceBuffer&& o) noexcept { *this = std::move(o); }
  DeviceBuffer& operator=(DeviceBuffer&& o) noexcept;
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;

  void* data() const { return data_; }
  size_t size() const { return size_; }
  Device device() const;
  // A tensor over the start of this buffer (shape's bytes must fit).
  Tensor view(DType dtype, Shape shape) const;
  void reset() noexcept;

 private:
  MemoryResource* memory_ = nullptr;
  void* data_ = nullptr;
  size_t size_ = 0;
};

// A MemoryResource that caches released blocks by exact size and hands them
// out again; it returns everything to `upstream` when destroyed. Thread-safe.
class CachingPool final : public MemoryResource {
 public:
  explicit CachingPool(MemoryResource& upstream) : upstream_(upstream) {}
  ~CachingPool() override;
  Device device() const override { return upstream_.device(); }
  void* allocate(size_t bytes) override;
  void release(void* p) noexcept override;
  // Calls that reached the upstream allocator (for tests and logs).
  int64_t upstream_allocations() const { return upstream_allocations_; }
  size_t cached_bytes() const;

 private:
  MemoryResource& upstream_;
  mutable std::mutex mutex_;
  std::map<void*, size_t> live_;       // handed out: pointer -> size
  std::multimap<size_t, void*> free_;  // cached: size -> pointer
  int64_t upstream_allocations_ = 0;
};

}  // namespace specula
