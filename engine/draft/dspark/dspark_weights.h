// SPDX-License-Identifier: Apache-2.0
// DSparkWeights: views of every tensor of a DSpark drafter, declared once per
// layout (names and shapes as docs/dspark.md fixes them) into a WeightTable.
// Shapes are PyTorch's nn.Linear [out, in]. The views point into the mapped
// checkpoint (or a device copy), which must outlive them.
#pragma once

#include <string>
#include <vector>

#include "engine/core/tensor.h"
#include "engine/draft/dspark/dspark_config.h"
#include "engine/io/weight_table.h"

namespace specula::dspark {

struct DSparkLayerWeights {
  // Both layouts.
  Tensor q_proj, k_proj, v_proj,
      o_proj;                 // specula [d, d]; DeepSpec [Nh·D, H], [KV·D, H], [H, Nh·D]
  Tensor gate_proj, up_proj;  // [F, d]
  Tensor down_proj;           // [d, F]
  // specula layout
  Tensor attn_norm, ffn_norm;  // [d]
  // DeepSpec layout (v_proj empty when k_eq_v)
  Tensor q_norm, k_norm;                                         // [D]
  Tensor input_layernorm, post_attention_layernorm;              // [H]
  Tensor pre_feedforward_layernorm, post_feedforward_layernorm;  // [H]
  Tensor layer_scalar;                                           // [1]
};

struct DSparkWeights {
  std::vector<DSparkLayerWeights> layers;
  Tensor context_proj;  // [d, m·H] (DeepSpec: fc.weight)
  Tensor context_norm;  // [d]      (DeepSpec: hidden_norm.weight)
  Tensor out_norm;      // [d]      (DeepSpec: norm.weight)
  // specula layout
  Tensor token_proj;  // [d, H]
  Tensor mask_embed;  // [γ−1, d] (empty when γ = 1)
  Tensor block_pos;   // [γ, d]
  Tensor out_proj;    // [H, d]
  // DeepSpec layout: optional (absent: the target's embedding / tied head)
  Tensor embed_tokens;  // [V, H]
  Tensor lm_head;       // [V, H]
  // Heads (r > 0 / confidence head present)
  Tensor markov_w1;          // [V, r]
  Tensor markov_w2;          // [V, r]
  Tensor confidence_weight;  // [1, d (+ r)]
  Tensor confidence_bias;    // [1]
};

// Declares every weight of `c` (its layout's names) for a target of `target_hidden`
// H and vocabulary V into `table`, bound to `w`.
// Matrices (projections, MLP, context/token/out projections, DeepSpec's own
// embedding and head, the Markov tables W1/W2) are declared with add_matrix:
// they may be stored quantized. Norms, block_pos / mask_embed (γ rows, read
// once into the block's base rows), layer scalars and the confidence head stay float.
void declare_dspark_weights(const DSparkConfig& c, int64_t target_hidden, int64_t vocab,
                            DSparkWeights* w, io::WeightTable* table);

// The checkpoint names of the matrices of the drafter in `dir` (either
// layout) that may be stored quantized, for `specula quantize`.
std::vector<std::string> dspark_matrix_names(const std::string& dir);

}  // namespace specula::dspark
