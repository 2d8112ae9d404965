// SPDX-License-Identifier: Apache-2.0
// Gemma4Weights: views of every tensor of a Gemma 4 text decoder, declared once
// with expected shapes in `declare_gemma4_weights` (gemma4-architecture.md §7).
// The views point into the mapped checkpoint, which must outlive them.
#pragma once

#include "engine/backend/backends.h"
#include "engine/memory/memory_resource.h"

#include <vector>

#include "engine/io/weight_table.h"
#include "engine/model/gemma4/config.h"

namespace specula::gemma4 {

struct Gemma4LayerWeights {
  Tensor input_layernorm;             // [H]
  Tensor post_attention_layernorm;    // [H]
  Tensor pre_feedforward_layernorm;   // [H]
  Tensor post_feedforward_layernorm;  // [H]
  Tensor q_proj;                      // [Nh·D, H]
  Tensor q_norm;                      // [D]
  Tensor k_proj;                      // [kv·D, H]  absent on KV-shared layers
  Tensor k_norm;                      // [D]        absent on KV-shared layers
  Tensor v_proj;                      // [kv·D, H]  absent on shared and k_eq_v layers
  Tensor o_proj;                      // [H, Nh·D]
  Tensor gate_proj;                   // [I, H]
  Tensor up_proj;                     // [I, H]
  Tensor down_proj;                   // [H, I]
  Tensor layer_scalar;                // [1]
  // Per-layer embeddings (hidden_size_per_layer_input = P > 0).
  Tensor per_layer_input_gate;       // [P, H]
  Tensor per_layer_projection;       // [H, P]
  Tensor post_per_layer_input_norm;  // [H]
  // Mixture of experts (enable_moe_block).
  Tensor router_proj;                   // [E, H]
  Tensor router_scale;                  // [H]
  Tensor router_per_expert_scale;       // [E]
  Tensor experts_gate_up;               // [E, 2·I_moe, H]
  Tensor experts_down;                  // [E, H, I_moe]
  Tensor pre_feedforward_layernorm_2;   // [H]
  Tensor post_feedforward_layernorm_1;  // [H]
  Tensor post_feedforward_layernorm_2;  // [H]
};

struct Gemma4Weights {
  Tensor embed_tokens;                // [V, H], also the tied lm_head
  Tensor norm;                        // [H]
  Tensor embed_tokens_per_layer;      // [V_ple, L·P]
  Tensor per_layer_model_projection;  // [L·P, H]
  Tensor per_layer_projection_norm;   // [P]
  std::vector<Gemma4LayerWeights> layers;
};

// Declares every weight of `config` (names with config.weight_prefix) into
// `table`, binding to fields of `weights`. Tensors the model never reads
// (k/v projections of shared layers, lm_head.weight of tied checkpoints, the
// vision and audio towers) are declared ignored.
void declare_gemma4_weights(const Gemma4Config& config, Gemma4Weights* weights,
                            io::WeightTable* table);

// Puts every bound weight of `table` on `backend`'s device in one allocation
// and repoints each field at its copy. On the CPU backend nothing is copied
// (fields stay views of the mapped checkpoint) and the buffer is empty.
// With `scan` (the checkpoint the table was bound from), every float weight is
// first checked for NaN and infinity (io::check_finite: the error names the
// tensor and its file), each right before its upload, so the bytes are read
// once from the mapping; on the CPU backend this is the first read of the
// weights. Null skips the scan.
DeviceBuffer place_weights(const io::WeightTable& table, Backend& backend,
                           const io::Checkpoint* scan);

// Gives every float entry of `table` freshly allocated memory of `dtype` on
// `backend` (one allocation) filled with seeded uniform values (entry i uses
// stream seed + i): rank-1 weights (norm scales, router scales, layer_scalar) in
// [0.9, 1.1); matrices in ±sqrt(3 / fan_in), so activations keep unit scale.
// Entries with integer dtypes are left empty for the caller. For benchmarks of
// released shapes without a checkpoint.
DeviceBuffer random_weights(const io::WeightTable& table, Backend& backend, uint64_t seed,
                            DType dtype);

// Quantizes, in place on `backend`, every bound float entry of `table`
// declared with add_matrix to `dtype` (kI8 | kF8E4M3; io::quantize_rows on a
// host copy): returns one new buffer holding every bound entry (codes and
// scales of the matrices, copies of the rest) with the fields repointed, so
// the caller may release the old one. For random drafters of released shapes
// (benchmarks of quantized drafters without a checkpoint).
DeviceBuffer quantize_weights(const io::WeightTable& table, Backend& backend, DType dtype);

// The value of a one-element float tensor on any device, as f32.
float read_scalar(Backend& backend, const Tensor& t, const std::string& what);

}  // namespace specula::gemma4
