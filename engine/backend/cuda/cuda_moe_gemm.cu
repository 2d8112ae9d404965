// SPDX-License-Identifier: Apache-2.0
// Grouped expert products of moe_experts' prefill path; the contract and the
// numerics are in cuda_moe_gemm.h.
//
// Layout. A block of 8 warps owns one tile of kBM slots of one expert (A rows,
// gathered through the bucket list) against kBN weight rows of that expert,
// and runs over K in steps of kBK with a kStages-deep cp.async pipeline in
// shared memory. Warp w computes rows 64·(w / 4) .. +64 and columns 32·(w % 4)
// .. +32 of the tile: 4 x 4 mma.m16n8k16 per 16 of K, fed by ldmatrix. A
// stage holds each row's kBK elements as 4 chunks of 16 bytes, chunk c of row
// r stored at slot c ^ ((r / 2) % 4): the 8 rows one ldmatrix phase reads then
// fall in 8 distinct bank groups.
//
// The gate/up product interleaves its weight rows (tile row 2j is gate column
// j, row 2j + 1 up column j), so the two accumulators of an mma fragment's
// column pair are one column's gate and up, and the epilogue writes
// gelu_tanh(g) · u without exchanging anything between threads.
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "engine/backend/cuda/cuda_backend.h"
#include "engine/backend/cuda/cuda_device_common.cuh"
#include "engine/backend/cuda/cuda_launch.cuh"
#include "engine/backend/cuda/cuda_moe_gemm.h"

namespace specula::cuda {
namespace {

using bf16 = __nv_bfloat16;

constexpr int kBM = kMoeTileRows;  // slots of a tile
constexpr int kBN = 128;           // weight rows of a tile
constexpr int kBK = 32;            // K per pipeline stage
constexpr int kStages = 4;
constexpr int kThreads = 256;
constexpr int kChunks = kBK / 8;        // 16-byte chunks of a stage row
constexpr int kStageA = kBM * kChunks;  // uint4 per stage
constexpr int kStageB = kBN * kChunks;
constexpr size_t kSmemBytes = static_cast<size_t>(kStages) * (kStageA + kStageB) * sizeof(uint4);
static_assert(kThreads / kChunks * 2 == kBM && kBM == kBN,
              "each thread copies two rows of A and B");

enum class Epilogue { kGateUp, kDown };

__device__ __forceinline__ int swizzled(int row, int chunk) {
  return row * kChunks + (chunk ^ ((row >> 1) & 3));
}

// 16 bytes global -> shared, or 16 zero bytes when !valid (nothing is read).
__device__ __forceinline__ void cp_async16_zfill(void* smem, const void* gmem, bool valid) {
  const auto dst = static_cast<unsigned>(__cvta_generic_to_shared(smem));
  const int src_bytes = valid ? 16 : 0;
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" ::"r"(dst), "l"(gmem), "r"(src_bytes)
               : "memory");
}

__device__ __forceinline__ void ldmatrix_x4(uint32_t (&r)[4], const void* smem) {
  const auto addr = static_cast<unsigned>(__cvta_generic_to_shared(smem));
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(addr));
}

// d += A · B for one m16n8k16 (bf16 in, f32 accumulate).
__device__ __forceinline__ void mma_bf16(float (&d)[4], const uint32_t (&a)[4], uint32_t b0,
                                         uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, "
      "{%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// grid (column tiles, max tiles): block (x, t) computes tile t of the pass
// against column tile x. A row of slot s is a + (s / a_row_div) · K (the
// token's row of xb for gate/up, the slot's row of act for down). Weights:
// w + e · w_expert_stride, rows of K elements; n_out: I (gate/up, whose tile
// covers kBN / 2 columns) or H (down).
template <Epilogue kE>
__global__ void __launch_bounds__(kThreads, 2)
    moe_gemm_kernel(const bf16* __restrict__ a, int a_row_div, const bf16* __restrict__ w,
                    int64_t w_expert_stride, int64_t n_out, int64_t k_dim, MoeTiles tiles,
                    void* __restrict__ out) {
  const int tile = static_cast<int>(blockIdx.y);
  if (tile >= *tiles.tile_count) return;  // block-uniform, before any barrier
  const int expert = tiles.tile_expert[tile];
  const int begin = tiles.tile_begin[tile];
  const int end = min(begin + kBM, tiles.offsets[expert + 1]);
  const int rows = end - begin;  // >= 1 for a listed tile

  extern __shared__ uint4 smem[];
  uint4* const s_a = smem;
  uint4* const s_b = smem + kStages * kStageA;

  // Copy assignment: chunk `lc` of tile rows lr and lr + 64, for A and for B.
  const int tid = static_cast<int>(threadIdx.x);
  const int lc = tid % kChunks;
  const int lr = tid / kChunks;
  const bf16* a_src[2];
  const bf16* b_src[2];
  const bf16* w_e = w + static_cast<int64_t>(expert) * w_expert_stride;
#pragma unroll
  for (int j = 0; j < 2; ++j) {
    const int r = lr + 64 * j;
    // Rows past the tile's slots copy its first slot: computed, never written.
    const int slot = tiles.list[begin + (r < rows ? r : 0)];
    a_src[j] = a + static_cast<int64_t>(slot / a_row_div) * k_dim + lc * 8;
    int64_t w_row;
    if constexpr (kE == Epilogue::kGateUp) {
      const int64_t col = min(static_cast<int64_t>(blockIdx.x) * (kBN / 2) + r / 2, n_out - 1);
      w_row = (r & 1) != 0 ? n_out + col : col;
    } else {
      w_row = min(static_cast<int64_t>(blockIdx.x) * kBN + r, n_out - 1);
    }
    b_src[j] = w_e + w_row * k_dim + lc * 8;
  }
  const int k_tiles = static_cast<int>((k_dim + kBK - 1) / kBK);
  const auto load_stage = [&](int stage, int kt) {
    const int64_t k0 = static_cast<int64_t>(kt) * kBK;
    const bool valid = k0 + lc * 8 < k_dim;  // K is a multiple of 8: whole chunks
    const int64_t off = valid ? k0 : 0;
#pragma unroll
    for (int j = 0; j < 2; ++j) {
      const int slot = swizzled(lr + 64 * j, lc);
      cp_async16_zfill(s_a + stage * kStageA + slot, a_src[j] + off, valid);
      cp_async16_zfill(s_b + stage * kStageB + slot, b_src[j] + off, valid);
    }
  };

  const int lane = tid & 31;
  const int warp = tid >> 5;
  const int wm = warp / 4;  // rows 64·wm ..
  const int wn = warp % 4;  // columns 32·wn ..
  float acc[4][4][4];
#pragma unroll
  for (int i = 0; i < 4; ++i) {
#pragma unroll
    for (int j = 0; j < 4; ++j) {
#pragma unroll
      for (int q = 0; q < 4; ++q) acc[i][j][q] = 0.0f;
    }
  }

#pragma unroll
  for (int s = 0; s < kStages - 1; ++s) {
    if (s < k_tiles) load_stage(s, s);
    cp_async_commit();
  }
  for (int kt = 0; kt < k_tiles; ++kt) {
    cp_async_wait<kStages - 2>();  // stage kt has landed (for this thread) ...
    __syncthreads();               // ... for every thread, and stage kt - 1 is consumed
    const int next = kt + kStages - 1;
    if (next < k_tiles) load_stage(next % kStages, next);
    cp_async_commit();
    const uint4* sa = s_a + (kt % kStages) * kStageA;
    const uint4* sb = s_b + (kt % kStages) * kStageB;
#pragma unroll
    for (int ks = 0; ks < kBK / 16; ++ks) {
      uint32_t af[4][4];
#pragma unroll
      for (int mt = 0; mt < 4; ++mt) {
        const int row = wm * 64 + mt * 16 + (lane & 15);
        ldmatrix_x4(af[mt], sa + swizzled(row, ks * 2 + (lane >> 4)));
      }
      uint32_t bfr[4][2];
#pragma unroll
      for (int np = 0; np < 2; ++np) {
        const int n = wn * 32 + np * 16 + (lane & 7) + ((lane >> 4) << 3);
        uint32_t r[4];
        ldmatrix_x4(r, sb + swizzled(n, ks * 2 + ((lane >> 3) & 1)));
        bfr[2 * np][0] = r[0];
        bfr[2 * np][1] = r[1];
        bfr[2 * np + 1][0] = r[2];
        bfr[2 * np + 1][1] = r[3];
      }
#pragma unroll
      for (int mt = 0; mt < 4; ++mt) {
#pragma unroll
        for (int nt = 0; nt < 4; ++nt) mma_bf16(acc[mt][nt], af[mt], bfr[nt][0], bfr[nt][1]);
      }
    }
  }
  cp_async_wait<0>();

  // Fragment entry q of (mt, nt): tile row wm·64 + mt·16 + lane/4 + 8·(q/2),
  // tile column wn·32 + nt·8 + 2·(lane%4) + q%2.
#pragma unroll
  for (int mt = 0; mt < 4; ++mt) {
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      const int row = wm * 64 + mt * 16 + (lane >> 2) + 8 * half;
      if (row >= rows) continue;
      const int64_t slot = tiles.list[begin + row];
#pragma unroll
      for (int nt = 0; nt < 4; ++nt) {
        const int col = wn * 32 + nt * 8 + 2 * (lane & 3);  // even
        const float v0 = acc[mt][nt][2 * half];
        const float v1 = acc[mt][nt][2 * half + 1];
        if constexpr (kE == Epilogue::kGateUp) {
          const int64_t j = static_cast<int64_t>(blockIdx.x) * (kBN / 2) + col / 2;
          if (j < n_out) {
            static_cast<bf16*>(out)[slot * n_out + j] =
                __float2bfloat16_rn(__fmul_rn(gelu_tanh(v0), v1));
          }
        } else {
          const int64_t n = static_cast<int64_t>(blockIdx.x) * kBN + col;
          if (n < n_out) {  // n_out is even, so n + 1 < n_out too
            *reinterpret_cast<float2*>(static_cast<float*>(out) + slot * n_out + n) =
                make_float2(v0, v1);
          }
        }
      }
    }
  }
}

void check_grid(int64_t column_tiles, int64_t max_tiles, const char* what) {
  if (column_tiles > 2147483647 || max_tiles > 65535) {
    fail("{}: {} x {} tiles exceed the launch grid", what, column_tiles, max_tiles);
  }
}

}  // namespace

void moe_gemm_gate_up(const bf16* xb, const bf16* gate_up, bf16* act, int64_t hidden, int64_t inter,
                      int top_k, const MoeTiles& tiles, int64_t max_tiles, cudaStream_t stream) {
  const int64_t column_tiles = (inter + kBN / 2 - 1) / (kBN / 2);
  check_grid(column_tiles, max_tiles, "moe_gemm_gate_up");
  launch_kernel(moe_gemm_kernel<Epilogue::kGateUp>,
                dim3(static_cast<unsigned>(column_tiles), static_cast<unsigned>(max_tiles)),
                dim3(kThreads), kSmemBytes, stream, "moe_gemm_gate_up", false, xb, top_k, gate_up,
                2 * inter * hidden, inter, hidden, tiles, static_cast<void*>(act));
}

void moe_gemm_down(const bf16* act, const bf16* down, float* y, int64_t hidden, int64_t inter,
                   const MoeTiles& tiles, int64_t max_tiles, cudaStream_t stream) {
  const int64_t column_tiles = (hidden + kBN - 1) / kBN;
  check_grid(column_tiles, max_tiles, "moe_gemm_down");
  launch_kernel(moe_gemm_kernel<Epilogue::kDown>,
                dim3(static_cast<unsigned>(column_tiles), static_cast<unsigned>(max_tiles)),
                dim3(kThreads), kSmemBytes, stream, "moe_gemm_down", false, act, 1, down,
                hidden * inter, hidden, inter, tiles, static_cast<void*>(y));
}

}  // namespace specula::cuda
