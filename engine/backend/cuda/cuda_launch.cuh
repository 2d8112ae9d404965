// SPDX-License-Identifier: Apache-2.0
// Programmatic dependent launch (PDL) and streaming loads, shared by the
// product kernels (cuda_linear.cu, cuda_linear_mma.cu). Included only by .cu
// files.
//
// A kernel launched by launch_pdl() may start while the kernel before it on
// the stream is still running. Before pdl_wait() it may touch only weights
// (loads, L2 prefetches: weights are never written by the kernels that let
// dependents start early), and only after it may it read activations or write
// anything. Each such kernel also calls pdl_launch_dependents() at its top so
// that the kernel after it can start its own weight prologue; a kernel launched
// without the attribute waits for completion as usual. Off (kUsePdl = false):
// plain stream order. The numerics are the same either way.
//
// Activations (anything a kernel writes) are read with load_act(), never
// through the read-only path: __ldg, ld.global.nc, or a plain load from a
// const __restrict__ pointer, which the compiler turns into one. ptxas treats
// read-only loads as free to move, and moved the decode products' x loads above
// griddepcontrol.wait (the fused q/k/v and gate/up products then read a stale
// x when their predecessor wrote it late: tests/cuda/pdl_order_test.cpp); and
// .nc promises nothing for data that another grid writes while this one runs,
// which PDL makes true of the predecessor's output. tools/gpu/pdl_audit.sh
// lists the read-only loads left in these kernels (weights, and the positions
// the host uploads before a step).
#pragma once

#include <cuda_runtime.h>

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <mutex>
#include <vector>

#include "engine/backend/cuda/cuda_backend.h"

namespace specula::cuda {

inline constexpr bool kUsePdl = true;

__device__ __forceinline__ void pdl_launch_dependents() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  if constexpr (kUsePdl) asm volatile("griddepcontrol.launch_dependents;");
#endif
}

// Waits for the kernel this one depends on (a no-op without the attribute).
__device__ __forceinline__ void pdl_wait() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  if constexpr (kUsePdl) asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}

// A load of an activation in a programmatic dependent: coherent, cached in L1
// like a plain load, and ordered after pdl_wait(). T: any type __ldca takes
// (float, float4, uint4, int32_t, ...).
template <typename T>
__device__ __forceinline__ T load_act(const T* p) {
  return __ldca(p);
}

__device__ __forceinline__ void prefetch_l2(const void* p) {
  asm volatile("prefetch.global.L2 [%0];" ::"l"(p));
}

// One 16-byte streaming load: weights are read once, so they are kept out of
// L1 (which then holds the activations every warp re-reads).
__device__ __forceinline__ uint4 load_stream16(const void* p) {
  uint4 r;
  asm("ld.global.nc.L1::no_allocate.L2::256B.v4.u32 {%0, %1, %2, %3}, [%4];"
      : "=r"(r.x), "=r"(r.y), "=r"(r.z), "=r"(r.w)
      : "l"(p));
  return r;
}

// A 16-byte asynchronous copy global -> shared that bypasses L1, with a hint
// to fetch 256 bytes into L2 (the weight rows are streamed).
__device__ __forceinline__ void cp_async16(void* smem, const void* gmem) {
  const auto dst = static_cast<unsigned>(__cvta_generic_to_shared(smem));
  asm volatile("cp.async.cg.shared.global.L2::256B [%0], [%1], 16;" ::"r"(dst), "l"(gmem)
               : "memory");
}
__device__ __forceinline__ void cp_async_commit() {
  asm volatile("cp.async.commit_group;" ::: "memory");
}
// Waits until at most N of this thread's newest copy groups are pending.
template <int N>
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;" ::"n"(N) : "memory");
}

// Raises a kernel's dynamic shared memory limit to at least `bytes` (never
// lowers it: a kernel may be launched with several sizes).
inline void allow_dynamic_smem(const void* kernel, size_t bytes, const char* name) {
  struct Raised {
    const void* kernel;
    int device;
    size_t bytes;
  };
  static std::mutex mutex;
  static std::vector<Raised> raised;
  int device = 0;
  check_cuda(cudaGetDevice(&device), "cudaGetDevice");
  std::lock_guard<std::mutex> lock(mutex);
  Raised* entry = nullptr;
  for (Raised& r : raised) {
    if (r.kernel == kernel && r.device == device) entry = &r;
  }
  if (entry == nullptr) {  // first sight: start from the limit already set
    cudaFuncAttributes attributes{};
    check_cuda(cudaFuncGetAttributes(&attributes, kernel), name);
    raised.push_back({kernel, device, static_cast<size_t>(attributes.maxDynamicSharedSizeBytes)});
    entry = &raised.back();
  }
  if (entry->bytes >= bytes) return;
  check_cuda(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                  static_cast<int>(bytes)),
             name);
  entry->bytes = bytes;
}

// Streaming multiprocessors of the current device (cached per device).
inline int sm_count() {
  static std::atomic<int> counts[64];
  int device = 0;
  check_cuda(cudaGetDevice(&device), "cudaGetDevice");
  std::atomic<int>& slot = counts[device >= 0 && device < 64 ? device : 0];
  int n = slot.load(std::memory_order_relaxed);
  if (n == 0) {
    check_cuda(cudaDeviceGetAttribute(&n, cudaDevAttrMultiProcessorCount, device),
               "cudaDeviceGetAttribute(multiProcessorCount)");
    slot.store(n, std::memory_order_relaxed);
  }
  return n;
}

// Launches `kernel` on `grid` x `block` with `smem` dynamic shared memory on
// `stream`; `programmatic`: as a programmatic dependent of the previous kernel.
template <typename... Params, typename... Args>
void launch_kernel(void (*kernel)(Params...), dim3 grid, dim3 block, size_t smem,
                   cudaStream_t stream, const char* name, bool programmatic, Args... args) {
  // Static shared memory counts against the default 48 KB as well, so any
  // dynamic request goes through the (cached) limit check.
  if (smem > 0) allow_dynamic_smem(reinterpret_cast<const void*>(kernel), smem, name);
  cudaLaunchConfig_t cfg{};
  cfg.gridDim = grid;
  cfg.blockDim = block;
  cfg.dynamicSmemBytes = smem;
  cfg.stream = stream;
  cudaLaunchAttribute attr{};
  attr.id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attr.val.programmaticStreamSerializationAllowed = 1;
  cfg.attrs = &attr;
  cfg.numAttrs = programmatic ? 1 : 0;
  check_cuda(cudaLaunchKernelEx(&cfg, kernel, static_cast<Params>(args)...), name);
  check_cuda(cudaGetLastError(), name);
}

// launch_kernel as a programmatic dependent when kUsePdl.
template <typename... Params, typename... Args>
void launch_pdl(void (*kernel)(Params...), dim3 grid, dim3 block, size_t smem, cudaStream_t stream,
                const char* name, Args... args) {
  launch_kernel(kernel, grid, block, smem, stream, name, kUsePdl, args...);
}

// The same for a one-dimensional grid of `blocks` blocks of `threads`.
template <typename... Params, typename... Args>
void launch_pdl(void (*kernel)(Params...), int64_t blocks, int threads, size_t smem,
                cudaStream_t stream, const char* name, Args... args) {
  launch_pdl(kernel, dim3(static_cast<unsigned>(blocks)), dim3(static_cast<unsigned>(threads)),
             smem, stream, name, args...);
}

}  // namespace specula::cuda
