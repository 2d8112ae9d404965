// SPDX-License-Identifier: Apache-2.0
// The Gemma 4 assistant (MTP) drafter (gemma4-architecture.md §10-11): a small
// decoder whose Q-only layers attend to the target's donor K/V, fed with
// [target scaled embedding of the last token ; target post-norm hidden], whose
// next hidden is post_projection of its normed state, with a centroid
// ("masked embedding") or a tied dense output head.
//
// Device-generic: weights, scratch and every tensor an op touches live on the
// Backend's device; host-side state (layer scalars, the token ordering) is read
// once at load.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "engine/core/buffer.h"
#include "engine/draft/assistant/assistant_config.h"
#include "engine/draft/donor_attention.h"
#include "engine/io/safetensors.h"
#include "engine/io/weight_table.h"
#include "engine/memory/arena.h"
#include "engine/memory/memory_resource.h"
#include "engine/model/gemma4/config.h"

namespace specula::assistant {

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
  // i64|i32 [V], centroid head only: read on the host at load (AssistantModel
  // keeps it as a host vector), then cleared so it is never placed on the device.
  Tensor token_ordering;
  std::vector<AssistantLayerWeights> layers;
};

// Inputs and outputs of one draft step for B rows, all on the drafter's device.
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

// The checkpoint names of the matrices an assistant checkpoint at `path` may
// store quantized (WeightTable::add_matrix: projections, MLP, embedding / tied
// head, centroids), for `specula quantize`. Reads its config.json and the
// checkpoint's tensor names (the head is chosen by which tensors exist).
std::vector<std::string> assistant_matrix_names(const std::string& path);

class AssistantModel {
 public:
  // Loads a gemma4_assistant checkpoint for `target`: rejects a drafter whose
  // attention geometry or sizes do not match the target's donor layers.
  // `scan_weights`: refuse NaN or infinite weights, naming the tensor (as
  // gemma4::LoadOptions::scan_weights).
  static std::unique_ptr<AssistantModel> load(const std::string& path,
                                              const gemma4::Gemma4Config& target, Backend& backend,
                                              bool scan_weights = true);
  // A drafter of `config` (text finalized, e.g. from assistant_config_for) for
  // `target` with seeded uniform bf16 weights on `backend` (see random_weights):
  // for benchmarks of released shapes without a checkpoint. A centroid head gets a
  // seeded permutation of the vocabulary as its token ordering. Geometry is
  // checked as load() checks it.
  // `weight_dtype` kI8 | kF8E4M3 quantizes the bf16 values' matrices
  // (gemma4::quantize_weights), for benchmarks of quantized drafters.
  static std::unique_ptr<AssistantModel> random(const AssistantConfig& config,
                                                const gemma4::Gemma4Config& target,
                                                Backend& backend, uint64_t seed, bool centroid_head,
                                                DType weight_dtype = DType::kBF16);
  ~AssistantModel();

  const AssistantConfig& config() const { return config_; }
  bool centroid_head() const { return !weights_.centroids.empty(); }
  Backend& backend() const { return *backend_; }
  // "centroid head (G centroids, top-k)" or "tied dense head", for load logs.
  std::string head_description() const;

  // One draft step for B rows. Output views live in the drafter's device scratch
  // and stay valid until the next step. Steps allocate nothing unless B exceeds
  // every earlier step's (scratch grows, never shrinks).
  DraftStepOutputs step(const DraftStepInputs& in, DonorAttention& donors);
  // Start of the step scratch (moves only when a step needs more than any before).
  const void* arena_base() const { return arena_.base(); }

 private:
  AssistantModel() = default;
  // Shared by load() and random() once the weights are on the device: host copies
  // of the layer scalars, device RoPE tables, backend scratch and centroid staging.
  void init_after_weights();
  struct CentroidScratch;
  void centroid_logits(const Tensor& h, const CentroidScratch& s, const Tensor& logits);

  AssistantConfig config_;
  std::unique_ptr<io::Checkpoint> checkpoint_;  // null for random()
  AssistantWeights weights_;
  DeviceBuffer weight_buffer_;  // device copies of the weights (empty for a checkpoint on the CPU)
  std::vector<float> layer_scalars_;  // host copies of layers.*.layer_scalar
  std::vector<int32_t> ordering_;     // token_ordering as i32 [G · V/G], on the host
  Backend* backend_ = nullptr;
  DeviceBuffer inv_freq_buffer_;
  Tensor inv_freq_sliding_, inv_freq_full_;  // f32 [Ds/2], [Df/2] on the device
  Arena arena_;                              // device scratch of one step, sized by a dry run
  // Centroid head: the token ordering on the device, i32 [G, V/G].
  DeviceBuffer ordering_buffer_;
  Tensor ordering_device_;
};

}  // namespace specula::assistant
