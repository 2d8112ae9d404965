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

namespace {
CudaKernelChoices g_choices;  // kept for cuda_kernel_choices(); nothing reads them
}  // namespace

void set_cuda_kernel_choices(const CudaKernelChoices& choices) {
  g_choices = choices;
}

CudaKernelChoices cuda_kernel_choices() {
  return g_choices;
}

}  // namespace specula
