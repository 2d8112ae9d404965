// SPDX-License-Identifier: Apache-2.0
// linear()'s cuBLASLt path: products too large for the batch-invariant kernels
// (bf16 weights with M > kInvariantRows in linear(), any weights with
// M > kPrefillGemmRows in linear_prefill(); see the top of cuda_linear.cu for
// the numerics), and convert_to_bf16 (cuda_backend.h). Plans are cached per
// shape and alignment.
#include "engine/backend/cuda/cuda_linear_lt.h"

#include <cublasLt.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <tuple>

#include "engine/backend/cuda/cuda_backend.h"
#include "engine/backend/cuda/cuda_device_common.cuh"

namespace specula::cuda {
namespace {

constexpr size_t kLtWorkspaceBytes = size_t{32} << 20;
// Cached plans (one per shape and alignment); the cache is emptied when it
// holds more than this many (prefill lengths vary from prompt to prompt).
constexpr size_t kMaxLtPlans = 256;

// Threads per block and the most blocks of the grid-stride element kernels.
constexpr int kElemThreads = 256;
constexpr int64_t kMaxElemBlocks = 8192;

// ---------------------------------------------------------------------------
// cuBLASLt path.

// dst[i] = bf16(src[i]) (round to nearest even), grid-stride.
template <typename T>
__global__ void to_bf16_kernel(const T* __restrict__ src, __nv_bfloat16* __restrict__ dst,
                               int64_t n) {
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n;
       i += stride) {
    dst[i] = __float2bfloat16_rn(to_f32(src[i]));
  }
}

}  // namespace

void convert_to_bf16(const void* src, DType dtype, void* dst, int64_t n, cudaStream_t stream) {
  const unsigned blocks =
      static_cast<unsigned>(std::min<int64_t>(blocks_for(n, kElemThreads), kMaxElemBlocks));
  auto* out = static_cast<__nv_bfloat16*>(dst);
  if (dtype == DType::kF16) {
    to_bf16_kernel<<<blocks, kElemThreads, 0, stream>>>(static_cast<const __half*>(src), out, n);
  } else {
    to_bf16_kernel<<<blocks, kElemThreads, 0, stream>>>(static_cast<const float*>(src), out, n);
  }
  check_cuda(cudaGetLastError(), "to_bf16_kernel");
}

namespace {

// Largest power of two (at most 256) dividing the address: what cuBLASLt may assume.
uint32_t alignment_of(const void* p) {
  const auto a = reinterpret_cast<uintptr_t>(p);
  if (a == 0) return 256;
  return static_cast<uint32_t>(std::min<uintptr_t>(a & (~a + 1), 256));
}

struct MatmulDescDeleter {
  void operator()(cublasLtMatmulDescOpaque_t* d) const { cublasLtMatmulDescDestroy(d); }
};
struct LayoutDeleter {
  void operator()(cublasLtMatrixLayoutOpaque_t* l) const { cublasLtMatrixLayoutDestroy(l); }
};
struct PreferenceDeleter {
  void operator()(cublasLtMatmulPreferenceOpaque_t* p) const { cublasLtMatmulPreferenceDestroy(p); }
};
using MatmulDescPtr = std::unique_ptr<cublasLtMatmulDescOpaque_t, MatmulDescDeleter>;
using LayoutPtr = std::unique_ptr<cublasLtMatrixLayoutOpaque_t, LayoutDeleter>;
using PreferencePtr = std::unique_ptr<cublasLtMatmulPreferenceOpaque_t, PreferenceDeleter>;

LayoutPtr make_layout(cudaDataType_t type, int64_t rows, int64_t cols, int64_t ld) {
  cublasLtMatrixLayout_t l = nullptr;
  check_cublas(cublasLtMatrixLayoutCreate(&l, type, static_cast<uint64_t>(rows),
                                          static_cast<uint64_t>(cols), ld),
               "cublasLtMatrixLayoutCreate");
  return LayoutPtr(l);
}

// Sets one attribute of a matmul preference to `value` (its bytes, as the
// attribute's type: uint64_t for the workspace, uint32_t for alignments);
// `what` names the call in the error.
template <typename T>
void set_preference(cublasLtMatmulPreference_t p, cublasLtMatmulPreferenceAttributes_t attr,
                    const T& value, const char* what) {
  check_cublas(cublasLtMatmulPreferenceSetAttribute(p, attr, &value, sizeof(value)), what);
}

// (device, M, N, K, alignment of w's bf16 data, alignment of y).
using LtKey = std::tuple<int, int64_t, int64_t, int64_t, uint32_t, uint32_t>;

// Descriptors, layouts and the chosen algorithm for one shape. Row-major
// y[M, N] = x[M, K] · w[N, K]ᵀ is column-major C[N, M] = op(A) · B with
// A = w viewed column-major as [K, N] (ld K), op = transpose; B = x viewed
// column-major as [K, M] (ld K); C = D = y viewed column-major as [N, M] (ld N).
struct LtPlan {
  MatmulDescPtr desc;
  LayoutPtr a, b, c;
  cublasLtMatmulAlgo_t algo{};
  bool usable = false;  // false: cuBLASLt offers no algorithm for this shape

  LtPlan(cublasLtHandle_t lt, const LtKey& key) {
    const auto [device, m, n, k, align_a, align_c] = key;
    (void)device;
    cublasLtMatmulDesc_t d = nullptr;
    check_cublas(cublasLtMatmulDescCreate(&d, CUBLAS_COMPUTE_32F, CUDA_R_32F),
                 "cublasLtMatmulDescCreate");
    desc.reset(d);
    const cublasOperation_t trans_a = CUBLAS_OP_T;
    const cublasOperation_t trans_b = CUBLAS_OP_N;
    check_cublas(
        cublasLtMatmulDescSetAttribute(d, CUBLASLT_MATMUL_DESC_TRANSA, &trans_a, sizeof(trans_a)),
        "cublasLtMatmulDescSetAttribute(TRANSA)");
    check_cublas(
        cublasLtMatmulDescSetAttribute(d, CUBLASLT_MATMUL_DESC_TRANSB, &trans_b, sizeof(trans_b)),
        "cublasLtMatmulDescSetAttribute(TRANSB)");
    a = make_layout(CUDA_R_16BF, k, n, k);
    b = make_layout(CUDA_R_16BF, k, m, k);
    c = make_layout(CUDA_R_32F, n, m, n);

    cublasLtMatmulPreference_t p = nullptr;
    check_cublas(cublasLtMatmulPreferenceCreate(&p), "cublasLtMatmulPreferenceCreate");
    PreferencePtr pref(p);
    const uint64_t workspace = kLtWorkspaceBytes;
    const uint32_t align_b = 256;  // x's bf16 copy lives in cudaMalloc'd scratch
    set_preference(p, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, workspace,
                   "cublasLtMatmulPreferenceSetAttribute(MAX_WORKSPACE_BYTES)");
    set_preference(p, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES, align_a,
                   "cublasLtMatmulPreferenceSetAttribute(MIN_ALIGNMENT_A_BYTES)");
    set_preference(p, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES, align_b,
                   "cublasLtMatmulPreferenceSetAttribute(MIN_ALIGNMENT_B_BYTES)");
    set_preference(p, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES, align_c,
                   "cublasLtMatmulPreferenceSetAttribute(MIN_ALIGNMENT_C_BYTES)");
    set_preference(p, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES, align_c,
                   "cublasLtMatmulPreferenceSetAttribute(MIN_ALIGNMENT_D_BYTES)");

    cublasLtMatmulHeuristicResult_t result{};
    int count = 0;
    const cublasStatus_t st = cublasLtMatmulAlgoGetHeuristic(lt, d, a.get(), b.get(), c.get(),
                                                             c.get(), p, 1, &result, &count);
    // NOT_SUPPORTED means no algorithm fits (e.g. leading dimensions with odd
    // alignment); the caller then falls back to the invariant kernel.
    if (st == CUBLAS_STATUS_NOT_SUPPORTED) return;
    check_cublas(st, "cublasLtMatmulAlgoGetHeuristic");
    if (count < 1 || result.state != CUBLAS_STATUS_SUCCESS) return;
    algo = result.algo;
    usable = true;
  }
};

// Process-wide plan cache. Plans are shared_ptr so that emptying the cache
// never frees a plan another thread is using.
std::shared_ptr<const LtPlan> lt_plan(cublasLtHandle_t lt, const LtKey& key) {
  static std::mutex mutex;
  static std::map<LtKey, std::shared_ptr<const LtPlan>> plans;
  std::lock_guard<std::mutex> lock(mutex);
  auto it = plans.find(key);
  if (it != plans.end()) return it->second;
  if (plans.size() >= kMaxLtPlans) plans.clear();
  auto plan = std::make_shared<const LtPlan>(lt, key);
  plans.emplace(key, plan);
  return plan;
}

}  // namespace

// See cuda_linear_lt.h.
bool linear_lt(CudaBackend& be, const Tensor& x, const Tensor& w, const Tensor& y) {
  const int64_t m = x.dim(0);
  const int64_t k = x.dim(1);
  const int64_t n = w.dim(0);
  // Weights not already bf16 are converted into cudaMalloc'd (256-byte aligned) scratch.
  const uint32_t align_w = w.dtype() == DType::kBF16 ? alignment_of(w.data()) : 256;
  const LtKey key{be.device_index(), m, n, k, align_w, alignment_of(y.data())};
  const std::shared_ptr<const LtPlan> plan = lt_plan(be.lt_handle(), key);
  if (!plan->usable) return false;

  cudaStream_t stream = be.stream();
  // All scratch first: growing one synchronises the stream and frees the old buffer.
  void* workspace = be.scratch(be.lt_workspace_, kLtWorkspaceBytes);
  void* x_bf16 = be.scratch(be.x_bf16_, static_cast<size_t>(m * k) * 2);
  const void* w_bf16 = w.data();
  if (w.dtype() != DType::kBF16) {
    void* converted = be.scratch(be.w_bf16_, static_cast<size_t>(n * k) * 2);
    convert_to_bf16(w.data(), w.dtype(), converted, n * k, stream);
    w_bf16 = converted;
  }
  convert_to_bf16(x.data(), DType::kF32, x_bf16, m * k, stream);

  const float alpha = 1.0f;
  const float beta = 0.0f;  // C is not read
  check_cublas(cublasLtMatmul(be.lt_handle(), plan->desc.get(), &alpha, w_bf16, plan->a.get(),
                              x_bf16, plan->b.get(), &beta, y.data(), plan->c.get(), y.data(),
                              plan->c.get(), &plan->algo, workspace, kLtWorkspaceBytes, stream),
               "cublasLtMatmul (linear)");
  return true;
}

}  // namespace specula::cuda
