// SPDX-License-Identifier: Apache-2.0
#include "tests/cuda/late_writer.h"

#include <cstdint>
#include <stdexcept>
#include <string>

namespace specula::test {
namespace {

// About 0.5 ms at the H200's 1.98 GHz: far longer than any dependent's prologue.
constexpr long long kSpinCycles = 1'000'000;

__global__ void late_copy_kernel(const uint32_t* src, uint32_t* dst, int64_t words) {
  asm volatile("griddepcontrol.launch_dependents;");
  const long long t0 = clock64();
  while (clock64() - t0 < kSpinCycles) {
  }
  for (int64_t i = threadIdx.x; i < words; i += blockDim.x) dst[i] = src[i];
}

}  // namespace

void late_copy(const void* src, void* dst, size_t bytes, cudaStream_t stream) {
  if (bytes % 4 != 0) throw std::invalid_argument("late_copy: bytes must be a multiple of 4");
  late_copy_kernel<<<1, 256, 0, stream>>>(static_cast<const uint32_t*>(src),
                                          static_cast<uint32_t*>(dst),
                                          static_cast<int64_t>(bytes / 4));
  const cudaError_t err = cudaGetLastError();
  if (err != cudaSuccess) {
    throw std::runtime_error(std::string("late_copy: ") + cudaGetErrorString(err));
  }
}

}  // namespace specula::test
