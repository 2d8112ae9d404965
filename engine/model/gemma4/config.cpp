// SPDX-License-Identifier: Apache-2.0
#include "engine/model/gemma4/config.h"

#include <algorithm>
#include <charconv>
#include <climits>
#include <cmath>
#include <filesystem>
#include <map>
#include <nlohmann/json.hpp>

#include "engine/core/error.h"
#include "engine/io/json_util.h"

namespace specula::gemma4 {
namespace {

using io::json_excerpt;
using io::json_type_name;
using nlohmann::json;

// Far above any released model, low enough that a hostile config cannot make
// us allocate per-layer tables of absurd size or overflow int products.
constexpr int kMaxLayers = 4096;
constexpr int64_t kMaxExtent = 1 << 24;
constexpr char kSliding[] = "sliding_attention";
constexpr char kFull[] = "full_attention";

const char* layer_type_name(LayerType t) {
  return t == LayerType::kSliding ? kSliding : kFull;
}

// HF's default: every sixth layer is full attention (5:1 pattern).
std::vector<LayerType> default_layer_types(int n_layers) {
  std::vector<LayerType> types(static_cast<size_t>(n_layers));
  for (int i = 0; i < n_layers; ++i) {
    types[static_cast<size_t>(i)] = (i + 1) % 6 == 0 ? LayerType::kFull : LayerType::kSliding;
  }
  return types;
}

// One JSON object of the config (the root or `text_config`), with the path
// used to name its fields in errors. Absent fields take the HF defaults.
class Reader {
 public:
  Reader(const json& obj, std::string origin, std::string prefix)
      : obj_(obj), origin_(std::move(origin)), prefix_(std::move(prefix)) {}

  // For the multimodal wrapper: these keys are read from the root object first
  // (that is where generation looks for token ids), then from `text_config`.
  void prefer_root(const json* root, std::vector<std::string> keys) {
    root_ = root;
    root_keys_ = std::move(keys);
  }

  struct Field {
    const json* value = nullptr;  // nullptr when absent
    std::string path;
  };

  Field find(const std::string& key) const {
    if (root_ != nullptr &&
        std::find(root_keys_.begin(), root_keys_.end(), key) != root_keys_.end()) {
      const auto it = root_->find(key);
      if (it != root_->end() && !it->is_null()) return {&*it, key};
    }
    const auto it = obj_.find(key);
    return {it == obj_.end() ? nullptr : &*it, prefix_ + key};
  }

  [[noreturn]] void bad(const Field& f, const std::string& what) const {
    fail("{}: {} {}, got {}", origin_, f.path, what, json_excerpt(*f.value));
  }

  int as_int(const Field& f) const {
    const json& v = *f.value;
    if (!v.is_number_integer()) bad(f, "must be an integer");
    if (v.is_number_unsigned() ? v.get<uint64_t>() > static_cast<uint64_t>(INT_MAX)
                               : (v.get<int64_t>() < INT_MIN || v.get<int64_t>() > INT_MAX)) {
      bad(f, "is out of range");
    }
    return v.get<int>();
  }
  double as_double(const Field& f) const {
    if (!f.value->is_number()) bad(f, "must be a number");
    return f.value->get<double>();
  }

  // Required-type getters: absent -> default, null -> error (HF has no None for these).
  int get_int(const std::string& key, int def) const {
    const Field f = find(key);
    if (f.value == nullptr) return def;
    return as_int(f);
  }
  double get_double(const std::string& key, double def) const {
    const Field f = find(key);
    if (f.value == nullptr) return def;
    return as_double(f);
  }
  bool get_bool(const std::string& key, bool def) const {
    const Field f = find(key);
    if (f.value == nullptr) return def;
    if (!f.value->is_boolean()) bad(f, "must be true or false");
    return f.value->get<bool>();
  }
  std::string get_string(const std::string& key, const std::string& def) const {
    const Field f = find(key);
    if (f.value == nullptr) return def;
    if (!f.value->is_string()) bad(f, "must be a string");
    return f.value->get<std::string>();
  }
  // Optional getters: absent or null -> nullopt (HF's None).
  std::optional<int> opt_int(const std::string& key) const {
    const Field f = find(key);
    if (f.value == nullptr || f.value->is_null()) return std::nullopt;
    return as_int(f);
  }
  std::optional<double> opt_double(const std::string& key) const {
    const Field f = find(key);
    if (f.value == nullptr || f.value->is_null()) return std::nullopt;
    return as_double(f);
  }

  const std::string& origin() const { return origin_; }
  const std::string& prefix() const { return prefix_; }

 private:
  const json& obj_;
  std::string origin_;
  std::string prefix_;
  const json* root_ = nullptr;
  std::vector<std::string> root_keys_;
};

RopeConfig parse_rope_entry(const Reader& r, const json& entry, const std::string& path,
                            RopeConfig defaults) {
  Reader e(entry, r.origin(), path + ".");
  RopeConfig rope;
  const std::string kind = e.get_string("rope_type", "default");
  if (kind == "default") {
    rope.kind = RopeConfig::Kind::kDefault;
  } else if (kind == "proportional") {
    rope.kind = RopeConfig::Kind::kProportional;
  } else {
    fail("{}: {}.rope_type '{}' is not supported (expected 'default' or 'proportional')",
         r.origin(), path, kind);
  }
  rope.theta = e.get_double("rope_theta", defaults.theta);
  // HF reads a missing partial_rotary_factor / factor as 1.0 (no default from the type).
  rope.partial_rotary_factor = e.get_double("partial_rotary_factor", 1.0);
  rope.factor = e.get_double("factor", 1.0);
  return rope;
}

void parse_rope(const Reader& r, Gemma4Config* cfg) {
  const Reader::Field f = r.find("rope_parameters");
  if (f.value == nullptr || f.value->is_null()) return;  // the struct holds HF's defaults
  if (!f.value->is_object()) r.bad(f, "must be an object keyed by layer type");
  for (const char* flat_key : {"rope_type", "rope_theta", "type"}) {
    if (f.value->contains(flat_key)) {
      fail(
          "{}: {} must be keyed by layer type ({{\"{}\": {{...}}, \"{}\": {{...}}}}), but has a "
          "top-level \"{}\"",
          r.origin(), f.path, kSliding, kFull, flat_key);
    }
  }
  const std::pair<const char*, RopeConfig*> types[] = {{kSliding, &cfg->rope_sliding},
                                                       {kFull, &cfg->rope_full}};
  for (const auto& [type, target] : types) {
    const auto it = f.value->find(type);
    if (it == f.value->end() || it->is_null()) continue;
    const std::string path = f.path + "." + type;
    if (!it->is_object())
      fail("{}: {} must be an object, got {}", r.origin(), path, json_excerpt(*it));
    *target = parse_rope_entry(r, *it, path, *target);
  }
}

void parse_layer_types(const Reader& r, Gemma4Config* cfg) {
  const Reader::Field f = r.find("layer_types");
  if (f.value == nullptr || f.value->is_null()) {
    cfg->layer_types = default_layer_types(cfg->num_hidden_layers);
    return;
  }
  if (!f.value->is_array()) r.bad(f, "must be a list of layer type names");
  if (f.value->size() != static_cast<size_t>(cfg->num_hidden_layers)) {
    fail("{}: {} has {} entries but num_hidden_layers is {}", r.origin(), f.path, f.value->size(),
         cfg->num_hidden_layers);
  }
  cfg->layer_types.clear();
  for (size_t i = 0; i < f.value->size(); ++i) {
    const json& v = (*f.value)[i];
    if (v == kSliding) {
      cfg->layer_types.push_back(LayerType::kSliding);
    } else if (v == kFull) {
      cfg->layer_types.push_back(LayerType::kFull);
    } else {
      fail("{}: {}[{}] is {}; expected \"{}\" or \"{}\"", r.origin(), f.path, i, json_excerpt(v),
           kSliding, kFull);
    }
  }
}

// The newer (transformers >= 5.15) per-layer overrides: {"<layer>": {"head_dim": Df,
// "num_key_value_heads": n}} for full layers. Folds them into the flat fields, which
// finalize() turns into per-layer specs; contradictions are errors.
void parse_per_layer_config(const Reader& r, std::optional<int> flat_global_head_dim,
                            Gemma4Config* cfg) {
  const Reader::Field f = r.find("per_layer_config");
  if (f.value == nullptr || f.value->is_null()) {
    cfg->global_head_dim = flat_global_head_dim.value_or(cfg->global_head_dim);
    return;
  }
  const int n_layers = cfg->num_hidden_layers;
  // Layer index -> override object. JSON keys are strings; a list indexed by layer also works.
  std::map<int, const json*> entries;
  if (f.value->is_object()) {
    for (const auto& [key, entry] : f.value->items()) {
      int index = -1;
      const auto [end, ec] = std::from_chars(key.data(), key.data() + key.size(), index);
      if (ec != std::errc() || end != key.data() + key.size() || index < 0 || index >= n_layers) {
        fail("{}: {} key \"{}\" is not a layer index in [0, {})", r.origin(), f.path, key,
             n_layers);
      }
      entries[index] = &entry;
    }
  } else if (f.value->is_array()) {
    if (f.value->size() > static_cast<size_t>(n_layers)) {
      fail("{}: {} has {} entries but num_hidden_layers is {}", r.origin(), f.path, f.value->size(),
           n_layers);
    }
    for (size_t i = 0; i < f.value->size(); ++i) {
      if (!(*f.value)[i].is_null()) entries[static_cast<int>(i)] = &(*f.value)[i];
    }
  } else {
    r.bad(f, "must be an object keyed by layer index");
  }

  // Value and the layer that set it, for the full-layer head_dim and KV heads.
  std::optional<std::pair<int, int>> full_head_dim, full_kv_heads;
  int n_full = 0, n_full_with_head_dim = 0, n_full_with_kv = 0;
  for (int i = 0; i < n_layers; ++i)
    n_full += cfg->layer_types[static_cast<size_t>(i)] == LayerType::kFull;
  for (const auto& [index, entry] : entries) {
    const std::string path = fmt::format("{}[\"{}\"]", f.path, index);
    if (!entry->is_object())
      fail("{}: {} must be an object, got {}", r.origin(), path, json_excerpt(*entry));
    const Reader e(*entry, r.origin(), path + ".");
    const std::optional<int> head_dim = e.opt_int("head_dim");
    const std::optional<int> kv_heads = e.opt_int("num_key_value_heads");
    const bool full = cfg->layer_types[static_cast<size_t>(index)] == LayerType::kFull;
    if (!full) {
      if (head_dim && *head_dim != cfg->head_dim) {
        fail("{}: {}.head_dim is {} but layer {} is a sliding layer, whose head_dim is {}",
             r.origin(), path, *head_dim, index, cfg->head_dim);
      }
      if (kv_heads && *kv_heads != cfg->num_key_value_heads) {
        fail(
            "{}: {}.num_key_value_heads is {} but layer {} is a sliding layer, which has "
            "num_key_value_heads {}",
            r.origin(), path, *kv_heads, index, cfg->num_key_value_heads);
      }
      continue;
    }
    if (head_dim) {
      ++n_full_with_head_dim;
      if (full_head_dim && full_head_dim->first != *head_dim) {
        fail("{}: {}.head_dim is {} but layer {} has head_dim {}; all full layers must agree",
             r.origin(), path, *head_dim, full_head_dim->second, full_head_dim->first);
      }
      full_head_dim = {*head_dim, index};
    }
    if (kv_heads) {
      ++n_full_with_kv;
      if (full_kv_heads && full_kv_heads->first != *kv_heads) {
        fail("{}: {}.num_key_value_heads is {} but layer {} has {}; all full layers must agree",
             r.origin(), path, *kv_heads, full_kv_heads->second, full_kv_heads->first);
      }
      full_kv_heads = {*kv_heads, index};
    }
  }
  if (n_full_with_head_dim != 0 && n_full_with_head_dim != n_full) {
    fail("{}: {} gives head_dim for {} of the {} full layers; give it for all or none", r.origin(),
         f.path, n_full_with_head_dim, n_full);
  }
  if (n_full_with_kv != 0 && n_full_with_kv != n_full) {
    fail("{}: {} gives num_key_value_heads for {} of the {} full layers; give it for all or none",
         r.origin(), f.path, n_full_with_kv, n_full);
  }
  if (full_head_dim) {
    if (flat_global_head_dim && *flat_global_head_dim != full_head_dim->first) {
      fail("{}: {}global_head_dim is {} but {} gives full layers head_dim {}", r.origin(),
           r.prefix(), *flat_global_head_dim, f.path, full_head_dim->first);
    }
    cfg->global_head_dim = full_head_dim->first;
  } else {
    // Without an override a layer keeps the base head_dim.
    cfg->global_head_dim = flat_global_head_dim.value_or(cfg->head_dim);
  }
  if (full_kv_heads) {
    if (cfg->attention_k_eq_v) {
      if (cfg->num_global_key_value_heads &&
          *cfg->num_global_key_value_heads != full_kv_heads->first) {
        fail(
            "{}: {}num_global_key_value_heads is {} but {} gives full layers num_key_value_heads "
            "{}",
            r.origin(), r.prefix(), *cfg->num_global_key_value_heads, f.path, full_kv_heads->first);
      }
      cfg->num_global_key_value_heads = full_kv_heads->first;
    } else if (full_kv_heads->first != cfg->num_key_value_heads) {
      fail(
          "{}: {}[\"{}\"].num_key_value_heads is {} but attention_k_eq_v is false, so full layers "
          "use num_key_value_heads {}",
          r.origin(), f.path, full_kv_heads->second, full_kv_heads->first,
          cfg->num_key_value_heads);
    }
  }
}

void parse_eos(const Reader& r, Gemma4Config* cfg) {
  const Reader::Field f = r.find("eos_token_id");
  if (f.value == nullptr || f.value->is_null()) return;
  cfg->eos_token_ids.clear();
  if (f.value->is_array()) {
    for (size_t i = 0; i < f.value->size(); ++i) {
      cfg->eos_token_ids.push_back(r.as_int({&(*f.value)[i], fmt::format("{}[{}]", f.path, i)}));
    }
  } else {
    cfg->eos_token_ids.push_back(r.as_int(f));
  }
}

// Picks the text-decoder object out of the config and records where it came from.
const json& select_text_config(const json& root, const std::string& origin, Gemma4Config* cfg,
                               std::string* prefix) {
  if (!root.is_object())
    fail("{}: config must be a JSON object, got {}", origin, json_type_name(root));
  const Reader top(root, origin, "");
  const std::string model_type = top.get_string("model_type", "");
  bool causal_lm = false;
  if (const auto it = root.find("architectures"); it != root.end() && !it->is_null()) {
    if (!it->is_array())
      fail("{}: architectures must be a list of strings, got {}", origin, json_excerpt(*it));
    for (const json& a : *it) {
      if (!a.is_string())
        fail("{}: architectures must be a list of strings, got {}", origin, json_excerpt(*it));
      causal_lm = causal_lm || a == "Gemma4ForCausalLM";
    }
  }
  if (model_type == "gemma4") {
    const auto it = root.find("text_config");
    if (it == root.end() || !it->is_object()) {
      fail("{}: model_type is 'gemma4' but there is no text_config object", origin);
    }
    cfg->source_kind = "gemma4";
    cfg->weight_prefix = "model.language_model.";
    *prefix = "text_config.";
    return *it;
  }
  if (causal_lm && (model_type.empty() || model_type == "gemma4_text")) {
    cfg->source_kind = "Gemma4ForCausalLM";
  } else if (model_type == "gemma4_text") {
    cfg->source_kind = "gemma4_text";
  } else {
    fail(
        "{}: not a Gemma 4 text config: model_type is '{}' (expected 'gemma4_text' or 'gemma4', or "
        "architectures naming Gemma4ForCausalLM)",
        origin, model_type);
  }
  cfg->weight_prefix = "model.";
  *prefix = "";
  return root;
}

void check_positive(const std::string& origin, const char* field, int64_t value) {
  if (value <= 0) fail("{}: {} must be positive, got {}", origin, field, value);
  if (value > kMaxExtent)
    fail("{}: {} = {} is implausibly large (limit {})", origin, field, value, kMaxExtent);
}

// Products the model computes in int (tensor widths) must fit in one.
void check_fits_int(const std::string& origin, const char* what, int64_t value) {
  if (value > INT_MAX) fail("{}: {} = {} does not fit in a 32-bit size", origin, what, value);
}

void check_token_id(const std::string& origin, const char* field, int id, int vocab) {
  if (id < 0 || id >= vocab)
    fail("{}: {} {} is outside the vocabulary [0, {})", origin, field, id, vocab);
}

void check_rope(const std::string& origin, const char* type, const RopeConfig& rope) {
  if (!(rope.theta > 0) || !std::isfinite(rope.theta)) {
    fail("{}: rope_parameters.{}.rope_theta must be positive, got {}", origin, type, rope.theta);
  }
  if (!(rope.partial_rotary_factor > 0 && rope.partial_rotary_factor <= 1)) {
    fail("{}: rope_parameters.{}.partial_rotary_factor must be in (0, 1], got {}", origin, type,
         rope.partial_rotary_factor);
  }
  if (!(rope.factor > 0) || !std::isfinite(rope.factor)) {
    fail("{}: rope_parameters.{}.factor must be positive, got {}", origin, type, rope.factor);
  }
}

}  // namespace

void Gemma4Config::finalize(const std::string& origin) {
  check_positive(origin, "vocab_size", vocab_size);
  check_positive(origin, "hidden_size", hidden_size);
  check_positive(origin, "intermediate_size", intermediate_size);
  check_positive(origin, "num_attention_heads", num_attention_heads);
  check_positive(origin, "num_key_value_heads", num_key_value_heads);
  check_positive(origin, "head_dim", head_dim);
  check_positive(origin, "global_head_dim", global_head_dim);
  check_positive(origin, "max_position_embeddings", max_position_embeddings);
  check_positive(origin, "sliding_window", sliding_window);
  if (num_hidden_layers <= 0 || num_hidden_layers > kMaxLayers) {
    fail("{}: num_hidden_layers must be in [1, {}], got {}", origin, kMaxLayers, num_hidden_layers);
  }
  // RoPE pairs dimension j with j + D/2.
  if (head_dim % 2 != 0)
    fail("{}: head_dim must be even (RoPE rotates pairs), got {}", origin, head_dim);
  if (global_head_dim % 2 != 0) {
    fail("{}: global_head_dim must be even (RoPE rotates pairs), got {}", origin, global_head_dim);
  }
  if (!(rms_norm_eps > 0) || !std::isfinite(rms_norm_eps)) {
    fail("{}: rms_norm_eps must be positive, got {}", origin, rms_norm_eps);
  }
  if (hidden_activation != "gelu_pytorch_tanh") {
    fail("{}: hidden_activation '{}' is not supported (Gemma 4 uses 'gelu_pytorch_tanh')", origin,
         hidden_activation);
  }
  if (hidden_size_per_layer_input < 0 || hidden_size_per_layer_input > kMaxExtent) {
    fail(
        "{}: hidden_size_per_layer_input must be in [0, {}] (0 disables per-layer embeddings), got "
        "{}",
        origin, kMaxExtent, hidden_size_per_layer_input);
  }
  if (has_ple()) check_positive(origin, "vocab_size_per_layer_input", vocab_size_per_layer_input);
  check_rope(origin, kSliding, rope_sliding);
  check_rope(origin, kFull, rope_full);
  if (final_logit_softcapping &&
      (!(*final_logit_softcapping > 0) || !std::isfinite(*final_logit_softcapping))) {
    fail("{}: final_logit_softcapping must be positive or null, got {}", origin,
         *final_logit_softcapping);
  }
  if (eos_token_ids.empty()) fail("{}: eos_token_id is an empty list", origin);
  for (int id : eos_token_ids) check_token_id(origin, "eos_token_id", id, vocab_size);
  check_token_id(origin, "bos_token_id", bos_token_id, vocab_size);
  check_token_id(origin, "pad_token_id", pad_token_id, vocab_size);

  if (num_attention_heads % num_key_value_heads != 0) {
    fail("{}: num_attention_heads ({}) must be a multiple of num_key_value_heads ({})", origin,
         num_attention_heads, num_key_value_heads);
  }
  if (attention_k_eq_v) {
    if (!num_global_key_value_heads) {
      fail(
          "{}: attention_k_eq_v is true but num_global_key_value_heads (the full layers' KV heads) "
          "is not set",
          origin);
    }
    check_positive(origin, "num_global_key_value_heads", *num_global_key_value_heads);
    if (num_attention_heads % *num_global_key_value_heads != 0) {
      fail("{}: num_attention_heads ({}) must be a multiple of num_global_key_value_heads ({})",
           origin, num_attention_heads, *num_global_key_value_heads);
    }
  }
  if (num_kv_shared_layers < 0 || num_kv_shared_layers > num_hidden_layers) {
    fail("{}: num_kv_shared_layers must be in [0, num_hidden_layers = {}], got {}", origin,
         num_hidden_layers, num_kv_shared_layers);
  }
  if (enable_moe_block) {
    if (num_experts <= 0 || top_k_experts <= 0 || moe_intermediate_size <= 0) {
      fail(
          "{}: enable_moe_block is true but num_experts ({}), top_k_experts ({}) and "
          "moe_intermediate_size ({}) are not all positive",
          origin, num_experts, top_k_experts, moe_intermediate_size);
    }
    check_positive(origin, "num_experts", num_experts);
    check_positive(origin, "moe_intermediate_size", moe_intermediate_size);
    if (top_k_experts > num_experts) {
      fail("{}: top_k_experts ({}) exceeds num_experts ({})", origin, top_k_experts, num_experts);
    }
    check_fits_int(origin, "2 * moe_intermediate_size", 2 * int64_t{moe_intermediate_size});
  }
  const int64_t max_head_dim = std::max(head_dim, global_head_dim);
  check_fits_int(origin, "num_attention_heads * head_dim", num_attention_heads * max_head_dim);
  check_fits_int(origin, "num_hidden_layers * hidden_size_per_layer_input",
                 int64_t{num_hidden_layers} * hidden_size_per_layer_input);
  check_fits_int(origin, "2 * intermediate_size", 2 * int64_t{intermediate_size});

  const int n_layers = num_hidden_layers;
  if (layer_types.empty()) layer_types = default_layer_types(n_layers);
  if (layer_types.size() != static_cast<size_t>(n_layers)) {
    fail("{}: layer_types has {} entries but num_hidden_layers is {}", origin, layer_types.size(),
         n_layers);
  }
  // HF forces the last layer to full attention (with a warning), default pattern or not.
  layer_types.back() = LayerType::kFull;

  first_shared_layer = n_layers - num_kv_shared_layers;
  sliding_donor = -1;
  full_donor = -1;
  for (int j = 0; j < first_shared_layer; ++j) {
    (layer_types[static_cast<size_t>(j)] == LayerType::kSliding ? sliding_donor : full_donor) = j;
  }
  layers.assign(static_cast<size_t>(n_layers), LayerSpec{});
  for (int i = 0; i < n_layers; ++i) {
    LayerSpec& s = layers[static_cast<size_t>(i)];
    s.type = layer_types[static_cast<size_t>(i)];
    const bool full = s.type == LayerType::kFull;
    s.head_dim = full ? global_head_dim : head_dim;
    s.k_eq_v = attention_k_eq_v && full;
    s.n_kv_heads = s.k_eq_v ? *num_global_key_value_heads : num_key_value_heads;
    s.kv_shared = i >= first_shared_layer;
    s.is_donor = i == sliding_donor || i == full_donor;
    if (!s.kv_shared) {
      s.kv_donor = i;
    } else {
      s.kv_donor = donor_of_type(s.type);
      // With every layer shared (the assistant drafter) K/V come from another model;
      // otherwise a shared layer needs an earlier layer of its type in this one.
      if (s.kv_donor < 0 && first_shared_layer > 0) {
        fail(
            "{}: layer {} ({}) is KV-shared but no layer before the first shared layer {} is of "
            "type {} to donate its K/V",
            origin, i, layer_type_name(s.type), first_shared_layer, layer_type_name(s.type));
      }
    }
    // HF widens only when some layers are not shared (layer >= first_shared > 0).
    const bool wide = use_double_wide_mlp && s.kv_shared && first_shared_layer > 0;
    s.intermediate_size = wide ? 2 * intermediate_size : intermediate_size;
  }
}

Gemma4Config parse_gemma4_config(const nlohmann::json& root, const std::string& origin) {
  Gemma4Config cfg;
  std::string prefix;
  const json& text = select_text_config(root, origin, &cfg, &prefix);
  Reader r(text, origin, prefix);
  if (!prefix.empty()) {
    const std::string inner_type = r.get_string("model_type", "gemma4_text");
    if (inner_type != "gemma4_text") {
      fail("{}: text_config.model_type is '{}', expected 'gemma4_text'", origin, inner_type);
    }
    r.prefer_root(&root, {"eos_token_id", "bos_token_id", "pad_token_id", "tie_word_embeddings"});
  }

  cfg.vocab_size = r.get_int("vocab_size", cfg.vocab_size);
  cfg.hidden_size = r.get_int("hidden_size", cfg.hidden_size);
  cfg.intermediate_size = r.get_int("intermediate_size", cfg.intermediate_size);
  // Required: an HF default layer count would only surface later as layer_types
  // or weight names that do not match the checkpoint.
  if (r.find("num_hidden_layers").value == nullptr) {
    fail("{}: {}num_hidden_layers is missing (the number of decoder layers)", origin, prefix);
  }
  cfg.num_hidden_layers = r.get_int("num_hidden_layers", cfg.num_hidden_layers);
  if (cfg.num_hidden_layers <= 0 || cfg.num_hidden_layers > kMaxLayers) {
    fail("{}: {}num_hidden_layers must be in [1, {}], got {}", origin, prefix, kMaxLayers,
         cfg.num_hidden_layers);
  }
  cfg.num_attention_heads = r.get_int("num_attention_heads", cfg.num_attention_heads);
  cfg.num_key_value_heads = r.get_int("num_key_value_heads", cfg.num_key_value_heads);
  cfg.head_dim = r.get_int("head_dim", cfg.head_dim);
  cfg.hidden_activation = r.get_string("hidden_activation", cfg.hidden_activation);
  cfg.max_position_embeddings = r.get_int("max_position_embeddings", cfg.max_position_embeddings);
  cfg.rms_norm_eps = r.get_double("rms_norm_eps", cfg.rms_norm_eps);
  cfg.pad_token_id = r.opt_int("pad_token_id").value_or(cfg.pad_token_id);
  cfg.bos_token_id = r.opt_int("bos_token_id").value_or(cfg.bos_token_id);
  parse_eos(r, &cfg);
  cfg.tie_word_embeddings = r.get_bool("tie_word_embeddings", cfg.tie_word_embeddings);
  cfg.attention_bias = r.get_bool("attention_bias", cfg.attention_bias);
  if (cfg.attention_bias) {
    fail("{}: {}attention_bias is true; Gemma 4 attention has no biases and this engine loads none",
         origin, prefix);
  }
  cfg.sliding_window = r.get_int("sliding_window", cfg.sliding_window);
  cfg.final_logit_softcapping = r.opt_double("final_logit_softcapping");
  {
    const Reader::Field f = r.find("use_bidirectional_attention");
    if (f.value != nullptr && !f.value->is_null() && *f.value != "vision") {
      // "vision" only affects image tokens; "all" makes the text model non-causal.
      r.bad(f, "is not supported (only null or \"vision\")");
    }
  }
  cfg.vocab_size_per_layer_input =
      r.get_int("vocab_size_per_layer_input", cfg.vocab_size_per_layer_input);
  cfg.hidden_size_per_layer_input =
      r.get_int("hidden_size_per_layer_input", cfg.hidden_size_per_layer_input);
  cfg.attention_k_eq_v = r.get_bool("attention_k_eq_v", cfg.attention_k_eq_v);
  cfg.num_kv_shared_layers = r.get_int("num_kv_shared_layers", cfg.num_kv_shared_layers);
  cfg.enable_moe_block = r.get_bool("enable_moe_block", cfg.enable_moe_block);
  cfg.use_double_wide_mlp = r.get_bool("use_double_wide_mlp", cfg.use_double_wide_mlp);
  cfg.num_experts = r.opt_int("num_experts").value_or(0);
  cfg.top_k_experts = r.opt_int("top_k_experts").value_or(0);
  cfg.moe_intermediate_size = r.opt_int("moe_intermediate_size").value_or(0);

  parse_rope(r, &cfg);
  parse_layer_types(r, &cfg);
  // HF forces the last layer to full before deriving the per-layer overrides.
  cfg.layer_types.back() = LayerType::kFull;
  // The flat KV override applies only with attention_k_eq_v (HF drops it otherwise).
  const std::optional<int> flat_global_kv = r.opt_int("num_global_key_value_heads");
  if (cfg.attention_k_eq_v) cfg.num_global_key_value_heads = flat_global_kv;
  parse_per_layer_config(r, r.opt_int("global_head_dim"), &cfg);

  cfg.finalize(prefix.empty() ? origin : origin + " (text_config)");
  return cfg;
}

Gemma4Config load_gemma4_config(const std::string& path) {
  std::error_code ec;
  const std::string file = std::filesystem::is_directory(path, ec)
                               ? (std::filesystem::path(path) / "config.json").string()
                               : path;
  return parse_gemma4_config(io::read_json_file(file), file);
}

}  // namespace specula::gemma4
