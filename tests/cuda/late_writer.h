// SPDX-License-Identifier: Apache-2.0
// A late-writing predecessor for the programmatic-dependent-launch tests
// (pdl_order_test.cpp): late_copy lets the kernel queued after it launch at
// once (griddepcontrol.launch_dependents at its top) and writes dst only some
// 0.5 ms later, so a dependent that reads dst before its griddepcontrol.wait,
// or through a load the compiler moved above it, sees the old contents.
#pragma once

#include <cuda_runtime.h>

#include <cstddef>

namespace specula::test {

// dst[0 .. bytes) = src[0 .. bytes) on `stream`, late (see above); bytes a
// multiple of 4, both device pointers 4-byte aligned. One block, so the
// dependent's blocks find room on the GPU while it waits.
void late_copy(const void* src, void* dst, size_t bytes, cudaStream_t stream);

}  // namespace specula::test
