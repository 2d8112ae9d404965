// SPDX-License-Identifier: Apache-2.0
// Prefill attention on tensor cores: per head, scores = scale · q·kᵀ (cuBLASLt,
// f32 in and out, TF32 products), a masked softmax over each score row, then
// out = p·v (cuBLASLt, TF32). Queries are tiled so the [heads, tile, T] score
// block fits the scratch budget. Deterministic for a given shape, not batch
// invariant: used only for prefill chunks (AttentionParams::allow_fast_prefill).
//
// Layouts (row-major engine tensors seen as column-major cuBLAS matrices):
//   q [S, H, D]   head h: D×S, ld H·D, offset h·D
//   k [T, Hkv, D] kv head j: D×T, ld Hkv·D, offset j·D
//   scores [H, tile, T] head h: T×tile, ld T, offset h·tile·T
//   out [S, H, D] head h: D×S, ld H·D
// Heads h = j·group + g: one strided-batched product per g, batched over j.
//
// A bf16 cache is first widened (exactly) into f32 copies of k and v of the
// same layout, 256-byte aligned like any allocation, and the products read
// those: the same products on the same values as for an f32 cache holding the
// rounded keys (TF32 keeps all 8 bits of a bf16 mantissa, so its rounding of
// the products' inputs leaves them unchanged), hence the same results bit for
// bit. The copies need 8 bytes a key element (k and v), at most
// kPrefillWidenBudget (CudaBackend::attention takes the partials path past it).
// An fp8 cache is dequantized into the same f32 copies (e4m3 value · scale, as
// the CPU reads it); unlike bf16's, those values may carry more than TF32's 10
// mantissa bits, so the products round them: deterministic, within the TF32
// tolerance of the CPU, like every product here.
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>

#include "engine/backend/cuda/cuda_backend.h"
#include "engine/backend/cuda/cuda_device_common.cuh"
#include "engine/backend/cuda/cuda_launch.cuh"

namespace specula::cuda {
namespace {

// Score bytes kept at once ([heads, query tile, T] f32).
constexpr size_t kScoreBudget = size_t{2} << 30;

struct LtHandles {
  cublasLtMatmulDesc_t desc = nullptr;
  cublasLtMatrixLayout_t a = nullptr, b = nullptr, c = nullptr;
  cublasLtMatmulPreference_t pref = nullptr;
  ~LtHandles() {
    if (pref) cublasLtMatmulPreferenceDestroy(pref);
    if (c) cublasLtMatrixLayoutDestroy(c);
    if (b) cublasLtMatrixLayoutDestroy(b);
    if (a) cublasLtMatrixLayoutDestroy(a);
    if (desc) cublasLtMatmulDescDestroy(desc);
  }
};

cublasLtMatrixLayout_t strided_layout(uint64_t rows, uint64_t cols, int64_t ld, int batch,
                                      int64_t batch_stride) {
  cublasLtMatrixLayout_t l = nullptr;
  check_cublas(cublasLtMatrixLayoutCreate(&l, CUDA_R_32F, rows, cols, ld),
               "cublasLtMatrixLayoutCreate");
  check_cublas(cublasLtMatrixLayoutSetAttribute(l, CUBLASLT_MATRIX_LAYOUT_BATCH_COUNT, &batch,
                                                sizeof(batch)),
               "cublasLtMatrixLayoutSetAttribute(BATCH_COUNT)");
  check_cublas(cublasLtMatrixLayoutSetAttribute(l, CUBLASLT_MATRIX_LAYOUT_STRIDED_BATCH_OFFSET,
                                                &batch_stride, sizeof(batch_stride)),
               "cublasLtMatrixLayoutSetAttribute(STRIDED_BATCH_OFFSET)");
  return l;
}

// C (m×n, ldc) = alpha · op(A) · op(B), batched `batch` times with the given
// strides; f32 data, TF32 tensor-core compute.
void batched_matmul(CudaBackend& be, bool trans_a, bool trans_b, int64_t m, int64_t n, int64_t k,
                    float alpha, const float* a, int64_t lda, int64_t stride_a, const float* b,
                    int64_t ldb, int64_t stride_b, float* c, int64_t ldc, int64_t stride_c,
                    int batch) {
  LtHandles h;
  check_cublas(cublasLtMatmulDescCreate(&h.desc, CUBLAS_COMPUTE_32F_FAST_TF32, CUDA_R_32F),
               "cublasLtMatmulDescCreate");
  const cublasOperation_t ta = trans_a ? CUBLAS_OP_T : CUBLAS_OP_N;
  const cublasOperation_t tb = trans_b ? CUBLAS_OP_T : CUBLAS_OP_N;
  check_cublas(cublasLtMatmulDescSetAttribute(h.desc, CUBLASLT_MATMUL_DESC_TRANSA, &ta, sizeof(ta)),
               "cublasLtMatmulDescSetAttribute(TRANSA)");
  check_cublas(cublasLtMatmulDescSetAttribute(h.desc, CUBLASLT_MATMUL_DESC_TRANSB, &tb, sizeof(tb)),
               "cublasLtMatmulDescSetAttribute(TRANSB)");
  // Stored shapes: A is (trans_a ? k×m : m×k), B is (trans_b ? n×k : k×n).
  h.a = strided_layout(static_cast<uint64_t>(trans_a ? k : m),
                       static_cast<uint64_t>(trans_a ? m : k), lda, batch, stride_a);
  h.b = strided_layout(static_cast<uint64_t>(trans_b ? n : k),
                       static_cast<uint64_t>(trans_b ? k : n), ldb, batch, stride_b);
  h.c = strided_layout(static_cast<uint64_t>(m), static_cast<uint64_t>(n), ldc, batch, stride_c);
  const size_t workspace = size_t{32} << 20;
  void* ws = be.scratch(be.lt_workspace_, workspace);
  check_cublas(cublasLtMatmulPreferenceCreate(&h.pref), "cublasLtMatmulPreferenceCreate");
  check_cublas(cublasLtMatmulPreferenceSetAttribute(
                   h.pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &workspace, sizeof(workspace)),
               "cublasLtMatmulPreferenceSetAttribute(MAX_WORKSPACE_BYTES)");
  cublasLtMatmulHeuristicResult_t result{};
  int found = 0;
  check_cublas(cublasLtMatmulAlgoGetHeuristic(be.lt_handle(), h.desc, h.a, h.b, h.c, h.c, h.pref, 1,
                                              &result, &found),
               "cublasLtMatmulAlgoGetHeuristic (prefill attention)");
  if (found == 0)
    fail("cublasLt: no algorithm for the prefill attention product {}x{}x{}", m, n, k);
  const float beta = 0.0f;
  check_cublas(cublasLtMatmul(be.lt_handle(), h.desc, &alpha, a, h.a, b, h.b, &beta, c, h.c, c, h.c,
                              &result.algo, ws, workspace, be.stream()),
               "cublasLtMatmul (prefill attention)");
}

// One block per score row (head h, query i of the tile): keys j visible iff
// (!causal || kp <= qp) && (window == 0 || kp > qp - window), kp = k_pos0 + j.
// Writes the softmax probabilities in place (0 where masked; a row that sees
// nothing becomes all zeros, so its output row is zero).
__global__ void masked_softmax_kernel(float* __restrict__ scores, const int32_t* __restrict__ q_pos,
                                      int64_t tile, int64_t t_len, int64_t k_pos0, int causal,
                                      int window) {
  const int64_t row = blockIdx.x;  // h · tile + i
  const int64_t i = row % tile;
  float* s = scores + row * t_len;
  const int64_t qp = q_pos[i];
  int64_t lo = 0, hi = t_len - 1;
  if (causal) hi = min(hi, qp - k_pos0);
  if (window > 0) lo = max(lo, qp - window + 1 - k_pos0);
  __shared__ float red[32];
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = blockDim.x >> 5;
  float m = -INFINITY;
  for (int64_t j = lo + threadIdx.x; j <= hi; j += blockDim.x) m = fmaxf(m, s[j]);
  for (int off = 16; off > 0; off >>= 1) m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, off));
  if (lane == 0) red[warp] = m;
  __syncthreads();
  m = -INFINITY;
  for (int w = 0; w < warps; ++w) m = fmaxf(m, red[w]);
  __syncthreads();
  float sum = 0.0f;
  for (int64_t j = lo + threadIdx.x; j <= hi; j += blockDim.x) {
    const float e = expf(s[j] - m);
    s[j] = e;
    sum += e;
  }
  for (int off = 16; off > 0; off >>= 1) sum += __shfl_xor_sync(0xffffffffu, sum, off);
  if (lane == 0) red[warp] = sum;
  __syncthreads();
  sum = 0.0f;
  for (int w = 0; w < warps; ++w) sum += red[w];
  const float inv = lo <= hi ? 1.0f / sum : 0.0f;
  for (int64_t j = threadIdx.x; j < t_len; j += blockDim.x) {
    s[j] = (j >= lo && j <= hi) ? s[j] * inv : 0.0f;
  }
}

// kf / vf f32 [n] = k / v bf16 [n] widened exactly (grid-stride, one element
// a thread at a time; the cache was written by earlier kernels: load_act).
__global__ void widen_kv_kernel(const uint16_t* k, const uint16_t* v, float* __restrict__ kf,
                                float* __restrict__ vf, int64_t n) {
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    kf[i] = bf16_bits_to_f32(load_act(reinterpret_cast<const unsigned short*>(k) + i));
    vf[i] = bf16_bits_to_f32(load_act(reinterpret_cast<const unsigned short*>(v) + i));
  }
}

// kf / vf f32 [n] = k / v fp8 [n] dequantized as the CPU does (e4m3 value ·
// the scale of its row of d values, one f32 product).
__global__ void widen_kv_fp8_kernel(const uint8_t* k, const uint8_t* v, const float* k_scales,
                                    const float* v_scales, float* __restrict__ kf,
                                    float* __restrict__ vf, int64_t n, int64_t d) {
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    kf[i] = e4m3_dequant(load_act(k + i), load_act(k_scales + i / d));
    vf[i] = e4m3_dequant(load_act(v + i), load_act(v_scales + i / d));
  }
}

}  // namespace

size_t prefill_widen_bytes(const AttentionParams& p) {
  if (p.k.dtype() != DType::kBF16 && p.k.dtype() != DType::kF8E4M3) return 0;
  return 2 * ((static_cast<size_t>(p.k.numel()) * sizeof(float) + 255) / 256 * 256);
}

void attention_prefill_gemm(CudaBackend& be, const AttentionParams& p) {
  const int64_t s_len = p.q.dim(0), n_heads = p.q.dim(1), d = p.q.dim(2);
  const int64_t t_len = p.k.dim(0), n_kv = p.k.dim(1);
  const int64_t group = n_heads / n_kv;
  const size_t per_query =
      static_cast<size_t>(n_heads) * static_cast<size_t>(t_len) * sizeof(float);
  const int64_t tile = std::max<int64_t>(
      1, std::min<int64_t>(s_len, static_cast<int64_t>(kScoreBudget / per_query)));
  auto* scores =
      static_cast<float*>(be.scratch(be.attn_scores_, per_query * static_cast<size_t>(tile)));
  const auto* q = p.q.data_as<const float>();
  const float* k = nullptr;
  const float* v = nullptr;
  if (p.k.dtype() == DType::kBF16 || p.k.dtype() == DType::kF8E4M3) {
    const int64_t n = p.k.numel();
    const size_t bytes = prefill_widen_bytes(p);
    const size_t half = bytes / 2;  // v's copy starts 256-byte aligned, like k's
    auto* kf = static_cast<float*>(be.scratch(be.attn_kv_f32_, bytes));
    auto* vf = reinterpret_cast<float*>(reinterpret_cast<char*>(kf) + half);
    constexpr int kThreads = 256;
    const int64_t blocks = std::min<int64_t>((n + kThreads - 1) / kThreads, int64_t{1} << 16);
    if (n > 0 && p.k.dtype() == DType::kF8E4M3) {
      widen_kv_fp8_kernel<<<static_cast<unsigned>(blocks), kThreads, 0, be.stream()>>>(
          p.k.data_as<const uint8_t>(), p.v.data_as<const uint8_t>(), p.k.scale_data(),
          p.v.scale_data(), kf, vf, n, d);
      check_cuda(cudaGetLastError(), "widen_kv_fp8_kernel");
    } else if (n > 0) {
      widen_kv_kernel<<<static_cast<unsigned>(blocks), kThreads, 0, be.stream()>>>(
          p.k.data_as<const uint16_t>(), p.v.data_as<const uint16_t>(), kf, vf, n);
      check_cuda(cudaGetLastError(), "widen_kv_kernel");
    }
    k = kf;
    v = vf;
  } else {
    k = p.k.data_as<const float>();
    v = p.v.data_as<const float>();
  }
  const auto* pos = p.q_positions.data_as<const int32_t>();
  auto* out = p.out.data_as<float>();
  const int64_t ld_q = n_heads * d, ld_k = n_kv * d;
  for (int64_t s0 = 0; s0 < s_len; s0 += tile) {
    const int64_t rows = std::min(tile, s_len - s0);
    for (int64_t g = 0; g < group; ++g) {
      // scores_h (T×rows, ld T) = kᵀ (T×D) · q_h (D×rows), batched over kv heads j (h = j·group +
      // g).
      batched_matmul(be, /*trans_a=*/true, /*trans_b=*/false, t_len, rows, d, p.scale, k, ld_k, d,
                     q + s0 * ld_q + g * d, ld_q, group * d, scores + g * rows * t_len, t_len,
                     group * rows * t_len, static_cast<int>(n_kv));
    }
    masked_softmax_kernel<<<static_cast<unsigned>(n_heads * rows), 256, 0, be.stream()>>>(
        scores, pos + s0, rows, t_len, p.k_pos0, p.causal ? 1 : 0, p.window);
    check_cuda(cudaGetLastError(), "masked_softmax_kernel");
    for (int64_t g = 0; g < group; ++g) {
      // out_h (D×rows, ld H·D) = v_j (D×T) · p_h (T×rows).
      batched_matmul(be, false, false, d, rows, t_len, 1.0f, v, ld_k, d, scores + g * rows * t_len,
                     t_len, group * rows * t_len, out + s0 * ld_q + g * d, ld_q, group * d,
                     static_cast<int>(n_kv));
    }
  }
}

}  // namespace specula::cuda
