// SPDX-License-Identifier: Apache-2.0
// CudaBackend::embedding, out[n, :] = f32(table[ids[n], :]) · scale, for
// f32|bf16|f16 tables (quantized tables: quant_embedding, cuda_linear_quant.cu).
//
// The contract says an id outside [0, V) throws; a kernel cannot throw and
// checking on the host would need a device->host read-back (a stream
// synchronisation) on every call, so the CUDA embedding writes a zero row for
// an out-of-range id instead. The model validates token ids on the host before
// every forward, so valid requests never reach that case.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>

#include "engine/backend/cuda/cuda_backend.h"
#include "engine/backend/cuda/cuda_device_common.cuh"
#include "engine/backend/cuda/cuda_linear_quant.h"

namespace specula::cuda {
namespace {

// Threads per block of the grid-stride embedding kernel.
constexpr int kElemThreads = 256;

// out[row, :] = f32(table[ids[row], :]) · scale, or zeros for an id outside
// [0, vocab). Grid: x covers H (grid-stride), y covers rows (grid-stride).
template <typename T>
__global__ void embedding_kernel(const T* __restrict__ table, const int32_t* __restrict__ ids,
                                 float scale, float* __restrict__ out, int64_t n, int64_t h,
                                 int64_t vocab) {
  for (int64_t row = blockIdx.y; row < n; row += gridDim.y) {
    const int64_t id = ids[row];
    const bool valid = id >= 0 && id < vocab;
    const T* src = table + (valid ? id : 0) * h;
    float* dst = out + row * h;
    for (int64_t j = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; j < h;
         j += static_cast<int64_t>(gridDim.x) * blockDim.x) {
      dst[j] = valid ? to_f32(src[j]) * scale : 0.0f;
    }
  }
}

template <typename T>
void launch_embedding(const Tensor& table, const Tensor& ids, float scale, const Tensor& out,
                      cudaStream_t stream) {
  const int64_t n = ids.dim(0);
  const int64_t h = table.dim(1);
  const dim3 grid(static_cast<unsigned>(std::min<int64_t>(blocks_for(h, kElemThreads), 64)),
                  static_cast<unsigned>(std::min<int64_t>(n, 65535)));
  // A plain launch, never a programmatic dependent: it waits for everything
  // queued before it, which is the ordering promise attention_with_inputs
  // relies on to read old cache rows before its inputs are ready.
  embedding_kernel<T><<<grid, kElemThreads, 0, stream>>>(table.data_as<const T>(),
                                                         ids.data_as<const int32_t>(), scale,
                                                         out.data_as<float>(), n, h, table.dim(0));
  check_cuda(cudaGetLastError(), "embedding_kernel");
}

}  // namespace

// out[n, :] = f32(table[ids[n], :]) · scale; table f32|bf16|f16 [V, H], ids i32
// [N], out f32 [N, H], all on this device; out must not overlap table or ids.
// An id outside [0, V) gives a zero row (the CPU backend throws; see the top of the file).
void CudaBackend::embedding(const Tensor& table, const Tensor& ids, float scale,
                            const Tensor& out) {
  OpTimer timer(*this, "embedding");
  constexpr const char* kOp = "embedding";
  check_on(*this, kOp, "table", table);
  check_on(*this, kOp, "ids", ids);
  check_on(*this, kOp, "out", out);
  check_weight(kOp, "table", table);
  check_rank(kOp, "table", table, 2);
  check_dtype(kOp, "ids", ids, DType::kI32);
  check_rank(kOp, "ids", ids, 1);
  check_dtype(kOp, "out", out, DType::kF32);
  const int64_t n = ids.dim(0);
  const int64_t h = table.dim(1);
  if (out.shape() != Shape({n, h})) {
    fail("embedding: out {} must be f32[{}, {}] for ids {} and table {}", out.describe(), n, h,
         ids.describe(), table.describe());
  }
  check_no_alias(kOp, "out", out, "table", table);
  check_no_alias(kOp, "out", out, "ids", ids);
  if (n == 0 || h == 0) return;
  if (is_quantized(table.dtype())) {
    quant_embedding(table.data(), table.dtype(), table.scale_data(), ids.data_as<const int32_t>(),
                    scale, out.data_as<float>(), n, h, table.dim(0), stream_);
    return;
  }
  switch (table.dtype()) {
    case DType::kF32:
      launch_embedding<float>(table, ids, scale, out, stream_);
      break;
    case DType::kBF16:
      launch_embedding<__nv_bfloat16>(table, ids, scale, out, stream_);
      break;
    default:
      launch_embedding<__half>(table, ids, scale, out, stream_);
      break;
  }
}

}  // namespace specula::cuda
