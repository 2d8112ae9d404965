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

// The CPU backend's threads, the calling thread included (process-wide; the
// default is every core this process may run on). 0 restores the default; an
// Error names a count outside [0, 4 x the cores]. Call it while no CPU op runs.
// Results do not depend on it (the kernels are thread-count invariant).
void set_cpu_threads(int threads);
int cpu_threads();
// The cores this process may run on (its affinity mask).
int cpu_cores();

}  // namespace specula
