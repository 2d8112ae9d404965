// SPDX-License-Identifier: Apache-2.0
// Helpers for the cross-backend tests: a CPU reference backend, the CUDA
// backend under test, host<->device tensors, and comparisons that report the
// worst element. Every test calls SKIP_WITHOUT_CUDA() first.
#pragma once

#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <limits>
#include <vector>

#include "engine/backend/backends.h"
#include "engine/core/buffer.h"
#include "engine/memory/memory_resource.h"

namespace specula::test {

#define SKIP_WITHOUT_CUDA()                                             \
  do {                                                                  \
    if (!::specula::cuda_available()) GTEST_SKIP() << "no CUDA device"; \
  } while (0)

inline Backend& cpu_be() {
  return backend_for(Device::cpu());
}
inline Backend& gpu_be() {
  return backend_for(Device::cuda(0));
}

// A host tensor and its device twin.
struct Twin {
  HostTensor host;
  DeviceBuffer dev_buf;
  Tensor dev;
  Twin(DType dtype, Shape shape) : host(dtype, shape) {
    dev_buf = DeviceBuffer(gpu_be(), std::max<size_t>(host.view().nbytes(), 1));
    dev = Tensor(dev_buf.data(), dtype, shape, gpu_be().device());
  }
  // Random uniform [lo, hi) on both sides (same values, fill_uniform is exact across backends).
  void randomize(uint64_t seed, float lo = -1.0f, float hi = 1.0f) {
    cpu_be().fill_uniform(host, seed, lo, hi);
    push();
  }
  void push() { gpu_be().upload(host.view().data(), dev); }
  // Device contents as a new host tensor.
  HostTensor pull() const {
    HostTensor out(host.dtype(), host.shape());
    gpu_be().download(dev, out.view().data());
    return out;
  }
};

// Fills a host f32 tensor with NaN so that an output element the GPU never writes fails.
inline void poison(const HostTensor& t) {
  float* p = t.data<float>();
  for (int64_t i = 0; i < t.numel(); ++i) p[i] = std::numeric_limits<float>::quiet_NaN();
}

// A twin output tensor whose device copy starts as NaN.
inline Twin poisoned_output(Shape shape) {
  Twin y(DType::kF32, shape);
  poison(y.host);
  y.push();
  return y;
}

// Whether n floats at a and b have the same bits.
inline bool same_bits(const float* a, const float* b, int64_t n) {
  return std::memcmp(a, b, static_cast<size_t>(n) * sizeof(float)) == 0;
}

// max |a - b| / (max |b| + tiny) style comparison: fails listing the worst index.
inline void expect_close(const Tensor& got, const Tensor& want, float rel_tol, const char* what) {
  ASSERT_EQ(got.numel(), want.numel()) << what;
  const float* g = got.data_as<const float>();
  const float* w = want.data_as<const float>();
  double max_ref = 1e-30, worst = 0;
  int64_t worst_i = -1;
  for (int64_t i = 0; i < want.numel(); ++i) max_ref = std::max(max_ref, std::fabs(double(w[i])));
  for (int64_t i = 0; i < want.numel(); ++i) {
    const double d = std::fabs(double(g[i]) - double(w[i]));
    if (!(d <= worst)) {  // NaN-safe
      worst = std::isnan(d) ? INFINITY : d;
      worst_i = i;
    }
  }
  EXPECT_LE(worst / max_ref, rel_tol)
      << what << ": worst element " << worst_i << " got " << (worst_i >= 0 ? g[worst_i] : 0)
      << " want " << (worst_i >= 0 ? w[worst_i] : 0) << " (max |ref| " << max_ref << ")";
}

inline void expect_equal_i32(const Tensor& got, const Tensor& want, const char* what) {
  ASSERT_EQ(got.numel(), want.numel()) << what;
  for (int64_t i = 0; i < want.numel(); ++i) {
    ASSERT_EQ(got.data_as<const int32_t>()[i], want.data_as<const int32_t>()[i])
        << what << " at " << i;
  }
}

// Sets the CUDA kernel choices under measurement for a scope (the tests of a
// choice that is off by default), restoring the previous ones after.
class ScopedKernelChoices {
 public:
  explicit ScopedKernelChoices(const CudaKernelChoices& choices) : saved_(cuda_kernel_choices()) {
    set_cuda_kernel_choices(choices);
  }
  ~ScopedKernelChoices() { set_cuda_kernel_choices(saved_); }
  ScopedKernelChoices(const ScopedKernelChoices&) = delete;
  ScopedKernelChoices& operator=(const ScopedKernelChoices&) = delete;

 private:
  CudaKernelChoices saved_;
};

}  // namespace specula::test
