// SPDX-License-Identifier: Apache-2.0
#include "engine/memory/memory_resource.h"

namespace specula {

DeviceBuffer::DeviceBuffer(MemoryResource& memory, size_t bytes)
    : memory_(&memory), data_(bytes ? memory.allocate(bytes) : nullptr), size_(bytes) {}

DeviceBuffer& DeviceBuffer::operator=(DeviceBuffer&& o) noexcept {
  if (this != &o) {
    reset();
    memory_ = o.memory_;
    data_ = o.data_;
    size_ = o.size_;
    o.memory_ = nullptr;
    o.data_ = nullptr;
    o.size_ = 0;
  }
  return *this;
}

Device DeviceBuffer::device() const {
  return memory_ ? memory_->device() : Device::cpu();
}

Tensor DeviceBuffer::view(DType dtype, Shape shape) const {
  const size_t need = static_cast<size_t>(shape.numel()) * dtype_size(dtype);
  SPECULA_CHECK(need <= size_, "DeviceBuffer::view: {}{} needs {} bytes, buffer has {}",
                dtype_name(dtype), shape.str(), need, size_);
  return Tensor(data_, dtype, shape, device());
}

void DeviceBuffer::reset() noexcept {
  if (memory_ && data_) memory_->release(data_);
  data_ = nullptr;
  size_ = 0;
}

CachingPool::~CachingPool() {
  for (auto& [size, p] : free_) upstream_.release(p);
  for (auto& [p, size] : live_) upstream_.release(p);  // leaked by a caller: still freed
}

void* CachingPool::allocate(size_t bytes) {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    auto it = free_.find(bytes);
    if (it != free_.end()) {
      void* p = it->second;
      free_.erase(it);
      live_.emplace(p, bytes);
      return p;
    }
  }
  void* p = upstream_.allocate(bytes);
  std::lock_guard<std::mutex> lock(mutex_);
  ++upstream_allocations_;
  live_.emplace(p, bytes);
  return p;
}

void CachingPool::release(void* p) noexcept {
  if (p == nullptr) return;
  std::lock_guard<std::mutex> lock(mutex_);
  auto it = live_.find(p);
  if (it == live_.end()) return;
  free_.emplace(it->second, p);
  live_.erase(it);
}

size_t CachingPool::cached_bytes() const {
  std::lock_guard<std::mutex> lock(mutex_);
  size_t n = 0;
  for (auto& [size, p] : free_) n += size;
  return n;
}

}  // namespace specula
