// SPDX-License-Identifier: Apache-2.0
// The Gemma 4 assistant (MTP) drafter (gemma4-architecture.md §10-11): a small
// decoder whose Q-only layers attend to the target's donor K/V, fed with
// [target scaled embedding of the last token ; target post-norm hidden], whose
// next hidden is post_projection of its normed state, with a centroid
// ("masked embedding") or a tied dense output head.
#pragma once

#include <memory>
#include <string>
#include <vector>

#include "engine/core/buffer.h"
#include "engine/draft/donor_attention.h"
#include "engine/io/safetensors.h"
#include "engine/io/weight_table.h"
#include "engine/memory/arena.h"
#include "engine/model/gemma4/config.h"

namespace specula::assistant {

struct AssistantConfig {
  gemma4::Gemma4Config text;  // the drafter's own decoder stack (every layer KV-shared)
  int backbone_hidden_size = 0;
  bool use_ordered_embeddings = false;  // as the config says; the head is chosen by tensors
  int num_centroids = 0;
  int centroid_intermediate_top_k = 0;
};

// Parses `<dir>/config.json` of model_type gemma4_assistant; errors name the file and field.
AssistantConfig load_assistant_config(const std::string& path);

struct AssistantLayerWeights {
  Tensor input_layernorm, post_attention_layernorm;              // [Ha]
  Tensor pre_feedforward_layernorm, post_feedforward_layernorm;  // [Ha]
  Tensor q_proj;                                                 // [Nh·D, Ha]
  Tensor q_norm;                                                 // [D]
  Tensor o_proj;                                                 // [Ha, Nh·D]
  Tensor gate_proj, up_proj;                                     // [I, Ha]
  Tensor down_proj;                                              // [Ha, I]
  Tensor layer_scalar;                                           // [1]
};

struct AssistantWeights {
  Tensor pre_projection;   // [Ha, 2·Hb]
  Tensor post_projection;  // [Hb, Ha]
  Tensor embed_tokens;     // [V, Ha] (tied head)
  Tensor norm;             // [Ha]
  Tensor centroids;        // [G, Ha]   centroid head only
  Tensor token_ordering;   // i64 [V]   centroid head only
  std::vector<AssistantLayerWeights> layers;
};

// Inputs and outputs of one draft step for B rows.
struct DraftStepInputs {
  Tensor token_embeds;  // f32 [B, Hb]: the target's scaled embedding of each row's current token
  Tensor hidden;        // f32 [B, Hb]: target post-norm hidden (first step) or the last next_hidden
  Tensor positions;     // i32 [B]: the RoPE position of each row (constant within a round)
};
struct DraftStepOutputs {
  Tensor logits;  // f32 [B, V]: the proposal scores (centroid head: min − 1 outside the candidates)
  Tensor tokens;       // i32 [B]: argmax (lowest id on ties)
  Tensor next_hidden;  // f32 [B, Hb]
};

class AssistantDrafter {
 public:
  // Loads a gemma4_assistant checkpoint for `target`: rejects a drafter whose
  // attention geometry or sizes do not match the target's donor layers.
  static std::unique_ptr<AssistantDrafter> load(const std::string& path,
                                                const gemma4::Gemma4Config& target,
                                                Backend& backend);
  ~AssistantDrafter();

  const AssistantConfig& config() const { return config_; }
  bool centroid_head() const { return !weights_.centroids.empty(); }
  // "centroid head (G centroids, top-k)" or "tied dense head", for load logs.
  std::string head_description() const;

  // One draft step for B rows. Output views live in the drafter's scratch and
  // stay valid until the next step.
  DraftStepOutputs step(const DraftStepInputs& in, DonorAttention& donors);

 private:
  AssistantDrafter() = default;
  void centroid_logits(const Tensor& h, const Tensor& logits);

  AssistantConfig config_;
  std::unique_ptr<io::Checkpoint> checkpoint_;
  AssistantWeights weights_;
  std::vector<float> layer_scalars_;
  std::vector<int32_t> ordering_;  // token_ordering as i32 [G · V/G]
  Backend* backend_ = nullptr;
  HostTensor inv_freq_sliding_, inv_freq_full_;
  Arena arena_;
  // Centroid-head scratch, sized at load (steps allocate nothing).
  HostTensor centroid_scores_;           // f32 [B_max, G], regrown if a step has more rows
  HostTensor candidates_;                // i32 [K · V/G]
  HostTensor candidate_rows_;            // f32 [K · V/G, Ha]
  HostTensor candidate_scores_;          // f32 [1, K · V/G]
  std::vector<int32_t> centroid_order_;  // [G]
};

}  // namespace specula::assistant
