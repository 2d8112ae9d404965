// SPDX-License-Identifier: Apache-2.0
#include "engine/backend/backends.h"

#include <map>
#include <mutex>

namespace specula {

Backend& backend_for(Device device) {
  static std::mutex mutex;
  static std::map<std::pair<int, int>, std::unique_ptr<Backend>> backends;
  std::lock_guard<std::mutex> lock(mutex);
  auto key = std::make_pair(static_cast<int>(device.type), device.index);
  auto it = backends.find(key);
  if (it != backends.end()) return *it->second;
  std::unique_ptr<Backend> backend =
      device.is_cpu() ? make_cpu_backend() : make_cuda_backend(device.index);
  Backend& ref = *backend;
  backends.emplace(key, std::move(backend));
  return ref;
}

}  // namespace specula
