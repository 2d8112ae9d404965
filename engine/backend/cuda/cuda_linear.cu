// SPDX-License-Identifier: Apache-2.0
// Products on the GPU: linear() and embedding().
//
// linear, y[M, N] = x[M, K] · w[N, K]ᵀ (x, y f32; w f32|bf16|f16), has two paths:
//
// - M <= kInvariantRows: invariant_linear_kernel, batch-invariant. y[m, n] is
//   bit-identical whatever M is and whichever other rows share the call, which
//   is what makes speculation exact (decode computes 1 row, verify k + 1,
//   batched rows many more). The reduction order for one (m, n) is fixed by the
//   kernel alone: K is cut into chunks of 8 elements; lane l of the warp that
//   owns column n accumulates chunks l, l + 32, l + 64, ... in increasing order,
//   each as 8 explicit fmaf in element order into one f32 partial sum (a final
//   partial chunk, when 8 does not divide K, belongs to the lane whose turn it
//   is, with one fmaf per element); the 32 partial sums are then added by a
//   fixed xor-shuffle tree. Rows are processed in groups of up to kMaxGroup so
//   the weights are streamed once per group, and every row of a group runs the
//   same fmaf sequence whatever the group size, its position in the group, the
//   unrolling, or whether loads are vectorised (misaligned operands take scalar
//   loads but the same arithmetic). No atomics, no split of K across warps.
//   At M = 1 with bf16 weights this is the decode GEMV: 16-byte streaming loads
//   (8 bf16, not allocated in L1), four columns per warp, several chunks in
//   flight per lane. Activations are read through L1 rather than staged in
//   shared memory: staging would need a block barrier per K tile, and every
//   barrier drains the weight stream of the warps waiting at it; the warps of an
//   SM read the same x rows at nearly the same time, so L1 serves them.
//
// - M > kInvariantRows (prefill): cuBLASLt on bf16 copies of the activations
//   (and of the weights when they are not bf16), f32 accumulation
//   (CUBLAS_COMPUTE_32F), f32 output written straight into y. Deterministic for
//   a given shape (the algorithm is chosen once per shape and cached), but NOT
//   batch-invariant: the algorithm, and with it the reduction order, depends on
//   M. Rounding x to bf16 costs ~1e-3 relative accuracy. A shape cuBLASLt
//   offers no algorithm for (odd leading-dimension alignment) falls back to the
//   invariant kernel.
//
// embedding, out[n, :] = f32(table[ids[n], :]) · scale. The contract says an id
// outside [0, V) throws; a kernel cannot throw and checking on the host would
// need a device->host read-back (a stream synchronisation) on every call, so
// the CUDA embedding writes a zero row for an out-of-range id instead. The model
// validates token ids on the host before every forward, so valid requests
// never reach that case.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <climits>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <tuple>
#include <type_traits>

#include "engine/backend/cuda/cuda_backend.h"

namespace specula::cuda {
namespace {

// ---- batch-invariant kernel geometry ----
// Warps per block; each warp owns kCols output columns of one row group. Small
// blocks keep the grid fine-grained (N = 5376 gives 336 blocks) so the last
// wave is short; blocks share nothing, so their size is not part of the numerics.
constexpr int kWarps = 4;
constexpr int kThreads = kWarps * 32;
// Output columns per warp: every x element loaded is used kCols times.
constexpr int kCols = 4;
// Activation rows per pass over the weights.
constexpr int kMaxGroup = 8;
// Weight elements per lane step: 16 bytes of bf16/f16. Part of the numerics.
constexpr int kChunk = 8;
constexpr unsigned kFullMask = 0xffffffffu;
static_assert(kMaxGroup * kCols <= 32, "each (row, column) result is written by its own lane");

// ---- cuBLASLt ----
constexpr size_t kLtWorkspaceBytes = size_t{32} << 20;
// Cached plans (one per shape and alignment); the cache is emptied when it
// holds more than this many (prefill lengths vary from prompt to prompt).
constexpr size_t kMaxLtPlans = 256;

// Threads per block and the most blocks of the grid-stride element kernels.
constexpr int kElemThreads = 256;
constexpr int64_t kMaxElemBlocks = 8192;

// ---------------------------------------------------------------------------
// Element conversions.

template <typename T>
__device__ __forceinline__ float to_f32(T v) {
  if constexpr (std::is_same_v<T, float>) {
    return v;
  } else if constexpr (std::is_same_v<T, __nv_bfloat16>) {
    return __bfloat162float(v);
  } else {
    return __half2float(v);
  }
}

// Eight consecutive weight elements as raw bits: one 16-byte word for bf16 and
// f16, two for f32.
template <typename T>
struct Chunk {
  uint4 v[sizeof(T) / 2];
};

// One 16-byte streaming load: the weights are read once, so they are kept out
// of L1 (which then holds the activations every warp re-reads).
__device__ __forceinline__ uint4 load_stream16(const void* p) {
  uint4 r;
  asm("ld.global.nc.L1::no_allocate.L2::256B.v4.u32 {%0, %1, %2, %3}, [%4];"
      : "=r"(r.x), "=r"(r.y), "=r"(r.z), "=r"(r.w)
      : "l"(p));
  return r;
}

// The first `count` (<= 8) elements at p as a Chunk, one element per load
// (no alignment needed); missing elements are zero bits.
template <typename T>
__device__ __forceinline__ Chunk<T> load_chunk_scalar(const T* p, int count) {
  Chunk<T> c;
  if constexpr (sizeof(T) == 2) {
    const auto* q = reinterpret_cast<const unsigned short*>(p);
    uint32_t words[4] = {0, 0, 0, 0};
#pragma unroll
    for (int j = 0; j < kChunk; ++j) {
      if (j < count) words[j / 2] |= static_cast<uint32_t>(__ldg(q + j)) << (16 * (j % 2));
    }
    c.v[0] = make_uint4(words[0], words[1], words[2], words[3]);
  } else {
    const auto* q = reinterpret_cast<const unsigned int*>(p);
    uint32_t words[8];
#pragma unroll
    for (int j = 0; j < kChunk; ++j) words[j] = j < count ? __ldg(q + j) : 0u;
    c.v[0] = make_uint4(words[0], words[1], words[2], words[3]);
    c.v[1] = make_uint4(words[4], words[5], words[6], words[7]);
  }
  return c;
}

// Eight elements at p (16-byte aligned when kVec).
template <typename T, bool kVec>
__device__ __forceinline__ Chunk<T> load_chunk(const T* p) {
  if constexpr (kVec) {
    Chunk<T> c;
    const auto* q = reinterpret_cast<const uint4*>(p);
#pragma unroll
    for (int i = 0; i < static_cast<int>(sizeof(T) / 2); ++i) c.v[i] = load_stream16(q + i);
    return c;
  } else {
    return load_chunk_scalar(p, kChunk);
  }
}

// Exact widening of a Chunk to f32 (element j of the chunk -> f[j]).
template <typename T>
__device__ __forceinline__ void widen(const Chunk<T>& c, float (&f)[kChunk]) {
  if constexpr (std::is_same_v<T, float>) {
    f[0] = __uint_as_float(c.v[0].x);
    f[1] = __uint_as_float(c.v[0].y);
    f[2] = __uint_as_float(c.v[0].z);
    f[3] = __uint_as_float(c.v[0].w);
    f[4] = __uint_as_float(c.v[1].x);
    f[5] = __uint_as_float(c.v[1].y);
    f[6] = __uint_as_float(c.v[1].z);
    f[7] = __uint_as_float(c.v[1].w);
  } else {
    const uint32_t words[4] = {c.v[0].x, c.v[0].y, c.v[0].z, c.v[0].w};
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      // Little-endian: element 2i is the low half of word i.
      if constexpr (std::is_same_v<T, __nv_bfloat16>) {
        f[2 * i] = __uint_as_float(words[i] << 16);
        f[2 * i + 1] = __uint_as_float(words[i] & 0xffff0000u);
      } else {
        f[2 * i] = __half2float(__ushort_as_half(static_cast<unsigned short>(words[i] & 0xffffu)));
        f[2 * i + 1] = __half2float(__ushort_as_half(static_cast<unsigned short>(words[i] >> 16)));
      }
    }
  }
}

// Eight activations at p (16-byte aligned when kVec), through L1.
template <bool kVec>
__device__ __forceinline__ void load_x8(const float* p, float (&v)[kChunk]) {
  if constexpr (kVec) {
    const float4 a = __ldg(reinterpret_cast<const float4*>(p));
    const float4 b = __ldg(reinterpret_cast<const float4*>(p) + 1);
    v[0] = a.x, v[1] = a.y, v[2] = a.z, v[3] = a.w;
    v[4] = b.x, v[5] = b.y, v[6] = b.z, v[7] = b.w;
  } else {
#pragma unroll
    for (int j = 0; j < kChunk; ++j) v[j] = __ldg(p + j);
  }
}

// acc[g][c] += w_c[j] · x_g[j] for j = 0..7, one fmaf at a time in j order.
// This is the whole per-row arithmetic of a full chunk: it is the same for
// every G and every position of a row in its group.
template <typename T, int G, bool kVec>
__device__ __forceinline__ void accumulate_chunk(const Chunk<T> (&raw)[kCols],
                                                 const float* const (&xrow)[G], int64_t k,
                                                 float (&acc)[G][kCols]) {
  float wf[kCols][kChunk];
#pragma unroll
  for (int c = 0; c < kCols; ++c) widen(raw[c], wf[c]);
#pragma unroll
  for (int g = 0; g < G; ++g) {
    float xv[kChunk];
    load_x8<kVec>(xrow[g] + k, xv);
#pragma unroll
    for (int c = 0; c < kCols; ++c) {
#pragma unroll
      for (int j = 0; j < kChunk; ++j) acc[g][c] = fmaf(wf[c][j], xv[j], acc[g][c]);
    }
  }
}

// The final chunk of `count` (< 8) elements: scalar loads, fmaf for j < count.
template <typename T, int G>
__device__ __forceinline__ void accumulate_partial(const T* const (&wrow)[kCols],
                                                   const float* const (&xrow)[G], int64_t k,
                                                   int count, float (&acc)[G][kCols]) {
  float wf[kCols][kChunk];
#pragma unroll
  for (int c = 0; c < kCols; ++c) widen(load_chunk_scalar(wrow[c] + k, count), wf[c]);
#pragma unroll
  for (int g = 0; g < G; ++g) {
    float xv[kChunk];
#pragma unroll
    for (int j = 0; j < kChunk; ++j) xv[j] = j < count ? __ldg(xrow[g] + k + j) : 0.0f;
#pragma unroll
    for (int c = 0; c < kCols; ++c) {
#pragma unroll
      for (int j = 0; j < kChunk; ++j) {
        if (j < count) acc[g][c] = fmaf(wf[c][j], xv[j], acc[g][c]);
      }
    }
  }
}

// Chunks in flight per lane per loop step (loads are issued before any is
// used): more where few rows leave registers free. Changes only scheduling,
// never the order of a row's fmaf sequence.
template <typename T, int G>
constexpr int unroll_for() {
  if constexpr (sizeof(T) == 4) return 2;
  return G <= 5 ? 4 : 2;
}

// Batch-invariant y = x · wᵀ for one group of G rows and kCols columns per warp.
// Grid: one block per (column block of kWarps·kCols columns, row group), the
// row group varying fastest so the blocks that stream the same weights run at
// the same time and share them through L2. Rows past M (in the last group) and
// columns past N (in the last block) are computed on clamped, valid addresses
// and never written. kVec: w rows, x rows and the chunks are 16-byte aligned.
template <typename T, int G, bool kVec>
__global__ void __launch_bounds__(kThreads)
    invariant_linear_kernel(const float* __restrict__ x, const T* __restrict__ w,
                            float* __restrict__ y, int m_rows, int n_cols, int k_dim,
                            int n_groups) {
  constexpr int kUnroll = unroll_for<T, G>();
  const int lane = static_cast<int>(threadIdx.x & 31u);
  const int group = static_cast<int>(blockIdx.x % static_cast<unsigned>(n_groups));
  const int col_block = static_cast<int>(blockIdx.x / static_cast<unsigned>(n_groups));
  const int n0 = (col_block * kWarps + static_cast<int>(threadIdx.x >> 5)) * kCols;
  if (n0 >= n_cols) return;  // warp-uniform; the kernel has no block barrier
  const int m0 = group * G;

  const T* wrow[kCols];
#pragma unroll
  for (int c = 0; c < kCols; ++c) {
    wrow[c] = w + static_cast<int64_t>(min(n0 + c, n_cols - 1)) * k_dim;
  }
  const float* xrow[G];
#pragma unroll
  for (int g = 0; g < G; ++g) xrow[g] = x + static_cast<int64_t>(min(m0 + g, m_rows - 1)) * k_dim;

  float acc[G][kCols];
#pragma unroll
  for (int g = 0; g < G; ++g) {
#pragma unroll
    for (int c = 0; c < kCols; ++c) acc[g][c] = 0.0f;
  }

  // Lane `lane` visits chunks lane, lane + 32, ... in increasing order.
  const int n_full = k_dim / kChunk;
  int chunk = lane;
  for (; chunk + 32 * (kUnroll - 1) < n_full; chunk += 32 * kUnroll) {
    Chunk<T> raw[kUnroll][kCols];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
#pragma unroll
      for (int c = 0; c < kCols; ++c) {
        raw[u][c] = load_chunk<T, kVec>(wrow[c] + static_cast<int64_t>(chunk + 32 * u) * kChunk);
      }
    }
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      accumulate_chunk<T, G, kVec>(raw[u], xrow, static_cast<int64_t>(chunk + 32 * u) * kChunk,
                                   acc);
    }
  }
  for (; chunk < n_full; chunk += 32) {
    Chunk<T> raw[kCols];
#pragma unroll
    for (int c = 0; c < kCols; ++c) {
      raw[c] = load_chunk<T, kVec>(wrow[c] + static_cast<int64_t>(chunk) * kChunk);
    }
    accumulate_chunk<T, G, kVec>(raw, xrow, static_cast<int64_t>(chunk) * kChunk, acc);
  }
  // Here chunk is in [n_full, n_full + 32): exactly one lane has chunk == n_full,
  // and the partial chunk is the last of that lane's sequence.
  const int rem = k_dim - n_full * kChunk;
  if (rem != 0 && chunk == n_full) {
    accumulate_partial<T, G>(wrow, xrow, static_cast<int64_t>(n_full) * kChunk, rem, acc);
  }

  // Fixed xor tree: afterwards every lane holds the same bits for each sum.
#pragma unroll
  for (int g = 0; g < G; ++g) {
#pragma unroll
    for (int c = 0; c < kCols; ++c) {
      float v = acc[g][c];
#pragma unroll
      for (int offset = 16; offset > 0; offset >>= 1) v += __shfl_xor_sync(kFullMask, v, offset);
      acc[g][c] = v;
    }
  }
  // Lane g·kCols + c writes y[m0 + g, n0 + c].
  float out = 0.0f;
#pragma unroll
  for (int g = 0; g < G; ++g) {
#pragma unroll
    for (int c = 0; c < kCols; ++c) {
      if (lane == g * kCols + c) out = acc[g][c];
    }
  }
  const int g_out = lane / kCols;
  const int c_out = lane % kCols;
  if (lane < G * kCols && m0 + g_out < m_rows && n0 + c_out < n_cols) {
    y[static_cast<int64_t>(m0 + g_out) * n_cols + n0 + c_out] = out;
  }
}

bool aligned16(const void* p) {
  return (reinterpret_cast<uintptr_t>(p) & 15u) == 0;
}

template <typename T, int G, bool kVec>
void launch_invariant_group(const float* x, const T* w, float* y, int64_t m, int64_t n, int64_t k,
                            cudaStream_t stream) {
  const int64_t groups = (m + G - 1) / G;
  const int64_t col_blocks = (n + kWarps * kCols - 1) / (kWarps * kCols);
  const int64_t blocks = groups * col_blocks;
  if (blocks > INT_MAX) {
    fail("linear: {} row groups x {} column blocks exceed the CUDA grid", groups, col_blocks);
  }
  invariant_linear_kernel<T, G, kVec><<<static_cast<unsigned>(blocks), kThreads, 0, stream>>>(
      x, w, y, static_cast<int>(m), static_cast<int>(n), static_cast<int>(k),
      static_cast<int>(groups));
  check_cuda(cudaGetLastError(), "invariant_linear_kernel");
}

// Rows 1..8 run as one group of exactly M rows; more rows run in groups of 8
// (the last one padded). Misaligned operands take the scalar-load kernel,
// which is only instantiated for groups of 8 (rare: sliced test views).
template <typename T>
void launch_invariant(const float* x, const T* w, float* y, int64_t m, int64_t n, int64_t k,
                      cudaStream_t stream) {
  const bool vec =
      aligned16(x) && aligned16(w) && k % 4 == 0 && (k * static_cast<int64_t>(sizeof(T))) % 16 == 0;
  if (!vec) return launch_invariant_group<T, kMaxGroup, false>(x, w, y, m, n, k, stream);
  switch (std::min<int64_t>(m, kMaxGroup)) {
    case 1:
      return launch_invariant_group<T, 1, true>(x, w, y, m, n, k, stream);
    case 2:
      return launch_invariant_group<T, 2, true>(x, w, y, m, n, k, stream);
    case 3:
      return launch_invariant_group<T, 3, true>(x, w, y, m, n, k, stream);
    case 4:
      return launch_invariant_group<T, 4, true>(x, w, y, m, n, k, stream);
    case 5:
      return launch_invariant_group<T, 5, true>(x, w, y, m, n, k, stream);
    case 6:
      return launch_invariant_group<T, 6, true>(x, w, y, m, n, k, stream);
    case 7:
      return launch_invariant_group<T, 7, true>(x, w, y, m, n, k, stream);
    default:
      return launch_invariant_group<T, kMaxGroup, true>(x, w, y, m, n, k, stream);
  }
}

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

// dst = bf16(src) for n elements; src is f32 or f16 (callers pass nothing else).
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
    check_cublas(cublasLtMatmulPreferenceSetAttribute(p, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES,
                                                      &workspace, sizeof(workspace)),
                 "cublasLtMatmulPreferenceSetAttribute(MAX_WORKSPACE_BYTES)");
    check_cublas(cublasLtMatmulPreferenceSetAttribute(p, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES,
                                                      &align_a, sizeof(align_a)),
                 "cublasLtMatmulPreferenceSetAttribute(MIN_ALIGNMENT_A_BYTES)");
    check_cublas(cublasLtMatmulPreferenceSetAttribute(p, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES,
                                                      &align_b, sizeof(align_b)),
                 "cublasLtMatmulPreferenceSetAttribute(MIN_ALIGNMENT_B_BYTES)");
    check_cublas(cublasLtMatmulPreferenceSetAttribute(p, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES,
                                                      &align_c, sizeof(align_c)),
                 "cublasLtMatmulPreferenceSetAttribute(MIN_ALIGNMENT_C_BYTES)");
    check_cublas(cublasLtMatmulPreferenceSetAttribute(p, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES,
                                                      &align_c, sizeof(align_c)),
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

// Runs y = x · wᵀ through cuBLASLt and returns true, or returns false (having
// queued nothing) when cuBLASLt has no algorithm for the shape.
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

// ---------------------------------------------------------------------------
// embedding.

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
  embedding_kernel<T><<<grid, kElemThreads, 0, stream>>>(table.data_as<const T>(),
                                                         ids.data_as<const int32_t>(), scale,
                                                         out.data_as<float>(), n, h, table.dim(0));
  check_cuda(cudaGetLastError(), "embedding_kernel");
}

}  // namespace

// y[M, N] = x[M, K] · w[N, K]ᵀ; x, y f32, w f32|bf16|f16, all on this device; y
// must not overlap x or w. Batch-invariant for M <= kInvariantRows (see top).
void CudaBackend::linear(const Tensor& x, const Tensor& w, const Tensor& y) {
  OpTimer timer(*this, "linear");
  linear_rows_above(x, w, y, kInvariantRows);
}

void CudaBackend::linear_prefill(const Tensor& x, const Tensor& w, const Tensor& y) {
  OpTimer timer(*this, "linear_prefill");
  linear_rows_above(x, w, y, kPrefillGemmRows);
}

// Products of more than `gemm_rows` rows go through cuBLASLt, the rest through
// the batch-invariant kernel.
void CudaBackend::linear_rows_above(const Tensor& x, const Tensor& w, const Tensor& y,
                                    int64_t gemm_rows) {
  constexpr const char* kOp = "linear";
  check_on(*this, kOp, "x", x);
  check_on(*this, kOp, "w", w);
  check_on(*this, kOp, "y", y);
  check_dtype(kOp, "x", x, DType::kF32);
  check_float(kOp, "w", w);
  check_dtype(kOp, "y", y, DType::kF32);
  check_rank(kOp, "x", x, 2);
  check_rank(kOp, "w", w, 2);
  check_rank(kOp, "y", y, 2);
  if (x.dim(1) != w.dim(1)) {
    fail("linear: x {} and w {} disagree on K ({} vs {})", x.describe(), w.describe(), x.dim(1),
         w.dim(1));
  }
  if (y.dim(0) != x.dim(0) || y.dim(1) != w.dim(0)) {
    fail("linear: y {} must be f32[{}, {}] for x {} and w {}", y.describe(), x.dim(0), w.dim(0),
         x.describe(), w.describe());
  }
  check_no_alias(kOp, "y", y, "x", x);
  check_no_alias(kOp, "y", y, "w", w);
  const int64_t m = x.dim(0);
  const int64_t n = w.dim(0);
  const int64_t k = x.dim(1);
  if (m == 0 || n == 0) return;
  if (k == 0) {
    check_cuda(cudaMemsetAsync(y.data(), 0, y.nbytes(), stream_), "linear (cudaMemsetAsync)");
    return;
  }
  if (m > INT_MAX || n > INT_MAX - kWarps * kCols || k > INT_MAX - kChunk) {
    fail("linear: x {} or w {} is too large for the GPU kernels (M, N and K must stay below 2^31)",
         x.describe(), w.describe());
  }
  if (m > gemm_rows && linear_lt(*this, x, w, y)) return;
  const float* xp = x.data_as<const float>();
  float* yp = y.data_as<float>();
  switch (w.dtype()) {
    case DType::kF32:
      launch_invariant(xp, w.data_as<const float>(), yp, m, n, k, stream_);
      break;
    case DType::kBF16:
      launch_invariant(xp, w.data_as<const __nv_bfloat16>(), yp, m, n, k, stream_);
      break;
    default:
      launch_invariant(xp, w.data_as<const __half>(), yp, m, n, k, stream_);
      break;
  }
}

// out[n, :] = f32(table[ids[n], :]) · scale; table f32|bf16|f16 [V, H], ids i32
// [N], out f32 [N, H], all on this device; out must not overlap table or ids.
// An id outside [0, V) gives a zero row (the CPU backend throws; see top).
void CudaBackend::embedding(const Tensor& table, const Tensor& ids, float scale,
                            const Tensor& out) {
  OpTimer timer(*this, "embedding");
  constexpr const char* kOp = "embedding";
  check_on(*this, kOp, "table", table);
  check_on(*this, kOp, "ids", ids);
  check_on(*this, kOp, "out", out);
  check_float(kOp, "table", table);
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
