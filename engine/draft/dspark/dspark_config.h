// SPDX-License-Identifier: Apache-2.0
// The config of a DSpark block drafter (docs/dspark.md) in either layout:
// specula's own (`dspark.json`, variant "dspark") or DeepSpec's
// `save_pretrained` folder (`config.json`, architecture Gemma4DSparkModel).
// Parsing checks every field's type and names the file, field and value.
#pragma once

#include <nlohmann/json_fwd.hpp>

#include <cstdint>
#include <string>
#include <vector>

#include "engine/model/gemma4/config.h"

namespace specula::dspark {

enum class DSparkLayout { kSpecula, kDeepSpec };

// What a specula-layout checkpoint says about the target it was made for.
struct DSparkTargetId {
  int hidden_size = 0;
  int vocab_size = 0;
  int num_hidden_layers = 0;
  std::string config_hash;  // target_config_hash(); empty: not checked
};

struct DSparkConfig {
  DSparkLayout layout = DSparkLayout::kSpecula;
  int block_size = 5;            // γ
  int hidden_size = 1024;        // d (DeepSpec: the target's H)
  int num_layers = 5;            // draft layers
  int num_heads = 8;             // query heads
  int num_kv_heads = 8;          // specula layout: = num_heads (no GQA)
  int head_dim = 128;            // specula layout: d / num_heads
  int intermediate_size = 2048;  // F (specula: ffn_mult · d)
  int markov_rank = 256;         // r; 0 = no Markov head
  std::vector<int> taps;         // engine tap indices (Drafter::taps convention)
  double rms_norm_eps = 1e-6;
  bool confidence_head = true;         // specula layout: always
  bool confidence_with_markov = true;  // features [h ; e] (false: h only)

  // specula layout
  int ffn_mult = 2;
  DSparkTargetId target;
  std::vector<float> thresholds;  // calibration.thresholds (γ values) or empty
  // calibration.sts_temperatures (γ values > 0, the STS fit) or empty: the
  // verify scheduler reads σ(logit(c_k) / T_k); pruning ignores them.
  std::vector<float> sts_temperatures;
  double calibration_target = 0;
  int64_t calibration_samples = 0;

  // DeepSpec layout
  gemma4::Gemma4Config text;  // its Gemma 4 text fields (finalized)
  int mask_token_id = 0;
  bool k_eq_v = false;                // no v_proj: V derives from the raw K projection
  std::vector<int> target_layer_ids;  // as the file says (-1 = embeddings)
};

// File names of the two layouts inside a drafter folder.
inline constexpr const char* kSpeculaConfigFile = "dspark.json";
inline constexpr const char* kDeepSpecConfigFile = "config.json";

// Whether `dir` holds a DSpark drafter: a dspark.json (specula layout), or a
// config.json whose architectures name Gemma4DSparkModel (DeepSpec layout).
// An unreadable or malformed config.json is not DSpark (its own loader reports it).
bool is_dspark_dir(const std::string& dir);
// Reads `<dir>/dspark.json` (specula layout) or, when absent, `<dir>/config.json`
// (DeepSpec layout, architectures ["Gemma4DSparkModel"]).
DSparkConfig load_dspark_config(const std::string& dir);
// The same from parsed JSON; `file` names it in errors.
DSparkConfig parse_specula_dspark_config(const nlohmann::json& root, const std::string& file);
DSparkConfig parse_deepspec_dspark_config(const nlohmann::json& root, const std::string& file);
// The specula layout's dspark.json for `c` (save()), target fields included.
nlohmann::json specula_dspark_json(const DSparkConfig& c);

// The target's identity text (docs/dspark.md, "Checkpoints"): a fixed list
// of the fields a drafter's taps and head depend on, built from the parsed
// config so that any loader (and tools/golden/make_dspark_golden.py) rebuilds
// it: "gemma4-target-v1;hidden_size=…;…;final_logit_softcapping=30;layer_types=…".
std::string target_identity_text(const gemma4::Gemma4Config& target);
// sha256 (hex) of target_identity_text(): dspark.json's target.config_hash.
std::string target_config_hash(const gemma4::Gemma4Config& target);
// The target identity of `target` as a specula checkpoint records it.
DSparkTargetId target_id_of(const gemma4::Gemma4Config& target);

// Refuses a drafter made for another target, naming both (origin: the file or
// "random dspark drafter"): hidden size, vocabulary, layers, config hash
// (specula layout), tap range, and the DeepSpec layout's geometry (no MoE or
// per-layer inputs, only the vanilla Markov head).
void check_dspark_config(const DSparkConfig& c, const gemma4::Gemma4Config& target,
                         const std::string& origin);

// Seed defaults for `target` (docs/dspark.md): γ 5, d 1024, 5 layers, 8 heads,
// r 256, ffn_mult 2, taps {⌊L/2⌋, ⌊3L/4⌋, L−1, L}.
DSparkConfig default_specula_config(const gemma4::Gemma4Config& target);
// The released DeepSpec shape for `target`: γ 7, 5 layers, target geometry,
// r 256, vanilla Markov head, confidence head with Markov features, taps
// spread as DeepSpec's 12B config ([5, 17, 29, 41, 46] of 48 layers, scaled to L).
DSparkConfig default_deepspec_config(const gemma4::Gemma4Config& target);

}  // namespace specula::dspark
