// SPDX-License-Identifier: Apache-2.0
// The config of a Gemma 4 assistant (MTP) drafter (gemma4-architecture.md §10.1):
// parsing its config.json and checking it against the target. Needs only the
// Gemma 4 config parser, so the fuzz target links it without the model.
#pragma once

#include <nlohmann/json_fwd.hpp>
#include <string>

#include "engine/model/gemma4/config.h"

namespace specula::assistant {

struct AssistantConfig {
  gemma4::Gemma4Config text;  // the drafter's own decoder stack (every layer KV-shared)
  int backbone_hidden_size = 0;
  bool use_ordered_embeddings = false;  // as the config says; the head is chosen by tensors
  int num_centroids = 0;
  int centroid_intermediate_top_k = 0;
};

// `path` itself, or `<path>/config.json` when `path` is a directory.
std::string assistant_config_path(const std::string& path);

// Parses `<dir>/config.json` of model_type gemma4_assistant; errors name the file and field.
AssistantConfig load_assistant_config(const std::string& path);
// The same from parsed JSON; `file` names it in errors.
AssistantConfig parse_assistant_config(const nlohmann::json& root, const std::string& file);

// The config of a drafter of the released shape for `target` (gemma4-architecture.md
// §10.1), for benchmarks without a checkpoint. Targets with per-layer embeddings
// (E2B/E4B class) get the small drafter: hidden 256, MLP 2048, 4 query heads and
// a centroid head (2048 centroids, top-32); the others (26B/31B class) get hidden
// 1024, MLP 8192, the target's query heads and a dense head. Attention geometry,
// RoPE, sliding window, vocabulary and token ids mirror the target; the layers are
// (num_layers - 1) sliding then one full, all KV-shared. Validated as load() does.
AssistantConfig assistant_config_for(const gemma4::Gemma4Config& target, int num_layers = 4);

// HF's validate_architecture (§10.1): the drafter's own stack has no PLE, MoE or
// double-wide MLP, every layer is KV-shared, backbone_hidden_size is positive.
// Errors start with `origin`. parse_assistant_config runs it.
void check_assistant_text(const AssistantConfig& c, const std::string& origin);
// The drafter reads the target's donor K/V and emits target tokens: its
// geometry (finalized text config) must mirror the target's donor layers.
void check_against_target(const AssistantConfig& c, const gemma4::Gemma4Config& target,
                          const std::string& origin);
// A centroid head: vocab_size divisible by num_centroids, top-k in [1, num_centroids].
void check_centroids(const AssistantConfig& c, const std::string& origin);

}  // namespace specula::assistant
