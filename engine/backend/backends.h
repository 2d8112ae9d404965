// SPDX-License-Identifier: Apache-2.0
// Backend registry: the one place that knows which backends were built.
#pragma once

#include <memory>

#include "engine/ops/backend.h"

namespace specula {

// The process-wide backend for `device` (created on first use, thread-safe).
// Throws an Error for a device this build does not support
// (e.g. "cuda:0: specula was built without CUDA").
Backend& backend_for(Device device);

std::unique_ptr<Backend> make_cpu_backend();
// Defined by the CUDA backend, or by the no_cuda stub, which throws.
std::unique_ptr<Backend> make_cuda_backend(int device_index);
bool cuda_available();

// CUDA kernel choices under measurement: A/B switches of an open experiment
// (#30), set by `specula bench --cuda-tiled-products / --cuda-raw-kv-staging`
// and removed once it is decided. Results never depend on them (each choice is
// tested for the same bits); only speed does. Process-wide; set them before
// the first CUDA op (a recorded step keeps the choice it was recorded with). A
// build without CUDA keeps and ignores them.
struct CudaKernelChoices {
  // Products of 24+ rows with bf16 weights through the tiled kernels
  // (cuda_linear_tiled.cu) instead of the row-tile kernels.
  bool tiled_products = false;
  // Attention partials over bf16 / fp8 caches copy the cache's own bytes into
  // shared memory asynchronously (cp.async) and widen them where the loops
  // read them, instead of widening each row to f32 through registers first.
  bool raw_kv_staging = false;
};
void set_cuda_kernel_choices(const CudaKernelChoices& choices);
CudaKernelChoices cuda_kernel_choices();

// The CPU backend's threads, the calling thread included (process-wide; the
// default is every core this process may run on). 0 restores the default; an
// Error names a count outside [0, 4 x the cores]. Call it while no CPU op runs.
// Results do not depend on it (the kernels are thread-count invariant).
void set_cpu_threads(int threads);
int cpu_threads();
// The cores this process may run on (its affinity mask).
int cpu_cores();

}  // namespace specula
