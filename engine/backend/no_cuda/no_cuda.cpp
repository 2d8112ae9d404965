// SPDX-License-Identifier: Apache-2.0
// Compiled when SPECULA_CUDA=OFF: every CUDA entry point says so clearly.
#include "engine/backend/backends.h"

namespace specula {

std::unique_ptr<Backend> make_cuda_backend(int device_index) {
  fail(
      "cuda:{}: specula was built without CUDA (configure with -DSPECULA_CUDA=ON on a machine with "
      "nvcc)",
      device_index);
}

bool cuda_available() {
  return false;
}

}  // namespace specula
