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

}  // namespace specula
