// SPDX-License-Identifier: Apache-2.0
// Grouped expert products on the tensor cores for moe_experts' prefill path
// (cuda_moe_gemm.cu). Internal to engine/backend/cuda: cuda_moe.cu calls these
// once a pass's (token, slot) pairs are bucketed by expert.
//
// Why: the batch-invariant expert kernels stream every expert's weights per
// pass of 256 tokens and dot them on the FMA units, which left 26B-A4B's
// prefill at ~2% of the matrix peak. Here a block computes a 128 x 128 tile of
// one expert's rows against 128 weight rows with mma.m16n8k16 (bf16 operands,
// f32 accumulation), its A rows gathered through the bucket list, so each
// expert's weights are read once per 128 of its slots.
//
// Numerics: activations are rounded to bf16 (x before gate/up, the gated
// activation before down), as linear_prefill rounds x for cuBLASLt; sums in
// f32 over K in a fixed order. A slot's results depend on its own row and the
// expert's weights only, not on which tile row it lands in, but the rounding
// makes them differ from the batch-invariant path: prefill only.
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>

namespace specula::cuda {

// Slots of one expert's tile (rows of the A operand).
inline constexpr int kMoeTileRows = 128;

// A pass's slots in tiles of kMoeTileRows, each tile within one expert:
// tile t covers list[tile_begin[t] .. min(tile_begin[t] + kMoeTileRows,
// offsets[tile_expert[t] + 1])). Written on the device by the bucket kernel;
// tiles at or past *tile_count are empty (their blocks return at once).
struct MoeTiles {
  const int32_t* tile_expert;  // [max tiles]
  const int32_t* tile_begin;   // [max tiles]
  const int32_t* tile_count;   // [1]
  const int32_t* offsets;      // [E + 1]: expert e's slots are list[offsets[e] .. offsets[e + 1])
  const int32_t* list;         // [S]: pass-local slots s = token * top_k + choice
};

// Tiles a pass of `slots` slots over `experts` experts can need at most.
inline int64_t moe_max_tiles(int64_t slots, int64_t experts) {
  return (slots + kMoeTileRows - 1) / kMoeTileRows + experts;
}

// act bf16 [S, I] (row s for slot s) = bf16(gelu_tanh(g) · u), where [g | u] =
// xb[s / top_k] · gate_up[e]ᵀ for slot s of expert e: xb bf16 [tokens, H],
// gate_up bf16 [E, 2I, H]. H and I multiples of 8, pointers 16-byte aligned.
void moe_gemm_gate_up(const __nv_bfloat16* xb, const __nv_bfloat16* gate_up, __nv_bfloat16* act,
                      int64_t hidden, int64_t inter, int top_k, const MoeTiles& tiles,
                      int64_t max_tiles, cudaStream_t stream);

// y f32 [S, H] (row s for slot s) = act[s] · down[e]ᵀ for slot s of expert e:
// down bf16 [E, H, I]. Same alignment as above.
void moe_gemm_down(const __nv_bfloat16* act, const __nv_bfloat16* down, float* y, int64_t hidden,
                   int64_t inter, const MoeTiles& tiles, int64_t max_tiles, cudaStream_t stream);

}  // namespace specula::cuda
