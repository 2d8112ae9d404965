// SPDX-License-Identifier: Apache-2.0
#include "engine/model/gemma4/presets.h"

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <nlohmann/json.hpp>

#include "engine/core/error.h"

namespace specula::gemma4 {
namespace {

using nlohmann::json;

constexpr char kSliding[] = "sliding_attention";
constexpr char kFull[] = "full_attention";

// The shape of one released model (gemma4-architecture.md §8) and of its
// assistant drafter (§10.1). Fields not listed take the Gemma 4 defaults.
struct Preset {
  const char* name;
  int hidden_size;
  int intermediate_size;  // the dense MLP (the always-on branch of the MoE model)
  int num_hidden_layers;
  int period;  // layer_types: (period - 1) sliding layers then one full layer, repeated
  int num_attention_heads;
  int num_key_value_heads;         // sliding layers (and full layers without k_eq_v)
  int num_global_key_value_heads;  // full layers with attention_k_eq_v; 0 = not k_eq_v
  int hidden_size_per_layer_input;
  int num_kv_shared_layers;
  bool use_double_wide_mlp;
  int num_experts;  // 0: no MoE block
  int top_k_experts;
  int moe_intermediate_size;
  int sliding_window;
  int max_position_embeddings;
  bool vision_bidirectional;  // use_bidirectional_attention "vision" (large models)
  // The drafter: hidden, intermediate, heads, KV heads of its sliding layers, centroid head.
  int assistant_hidden;
  int assistant_intermediate;
  int assistant_heads;
  int assistant_kv_heads;
  bool assistant_centroids;
};

constexpr Preset kPresets[] = {
    {.name = "e2b",
     .hidden_size = 1536,
     .intermediate_size = 6144,
     .num_hidden_layers = 35,
     .period = 5,
     .num_attention_heads = 8,
     .num_key_value_heads = 1,
     .num_global_key_value_heads = 0,
     .hidden_size_per_layer_input = 256,
     .num_kv_shared_layers = 20,
     .use_double_wide_mlp = true,
     .num_experts = 0,
     .top_k_experts = 0,
     .moe_intermediate_size = 0,
     .sliding_window = 512,
     .max_position_embeddings = 131072,
     .vision_bidirectional = false,
     .assistant_hidden = 256,
     .assistant_intermediate = 2048,
     .assistant_heads = 4,
     .assistant_kv_heads = 1,
     .assistant_centroids = true},
    {.name = "e4b",
     .hidden_size = 2560,
     .intermediate_size = 10240,
     .num_hidden_layers = 42,
     .period = 6,
     .num_attention_heads = 8,
     .num_key_value_heads = 2,
     .num_global_key_value_heads = 0,
     .hidden_size_per_layer_input = 256,
     .num_kv_shared_layers = 18,
     .use_double_wide_mlp = false,
     .num_experts = 0,
     .top_k_experts = 0,
     .moe_intermediate_size = 0,
     .sliding_window = 512,
     .max_position_embeddings = 131072,
     .vision_bidirectional = false,
     .assistant_hidden = 256,
     .assistant_intermediate = 2048,
     .assistant_heads = 4,
     .assistant_kv_heads = 2,
     .assistant_centroids = true},
    // The 31B drafter's sliding_window is not confirmed (§14); it takes the target's.
    {.name = "31b",
     .hidden_size = 5376,
     .intermediate_size = 21504,
     .num_hidden_layers = 60,
     .period = 6,
     .num_attention_heads = 32,
     .num_key_value_heads = 16,
     .num_global_key_value_heads = 4,
     .hidden_size_per_layer_input = 0,
     .num_kv_shared_layers = 0,
     .use_double_wide_mlp = false,
     .num_experts = 0,
     .top_k_experts = 0,
     .moe_intermediate_size = 0,
     .sliding_window = 1024,
     .max_position_embeddings = 262144,
     .vision_bidirectional = true,
     .assistant_hidden = 1024,
     .assistant_intermediate = 8192,
     .assistant_heads = 32,
     .assistant_kv_heads = 16,
     .assistant_centroids = false},
    {.name = "26b-a4b",
     .hidden_size = 2816,
     .intermediate_size = 2112,
     .num_hidden_layers = 30,
     .period = 6,
     .num_attention_heads = 16,
     .num_key_value_heads = 8,
     .num_global_key_value_heads = 2,
     .hidden_size_per_layer_input = 0,
     .num_kv_shared_layers = 0,
     .use_double_wide_mlp = false,
     .num_experts = 128,
     .top_k_experts = 8,
     .moe_intermediate_size = 704,
     .sliding_window = 1024,
     .max_position_embeddings = 262144,
     .vision_bidirectional = true,
     .assistant_hidden = 1024,
     .assistant_intermediate = 8192,
     .assistant_heads = 16,
     .assistant_kv_heads = 8,
     .assistant_centroids = false},
};

const Preset& find_preset(std::string_view name) {
  for (const Preset& p : kPresets) {
    if (name == p.name) return p;
  }
  fail("unknown model preset '{}' (valid presets: {})", name,
       fmt::join(gemma4_preset_names(), ", "));
}

json rope_parameters() {
  return {{kSliding, {{"rope_type", "default"}, {"rope_theta", 10000.0}}},
          {kFull,
           {{"rope_type", "proportional"},
            {"partial_rotary_factor", 0.25},
            {"rope_theta", 1000000.0}}}};
}

json layer_types(int layers, int period) {
  json types = json::array();
  for (int i = 0; i < layers; ++i) types.push_back((i + 1) % period == 0 ? kFull : kSliding);
  return types;
}

// The fields every Gemma 4 text config of a released shape carries.
json common_text_fields() {
  return {{"vocab_size", 262144},
          {"head_dim", 256},
          {"global_head_dim", 512},
          {"hidden_activation", "gelu_pytorch_tanh"},
          {"rms_norm_eps", 1e-6},
          {"pad_token_id", 0},
          {"eos_token_id", json::array({1, 106})},
          {"bos_token_id", 2},
          {"tie_word_embeddings", true},
          {"attention_bias", false},
          {"rope_parameters", rope_parameters()}};
}

}  // namespace

std::vector<std::string> gemma4_preset_names() {
  std::vector<std::string> names;
  for (const Preset& p : kPresets) names.emplace_back(p.name);
  return names;
}

json gemma4_preset_json(std::string_view name) {
  const Preset& p = find_preset(name);
  const bool k_eq_v = p.num_global_key_value_heads > 0;
  const bool moe = p.num_experts > 0;
  json c = common_text_fields();
  c.update(
      {{"model_type", "gemma4_text"},
       {"architectures", json::array({"Gemma4ForCausalLM"})},
       {"hidden_size", p.hidden_size},
       {"intermediate_size", p.intermediate_size},
       {"num_hidden_layers", p.num_hidden_layers},
       {"layer_types", layer_types(p.num_hidden_layers, p.period)},
       {"num_attention_heads", p.num_attention_heads},
       {"num_key_value_heads", p.num_key_value_heads},
       {"num_global_key_value_heads", k_eq_v ? json(p.num_global_key_value_heads) : json(nullptr)},
       {"attention_k_eq_v", k_eq_v},
       {"hidden_size_per_layer_input", p.hidden_size_per_layer_input},
       {"vocab_size_per_layer_input", 262144},
       {"num_kv_shared_layers", p.num_kv_shared_layers},
       {"use_double_wide_mlp", p.use_double_wide_mlp},
       {"enable_moe_block", moe},
       {"num_experts", moe ? json(p.num_experts) : json(nullptr)},
       {"top_k_experts", moe ? json(p.top_k_experts) : json(nullptr)},
       {"moe_intermediate_size", moe ? json(p.moe_intermediate_size) : json(nullptr)},
       {"sliding_window", p.sliding_window},
       {"max_position_embeddings", p.max_position_embeddings},
       {"final_logit_softcapping", 30.0},
       {"use_bidirectional_attention", p.vision_bidirectional ? json("vision") : json(nullptr)},
       {"torch_dtype", "bfloat16"}});
  return c;
}

Gemma4Config gemma4_preset(std::string_view name) {
  return parse_gemma4_config(gemma4_preset_json(name), fmt::format("preset:{}", name));
}

json gemma4_assistant_preset_json(std::string_view name) {
  const Preset& p = find_preset(name);
  const bool k_eq_v = p.num_global_key_value_heads > 0;
  constexpr int kLayers = 4;  // [S, S, S, F]
  json text = common_text_fields();
  text.update(
      {{"model_type", "gemma4_text"},
       {"hidden_size", p.assistant_hidden},
       {"intermediate_size", p.assistant_intermediate},
       {"num_hidden_layers", kLayers},
       {"layer_types", layer_types(kLayers, kLayers)},
       {"num_attention_heads", p.assistant_heads},
       {"num_key_value_heads", p.assistant_kv_heads},
       {"num_global_key_value_heads", k_eq_v ? json(p.num_global_key_value_heads) : json(nullptr)},
       {"attention_k_eq_v", k_eq_v},
       {"hidden_size_per_layer_input", 0},
       {"vocab_size_per_layer_input", 0},
       {"num_kv_shared_layers", kLayers},
       {"use_double_wide_mlp", false},
       {"enable_moe_block", false},
       {"sliding_window", p.sliding_window},
       {"max_position_embeddings", p.max_position_embeddings},
       {"final_logit_softcapping", nullptr}});
  return {{"model_type", "gemma4_assistant"},
          {"architectures", json::array({"Gemma4AssistantForCausalLM"})},
          {"backbone_hidden_size", p.hidden_size},
          {"use_ordered_embeddings", p.assistant_centroids},
          {"num_centroids", 2048},
          {"centroid_intermediate_top_k", 32},
          {"tie_word_embeddings", true},
          {"text_config", text},
          {"torch_dtype", "bfloat16"}};
}

}  // namespace specula::gemma4
