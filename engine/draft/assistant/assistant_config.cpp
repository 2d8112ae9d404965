// SPDX-License-Identifier: Apache-2.0
#include "engine/draft/assistant/assistant_config.h"

#include <climits>
#include <filesystem>

#include "engine/core/error.h"
#include "engine/io/json_util.h"

namespace specula::assistant {
namespace {

const char* type_name(gemma4::LayerType t) {
  return t == gemma4::LayerType::kSliding ? "sliding_attention" : "full_attention";
}

}  // namespace

std::string assistant_config_path(const std::string& path) {
  return std::filesystem::is_directory(path) ? path + "/config.json" : path;
}

// HF's validate_architecture (§10.1): the drafter's own stack has no PLE, MoE or
// double-wide MLP, and every layer is KV-shared. Errors start with `origin`.
void check_assistant_text(const AssistantConfig& c, const std::string& origin) {
  const gemma4::Gemma4Config& t = c.text;
  if (t.hidden_size_per_layer_input != 0) {
    fail("{}: text_config.hidden_size_per_layer_input must be 0 for an assistant drafter, got {}",
         origin, t.hidden_size_per_layer_input);
  }
  if (t.enable_moe_block)
    fail("{}: text_config.enable_moe_block must be false for an assistant drafter", origin);
  if (t.use_double_wide_mlp)
    fail("{}: text_config.use_double_wide_mlp must be false for an assistant drafter", origin);
  if (t.num_kv_shared_layers != t.num_hidden_layers) {
    fail(
        "{}: text_config.num_kv_shared_layers ({}) must equal num_hidden_layers ({}) for an "
        "assistant drafter",
        origin, t.num_kv_shared_layers, t.num_hidden_layers);
  }
  if (c.backbone_hidden_size <= 0)
    fail("{}: backbone_hidden_size must be positive, got {}", origin, c.backbone_hidden_size);
}

// The drafter reads the target's donor K/V and emits target tokens: its
// geometry must mirror the target's donor layers.
void check_against_target(const AssistantConfig& c, const gemma4::Gemma4Config& target,
                          const std::string& origin) {
  const gemma4::Gemma4Config& t = c.text;
  if (c.backbone_hidden_size != target.hidden_size) {
    fail("{}: backbone_hidden_size {} does not match the target's hidden_size {}", origin,
         c.backbone_hidden_size, target.hidden_size);
  }
  if (t.vocab_size != target.vocab_size) {
    fail("{}: vocab_size {} does not match the target's vocab_size {}", origin, t.vocab_size,
         target.vocab_size);
  }
  if (t.layers.size() != static_cast<size_t>(t.num_hidden_layers)) {
    fail("{}: the drafter's text config is not finalized ({} layer specs for {} layers)", origin,
         t.layers.size(), t.num_hidden_layers);
  }
  for (int i = 0; i < t.num_hidden_layers; ++i) {
    const gemma4::LayerSpec& mine = t.layers[static_cast<size_t>(i)];
    const int donor = target.donor_of_type(mine.type);
    if (donor < 0) {
      fail("{}: drafter layer {} attends to {} K/V but the target has no such donor layer", origin,
           i, type_name(mine.type));
    }
    const gemma4::LayerSpec& theirs = target.layers[static_cast<size_t>(donor)];
    if (mine.head_dim != theirs.head_dim || mine.n_kv_heads != theirs.n_kv_heads) {
      fail(
          "{}: drafter layer {} ({}) expects head_dim {} with {} KV heads, but the target's donor "
          "layer {} has "
          "head_dim {} with {} KV heads",
          origin, i, type_name(mine.type), mine.head_dim, mine.n_kv_heads, donor, theirs.head_dim,
          theirs.n_kv_heads);
    }
    if (t.num_attention_heads % theirs.n_kv_heads != 0) {
      fail("{}: drafter num_attention_heads {} is not a multiple of the target's {} KV heads",
           origin, t.num_attention_heads, theirs.n_kv_heads);
    }
  }
}

void check_centroids(const AssistantConfig& c, const std::string& origin) {
  const int V = c.text.vocab_size;
  if (c.num_centroids <= 0 || V % c.num_centroids != 0) {
    fail("{}: vocab_size {} is not divisible by num_centroids {}", origin, V, c.num_centroids);
  }
  if (c.centroid_intermediate_top_k <= 0 || c.centroid_intermediate_top_k > c.num_centroids) {
    fail("{}: centroid_intermediate_top_k {} must be in [1, num_centroids={}]", origin,
         c.centroid_intermediate_top_k, c.num_centroids);
  }
}

AssistantConfig load_assistant_config(const std::string& path) {
  const std::string file = assistant_config_path(path);
  return parse_assistant_config(io::read_json_file(file), file);
}

AssistantConfig parse_assistant_config(const nlohmann::json& root, const std::string& file) {
  if (!root.is_object()) fail("{}: expected a JSON object", file);
  // Root fields of a wrong type name the file, the field and the value (as the
  // target's config does), never the JSON library's type error.
  auto bad = [&](const std::string& field, const char* what, const nlohmann::json& value) {
    fail("{}: {} {}, got {}", file, field, what, io::json_excerpt(value));
  };
  const auto type_it = root.find("model_type");
  if (type_it != root.end() && !type_it->is_string())
    bad("model_type", "must be a string", *type_it);
  const std::string model_type = type_it == root.end() ? "" : type_it->get<std::string>();
  if (model_type != "gemma4_assistant") {
    fail("{}: model_type is '{}', expected 'gemma4_assistant' (a Gemma 4 assistant drafter)", file,
         model_type);
  }
  if (!root.contains("text_config") || !root["text_config"].is_object()) {
    fail("{}: field 'text_config' is missing or not an object", file);
  }
  nlohmann::json text = root["text_config"];
  if (!text.contains("model_type")) text["model_type"] = "gemma4_text";
  // HF's Gemma4AssistantConfig.__post_init__: every drafter layer is KV-shared.
  // Values of a wrong type are left for parse_gemma4_config to report.
  const auto shared = text.find("num_kv_shared_layers");
  const bool shared_unset =
      shared == text.end() || shared->is_null() || (shared->is_number_integer() && *shared == 0);
  const auto layers = text.find("num_hidden_layers");
  if (shared_unset) {
    text["num_kv_shared_layers"] =
        layers != text.end() && layers->is_number_integer() ? *layers : nlohmann::json(0);
  }

  AssistantConfig c;
  c.text = gemma4::parse_gemma4_config(text, file + " (text_config)");
  auto get_int = [&](const char* field, int fallback) {
    if (!root.contains(field) || root[field].is_null()) return fallback;
    const nlohmann::json& v = root[field];
    if (!v.is_number_integer()) bad(field, "must be an integer", v);
    if (v.is_number_unsigned() ? v.get<uint64_t>() > uint64_t{INT_MAX}
                               : (v.get<int64_t>() < INT_MIN || v.get<int64_t>() > INT_MAX)) {
      bad(field, "is out of range", v);
    }
    return v.get<int>();
  };
  c.backbone_hidden_size = get_int("backbone_hidden_size", 1536);
  const auto ordered = root.find("use_ordered_embeddings");
  if (ordered != root.end() && !ordered->is_null() && !ordered->is_boolean()) {
    bad("use_ordered_embeddings", "must be true or false", *ordered);
  }
  c.use_ordered_embeddings = ordered != root.end() && ordered->is_boolean() && ordered->get<bool>();
  c.num_centroids = get_int("num_centroids", 2048);
  c.centroid_intermediate_top_k = get_int("centroid_intermediate_top_k", 32);
  check_assistant_text(c, file);
  return c;
}

AssistantConfig assistant_config_for(const gemma4::Gemma4Config& target, int num_layers) {
  const std::string origin = "assistant_config_for";
  if (num_layers <= 0) fail("{}: num_layers must be positive, got {}", origin, num_layers);
  // E2B/E4B (per-layer embeddings) ship the small centroid-head drafter; 26B/31B the wide
  // dense-head one (§10.1, "Known drafter configs").
  const bool small = target.has_ple();
  AssistantConfig c;
  c.backbone_hidden_size = target.hidden_size;
  c.use_ordered_embeddings = small;
  c.num_centroids = 2048;
  c.centroid_intermediate_top_k = 32;

  gemma4::Gemma4Config& t = c.text;
  t.source_kind = "gemma4_text";
  t.weight_prefix = "model.";
  t.vocab_size = target.vocab_size;
  t.hidden_size = small ? 256 : 1024;
  t.intermediate_size = small ? 2048 : 8192;
  t.num_hidden_layers = num_layers;
  // Attention mirrors the donors: same head dims, KV heads (k_eq_v included), RoPE, window.
  t.num_key_value_heads = target.num_key_value_heads;
  t.num_global_key_value_heads = target.num_global_key_value_heads;
  t.attention_k_eq_v = target.attention_k_eq_v;
  t.head_dim = target.head_dim;
  t.global_head_dim = target.global_head_dim;
  t.rope_sliding = target.rope_sliding;
  t.rope_full = target.rope_full;
  t.sliding_window = target.sliding_window;
  // The small drafters use 4 query heads; keep the target's count where 4 cannot
  // group over the donors' KV heads (the target's count always can).
  int heads = small ? 4 : target.num_attention_heads;
  for (const int donor : {target.sliding_donor, target.full_donor}) {
    if (donor >= 0 && heads % target.layers[static_cast<size_t>(donor)].n_kv_heads != 0)
      heads = target.num_attention_heads;
  }
  t.num_attention_heads = heads;
  t.max_position_embeddings = target.max_position_embeddings;
  t.rms_norm_eps = target.rms_norm_eps;
  t.pad_token_id = target.pad_token_id;
  t.eos_token_ids = target.eos_token_ids;
  t.bos_token_id = target.bos_token_id;
  t.tie_word_embeddings = true;
  t.final_logit_softcapping.reset();  // never applied by the drafter
  t.vocab_size_per_layer_input = 0;
  t.hidden_size_per_layer_input = 0;
  t.num_kv_shared_layers = num_layers;
  t.enable_moe_block = false;
  t.use_double_wide_mlp = false;
  t.layer_types.assign(static_cast<size_t>(num_layers), gemma4::LayerType::kSliding);
  t.layer_types.back() = gemma4::LayerType::kFull;
  t.finalize(origin);

  check_assistant_text(c, origin);
  check_against_target(c, target, origin);
  return c;
}

}  // namespace specula::assistant
