// SPDX-License-Identifier: Apache-2.0
// Helpers of the CUDA tests that load models (model_cuda_test.cpp,
// sampling_decode_test.cpp): where the golden fixtures live, whether one is
// there, and load options for the GPU.
#pragma once

#include <filesystem>
#include <string>

#include "engine/model/gemma4/gemma4.h"

namespace specula::test {

inline std::string golden(const std::string& name) {
  return std::string(SPECULA_SOURCE_DIR) + "/tests/golden/" + name;
}
inline bool have(const std::string& name) {
  return std::filesystem::exists(golden(name) + "/expected.safetensors");
}
inline gemma4::LoadOptions on_cuda() {
  gemma4::LoadOptions o;
  o.device = Device::cuda(0);
  return o;
}

}  // namespace specula::test
