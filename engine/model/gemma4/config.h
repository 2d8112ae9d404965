// SPDX-License-Identifier: Apache-2.0
// Gemma4TextConfig: the typed hyper-parameters of a Gemma 4 text decoder,
// parsed from a Hugging Face config.json of model_type `gemma4_text`,
// `gemma4` (the text part, `text_config`) or architecture `Gemma4ForCausalLM`,
// in both the flat form (`global_head_dim`, `num_global_key_value_heads`) and
// the newer `per_layer_config` form. Derived per-layer quantities are
// precomputed by `finalize()` so the forward pass never re-derives them.
#pragma once

#include <nlohmann/json_fwd.hpp>

#include <optional>
#include <string>
#include <vector>

namespace specula::gemma4 {

enum class LayerType { kSliding, kFull };

struct RopeConfig {
  enum class Kind { kDefault, kProportional } kind = Kind::kDefault;
  double theta = 10000.0;
  double partial_rotary_factor = 1.0;  // proportional only
  double factor = 1.0;                 // proportional only: inv_freq is divided by it
};

// Per-layer geometry derived from the config (see gemma4-architecture.md §1, §5).
struct LayerSpec {
  LayerType type = LayerType::kSliding;
  int head_dim = 0;        // Ds for sliding layers, Df for full layers
  int n_kv_heads = 0;      // num_global_key_value_heads on k_eq_v full layers
  bool k_eq_v = false;     // full layer without v_proj: V derives from the K projection
  bool kv_shared = false;  // reads the donor's K/V instead of projecting its own
  int kv_donor = -1;       // for shared layers: index of the donor layer; else the layer itself.
                           // -1 when every layer is shared (assistant drafter): K/V come from
                           // another model.
  bool is_donor = false;   // last non-shared layer of its type (feeds shared layers and drafters)
  int intermediate_size = 0;  // doubled on shared layers when use_double_wide_mlp
};

struct Gemma4Config {
  // Where the config came from: "gemma4_text", "gemma4" or "Gemma4ForCausalLM".
  std::string source_kind;
  // Tensor-name prefix of the text model in the checkpoint: "model.language_model." for
  // the multimodal wrapper, "model." for Gemma4ForCausalLM and plain gemma4_text checkpoints.
  std::string weight_prefix = "model.";

  int vocab_size = 262144;
  int hidden_size = 2304;
  int intermediate_size = 9216;
  int num_hidden_layers = 30;
  int num_attention_heads = 8;
  int num_key_value_heads = 4;
  int head_dim = 256;
  int global_head_dim = 512;
  std::optional<int> num_global_key_value_heads;
  std::string hidden_activation = "gelu_pytorch_tanh";
  int max_position_embeddings = 131072;
  double rms_norm_eps = 1e-6;
  int pad_token_id = 0;
  std::vector<int> eos_token_ids = {1};
  int bos_token_id = 2;
  bool tie_word_embeddings = true;
  RopeConfig rope_sliding{RopeConfig::Kind::kDefault, 10000.0, 1.0, 1.0};
  RopeConfig rope_full{RopeConfig::Kind::kProportional, 1000000.0, 0.25, 1.0};
  bool attention_bias = false;
  int sliding_window = 512;
  std::vector<LayerType> layer_types;  // empty: HF's default 5:1 pattern; last layer forced full
  std::optional<double> final_logit_softcapping;
  int vocab_size_per_layer_input = 262144;
  int hidden_size_per_layer_input = 256;  // 0 disables per-layer embeddings
  bool attention_k_eq_v = false;
  int num_kv_shared_layers = 0;
  bool enable_moe_block = false;
  bool use_double_wide_mlp = false;
  int num_experts = 0;
  int top_k_experts = 0;
  int moe_intermediate_size = 0;

  // Filled by finalize().
  std::vector<LayerSpec> layers;
  int first_shared_layer = 0;  // L - num_kv_shared_layers
  int sliding_donor = -1;      // last non-shared sliding layer (-1 if none)
  int full_donor = -1;         // last non-shared full layer (-1 if none)

  // Validates the fields and derives `layers` and the donors. Throws an Error
  // naming `origin` (the config file) and the offending field and value. Usable
  // on a hand-built config (tests, goldens) as well as a parsed one.
  void finalize(const std::string& origin);
  bool has_ple() const { return hidden_size_per_layer_input > 0; }
  int donor_of_type(LayerType t) const {
    return t == LayerType::kSliding ? sliding_donor : full_donor;
  }
};

// Parses the text-decoder config out of a config.json object. `origin` names
// the file in errors. The result is finalized.
Gemma4Config parse_gemma4_config(const nlohmann::json& root, const std::string& origin);
// Reads `<dir>/config.json` (or the file itself if `path` is a file).
Gemma4Config load_gemma4_config(const std::string& path);

}  // namespace specula::gemma4
