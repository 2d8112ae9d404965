// SPDX-License-Identifier: Apache-2.0
// Where memory lives and where an op runs.
#pragma once

#include <cstdint>
#include <string>

namespace specula {

enum class DeviceType : uint8_t { kCpu, kCuda };

struct Device {
  DeviceType type = DeviceType::kCpu;
  int index = 0;

  static Device cpu() { return {DeviceType::kCpu, 0}; }
  static Device cuda(int i = 0) { return {DeviceType::kCuda, i}; }
  bool is_cpu() const { return type == DeviceType::kCpu; }
  bool operator==(const Device&) const = default;
  std::string str() const {
    return type == DeviceType::kCpu ? "cpu" : "cuda:" + std::to_string(index);
  }
};

}  // namespace specula
