// SPDX-License-Identifier: Apache-2.0
#include "engine/draft/dspark/dspark_config.h"

#include <algorithm>
#include <climits>
#include <cmath>
#include <filesystem>
#include <fstream>

#include "engine/chat/sha256.h"
#include "engine/core/error.h"
#include "engine/io/json_util.h"

namespace specula::dspark {
namespace {

using nlohmann::json;

// Typed field reads of one JSON object; every error names the file, the
// field's path and the value (as the target's and assistant's configs do).
class Fields {
 public:
  Fields(const json& obj, std::string file, std::string prefix)
      : obj_(obj), file_(std::move(file)), prefix_(std::move(prefix)) {}

  const json* find(const char* field) const {
    const auto it = obj_.find(field);
    return it == obj_.end() || it->is_null() ? nullptr : &*it;
  }
  [[noreturn]] void bad(const char* field, const char* what, const json& v) const {
    fail("{}: {}{} {}, got {}", file_, prefix_, field, what, io::json_excerpt(v));
  }
  [[noreturn]] void missing(const char* field) const {
    fail("{}: field {}{} is missing", file_, prefix_, field);
  }
  int get_int(const char* field, std::optional<int> fallback = std::nullopt, int lo = INT_MIN,
              int hi = INT_MAX) const {
    const json* v = find(field);
    if (v == nullptr) {
      if (!fallback) missing(field);
      return *fallback;
    }
    if (!v->is_number_integer()) bad(field, "must be an integer", *v);
    if (v->is_number_unsigned() ? v->get<uint64_t>() > static_cast<uint64_t>(hi)
                                : (v->get<int64_t>() < lo || v->get<int64_t>() > hi)) {
      bad(field, fmt::format("must be in [{}, {}]", lo, hi).c_str(), *v);
    }
    return v->get<int>();
  }
  double get_double(const char* field, std::optional<double> fallback = std::nullopt) const {
    const json* v = find(field);
    if (v == nullptr) {
      if (!fallback) missing(field);
      return *fallback;
    }
    if (!v->is_number() || !std::isfinite(v->get<double>())) bad(field, "must be a number", *v);
    return v->get<double>();
  }
  bool get_bool(const char* field, std::optional<bool> fallback = std::nullopt) const {
    const json* v = find(field);
    if (v == nullptr) {
      if (!fallback) missing(field);
      return *fallback;
    }
    if (!v->is_boolean()) bad(field, "must be true or false", *v);
    return v->get<bool>();
  }
  std::string get_string(const char* field, std::optional<std::string> fallback = {}) const {
    const json* v = find(field);
    if (v == nullptr) {
      if (!fallback) missing(field);
      return *fallback;
    }
    if (!v->is_string()) bad(field, "must be a string", *v);
    return v->get<std::string>();
  }
  std::vector<int> get_int_list(const char* field) const {
    const json* v = find(field);
    if (v == nullptr) missing(field);
    if (!v->is_array() || v->empty()) bad(field, "must be a non-empty list of integers", *v);
    std::vector<int> out;
    for (const json& e : *v) {
      if (!e.is_number_integer() || e.get<int64_t>() < INT_MIN || e.get<int64_t>() > INT_MAX)
        bad(field, "must be a non-empty list of integers", *v);
      out.push_back(e.get<int>());
    }
    return out;
  }
  Fields object(const char* field) const {
    const json* v = find(field);
    if (v == nullptr) missing(field);
    if (!v->is_object()) bad(field, "must be an object", *v);
    return Fields(*v, file_, prefix_ + field + ".");
  }
  const std::string& file() const { return file_; }

 private:
  const json& obj_;
  std::string file_;
  std::string prefix_;
};

const char* layout_name(DSparkLayout l) {
  return l == DSparkLayout::kSpecula ? "specula" : "DeepSpec";
}

}  // namespace

std::string target_identity_text(const gemma4::Gemma4Config& t) {
  std::string types;
  for (const gemma4::LayerSpec& l : t.layers) {
    if (!types.empty()) types += ',';
    types += l.type == gemma4::LayerType::kSliding ? "sliding_attention" : "full_attention";
  }
  const std::string cap =
      t.final_logit_softcapping ? fmt::format("{:g}", *t.final_logit_softcapping) : "none";
  return fmt::format(
      "gemma4-target-v1;hidden_size={};num_hidden_layers={};vocab_size={};intermediate_size={};"
      "num_attention_heads={};num_key_value_heads={};head_dim={};sliding_window={};"
      "final_logit_softcapping={};layer_types={}",
      t.hidden_size, t.num_hidden_layers, t.vocab_size, t.intermediate_size, t.num_attention_heads,
      t.num_key_value_heads, t.head_dim, t.sliding_window, cap, types);
}

std::string target_config_hash(const gemma4::Gemma4Config& t) {
  return sha256_hex(target_identity_text(t));
}

DSparkTargetId target_id_of(const gemma4::Gemma4Config& t) {
  return {.hidden_size = t.hidden_size,
          .vocab_size = t.vocab_size,
          .num_hidden_layers = t.num_hidden_layers,
          .config_hash = target_config_hash(t)};
}

DSparkConfig parse_specula_dspark_config(const json& root, const std::string& file) {
  if (!root.is_object()) fail("{}: expected a JSON object, got {}", file, io::json_excerpt(root));
  const Fields top(root, file, "");
  const std::string kind = top.get_string("kind");
  if (kind != "dspark-drafter") {
    fail("{}: kind is '{}', expected 'dspark-drafter'", file, kind);
  }
  const std::string variant = top.get_string("variant");
  if (variant != "dspark") fail("{}: variant is '{}', expected 'dspark'", file, variant);
  const int version = top.get_int("version");
  if (version != 1) fail("{}: version is {}, this build reads version 1", file, version);

  DSparkConfig c;
  c.layout = DSparkLayout::kSpecula;
  const Fields t = top.object("target");
  c.target.hidden_size = t.get_int("hidden_size", std::nullopt, 1);
  c.target.vocab_size = t.get_int("vocab_size", std::nullopt, 1);
  c.target.num_hidden_layers = t.get_int("num_hidden_layers", std::nullopt, 1);
  c.target.config_hash = t.get_string("config_hash", "");

  const Fields f = top.object("config");
  c.block_size = f.get_int("block_size", std::nullopt, 1, 64);
  c.hidden_size = f.get_int("hidden_size", std::nullopt, 1);
  c.num_layers = f.get_int("num_layers", std::nullopt, 1, 256);
  c.num_heads = f.get_int("num_heads", std::nullopt, 1);
  c.ffn_mult = f.get_int("ffn_mult", 2, 1, 64);
  c.markov_rank = f.get_int("markov_rank", std::nullopt, 0);
  c.taps = f.get_int_list("tap_layers");
  c.rms_norm_eps = f.get_double("rms_norm_eps", 1e-6);
  if (!(c.rms_norm_eps > 0)) f.bad("rms_norm_eps", "must be positive", c.rms_norm_eps);
  if (c.hidden_size % c.num_heads != 0 || (c.hidden_size / c.num_heads) % 2 != 0) {
    fail(
        "{}: config.hidden_size {} must be a multiple of config.num_heads {} with an even head "
        "dimension",
        file, c.hidden_size, c.num_heads);
  }
  c.num_kv_heads = c.num_heads;
  c.head_dim = c.hidden_size / c.num_heads;
  c.intermediate_size = c.ffn_mult * c.hidden_size;
  c.confidence_head = true;
  c.confidence_with_markov = c.markov_rank > 0;

  if (top.find("calibration") != nullptr) {
    const Fields cal = top.object("calibration");
    if (const json* th = cal.find("thresholds")) {
      if (!th->is_array() || th->size() != static_cast<size_t>(c.block_size))
        cal.bad("thresholds", fmt::format("must be a list of {} numbers", c.block_size).c_str(),
                *th);
      for (const json& v : *th) {
        if (!v.is_number() || !std::isfinite(v.get<double>()))
          cal.bad("thresholds", "must hold numbers", *th);
        c.thresholds.push_back(v.get<float>());
      }
    }
    if (const json* st = cal.find("sts_temperatures")) {
      if (!st->is_array() || st->size() != static_cast<size_t>(c.block_size))
        cal.bad("sts_temperatures",
                fmt::format("must be a list of {} numbers", c.block_size).c_str(), *st);
      for (const json& v : *st) {
        if (!v.is_number() || !(v.get<double>() > 0) || !std::isfinite(v.get<double>()))
          cal.bad("sts_temperatures", "must hold finite numbers > 0", *st);
        c.sts_temperatures.push_back(v.get<float>());
      }
    }
    c.calibration_target = cal.get_double("target", 0.0);
    const json* s = cal.find("samples");
    if (s != nullptr && !s->is_number_integer()) cal.bad("samples", "must be an integer", *s);
    c.calibration_samples = s ? s->get<int64_t>() : 0;
  }
  return c;
}

DSparkConfig parse_deepspec_dspark_config(const json& root, const std::string& file) {
  if (!root.is_object()) fail("{}: expected a JSON object, got {}", file, io::json_excerpt(root));
  const Fields top(root, file, "");
  bool named = false;
  if (const json* a = top.find("architectures")) {
    if (!a->is_array()) top.bad("architectures", "must be a list of strings", *a);
    for (const json& e : *a) named = named || (e.is_string() && e == "Gemma4DSparkModel");
  }
  if (!named) {
    fail("{}: architectures {} do not name Gemma4DSparkModel (not a DeepSpec DSpark drafter)", file,
         top.find("architectures") ? io::json_excerpt(root["architectures"]) : "(missing)");
  }
  DSparkConfig c;
  c.layout = DSparkLayout::kDeepSpec;
  // The Gemma 4 text fields: read by the target's own parser (which checks them),
  // as a plain gemma4_text config whatever its architectures say.
  json text = root;
  text.erase("architectures");
  if (!text.contains("model_type")) text["model_type"] = "gemma4_text";
  c.text = gemma4::parse_gemma4_config(text, file);
  const gemma4::Gemma4Config& t = c.text;

  c.target_layer_ids = top.get_int_list("target_layer_ids");
  for (int id : c.target_layer_ids) {
    if (id < -1) top.bad("target_layer_ids", "must hold ids >= -1", root["target_layer_ids"]);
    c.taps.push_back(id + 1);  // -1 = embeddings = tap 0; layer k's output = tap k + 1
  }
  c.block_size = top.get_int("block_size", std::nullopt, 1, 64);
  c.mask_token_id = top.get_int("mask_token_id", std::nullopt, 0);
  c.markov_rank = top.get_int("markov_rank", std::nullopt, 0);
  if (c.markov_rank > 0) {
    const std::string type = top.get_string("markov_head_type");
    if (type != "vanilla") {
      fail("{}: markov_head_type is '{}'; only 'vanilla' is supported", file, type);
    }
  }
  c.confidence_head = top.get_bool("enable_confidence_head");
  c.confidence_with_markov =
      c.confidence_head ? top.get_bool("confidence_head_with_markov") : false;
  if (c.confidence_with_markov && c.markov_rank == 0) {
    fail("{}: confidence_head_with_markov is true but markov_rank is 0 (no Markov features)", file);
  }
  if (t.enable_moe_block) fail("{}: enable_moe_block must be false for a DSpark drafter", file);
  if (t.has_ple()) {
    fail("{}: hidden_size_per_layer_input must be 0 for a DSpark drafter, got {}", file,
         t.hidden_size_per_layer_input);
  }
  if (const json* n = top.find("num_target_layers")) {
    c.target.num_hidden_layers = top.get_int("num_target_layers", std::nullopt, 1);
    (void)n;
  }
  c.target.hidden_size = t.hidden_size;
  c.target.vocab_size = t.vocab_size;
  c.hidden_size = t.hidden_size;
  c.num_layers = t.num_hidden_layers;
  c.num_heads = t.num_attention_heads;
  // DeepSpec's attention reads the flat fields (it asserts both exist): head
  // dim global_head_dim; KV heads num_global_key_value_heads when k_eq_v, else
  // num_key_value_heads (per_layer_config does not apply to its layers).
  c.head_dim = top.get_int("global_head_dim", std::nullopt, 2);
  c.k_eq_v = t.attention_k_eq_v;
  c.num_kv_heads =
      c.k_eq_v ? top.get_int("num_global_key_value_heads", std::nullopt, 1) : t.num_key_value_heads;
  if (c.head_dim % 2 != 0) top.bad("global_head_dim", "must be even", root["global_head_dim"]);
  if (c.num_heads % c.num_kv_heads != 0) {
    fail("{}: num_attention_heads {} is not a multiple of the {} key/value heads", file,
         c.num_heads, c.num_kv_heads);
  }
  c.intermediate_size = t.intermediate_size;
  c.rms_norm_eps = t.rms_norm_eps;
  return c;
}

bool is_dspark_dir(const std::string& dir) {
  namespace fs = std::filesystem;
  std::error_code ec;
  if (fs::is_regular_file(fs::path(dir) / kSpeculaConfigFile, ec)) return true;
  std::ifstream in(fs::path(dir) / kDeepSpecConfigFile);
  if (!in) return false;
  const json j = json::parse(in, nullptr, /*allow_exceptions=*/false);
  if (!j.is_object()) return false;
  const auto it = j.find("architectures");
  if (it == j.end() || !it->is_array()) return false;
  for (const json& a : *it) {
    if (a.is_string() && a.get<std::string>() == "Gemma4DSparkModel") return true;
  }
  return false;
}

DSparkConfig load_dspark_config(const std::string& dir) {
  const std::string specula = dir + "/" + kSpeculaConfigFile;
  if (std::filesystem::exists(specula))
    return parse_specula_dspark_config(io::read_json_file(specula), specula);
  const std::string deepspec = dir + "/" + kDeepSpecConfigFile;
  if (!std::filesystem::exists(deepspec)) {
    fail("{}: not a DSpark drafter folder (neither {} nor {} exists)", dir, kSpeculaConfigFile,
         kDeepSpecConfigFile);
  }
  return parse_deepspec_dspark_config(io::read_json_file(deepspec), deepspec);
}

json specula_dspark_json(const DSparkConfig& c) {
  SPECULA_CHECK(c.layout == DSparkLayout::kSpecula, "dspark.json is the specula layout's file");
  json j;
  j["kind"] = "dspark-drafter";
  j["variant"] = "dspark";
  j["version"] = 1;
  j["target"] = {{"hidden_size", c.target.hidden_size},
                 {"vocab_size", c.target.vocab_size},
                 {"num_hidden_layers", c.target.num_hidden_layers},
                 {"config_hash", c.target.config_hash}};
  j["config"] = {{"block_size", c.block_size}, {"hidden_size", c.hidden_size},
                 {"num_layers", c.num_layers}, {"num_heads", c.num_heads},
                 {"ffn_mult", c.ffn_mult},     {"markov_rank", c.markov_rank},
                 {"tap_layers", c.taps},       {"rms_norm_eps", c.rms_norm_eps}};
  if (!c.thresholds.empty()) {
    j["calibration"] = {{"thresholds", c.thresholds},
                        {"target", c.calibration_target},
                        {"samples", c.calibration_samples}};
  }
  if (!c.sts_temperatures.empty()) j["calibration"]["sts_temperatures"] = c.sts_temperatures;
  return j;
}

void check_dspark_config(const DSparkConfig& c, const gemma4::Gemma4Config& target,
                         const std::string& origin) {
  const char* layout = layout_name(c.layout);
  auto differ = [&](const char* what, int64_t mine, int64_t theirs) {
    fail(
        "{}: this {}-layout DSpark drafter was made for a target with {} {}, but the target has "
        "{}",
        origin, layout, what, mine, theirs);
  };
  if (c.target.hidden_size != target.hidden_size)
    differ("hidden_size", c.target.hidden_size, target.hidden_size);
  if (c.target.vocab_size != target.vocab_size)
    differ("vocab_size", c.target.vocab_size, target.vocab_size);
  if (c.target.num_hidden_layers != 0 && c.target.num_hidden_layers != target.num_hidden_layers)
    differ("num_hidden_layers", c.target.num_hidden_layers, target.num_hidden_layers);
  if (!c.target.config_hash.empty()) {
    const std::string mine = target_config_hash(target);
    if (mine != c.target.config_hash) {
      fail(
          "{}: this DSpark drafter was made for a target whose config hash is {}, but the "
          "loaded target's is {}",
          origin, c.target.config_hash, mine);
    }
  }
  if (c.taps.empty()) fail("{}: the drafter reads no taps", origin);
  for (size_t i = 0; i < c.taps.size(); ++i) {
    if (c.taps[i] < 0 || c.taps[i] > target.num_hidden_layers) {
      fail("{}: tap {} (hidden_states[{}]) is outside the target's [0, {}]", origin, i, c.taps[i],
           target.num_hidden_layers);
    }
  }
  if (c.block_size < 1) fail("{}: block_size must be >= 1, got {}", origin, c.block_size);
  if (c.markov_rank < 0) fail("{}: markov_rank must be >= 0, got {}", origin, c.markov_rank);
  if (c.layout == DSparkLayout::kDeepSpec) {
    if (c.mask_token_id < 0 || c.mask_token_id >= target.vocab_size) {
      fail("{}: mask_token_id {} is outside the target's vocabulary of {}", origin, c.mask_token_id,
           target.vocab_size);
    }
    if (c.text.enable_moe_block || c.text.has_ple())
      fail("{}: a DSpark drafter has no MoE blocks or per-layer inputs", origin);
  }
}

DSparkConfig default_specula_config(const gemma4::Gemma4Config& target) {
  DSparkConfig c;
  c.layout = DSparkLayout::kSpecula;
  c.block_size = 5;
  c.hidden_size = 1024;
  c.num_layers = 5;
  c.num_heads = 8;
  c.num_kv_heads = 8;
  c.head_dim = c.hidden_size / c.num_heads;
  c.ffn_mult = 2;
  c.intermediate_size = c.ffn_mult * c.hidden_size;
  c.markov_rank = 256;
  const int L = target.num_hidden_layers;
  for (int t : {L / 2, 3 * L / 4, L - 1, L}) {
    if (c.taps.empty() || t > c.taps.back()) c.taps.push_back(t);
  }
  c.rms_norm_eps = target.rms_norm_eps;
  c.confidence_head = true;
  c.confidence_with_markov = true;
  c.target = target_id_of(target);
  return c;
}

DSparkConfig default_deepspec_config(const gemma4::Gemma4Config& target) {
  DSparkConfig c;
  c.layout = DSparkLayout::kDeepSpec;
  c.text = target;
  c.text.num_hidden_layers = 5;
  c.text.layer_types.assign(5, gemma4::LayerType::kFull);
  c.text.num_kv_shared_layers = 0;
  c.text.tie_word_embeddings = false;
  // The drafter's own layers are dense and take no per-layer inputs, whatever
  // the target's (E2B/E4B have per-layer inputs, 26B-A4B MoE blocks).
  c.text.hidden_size_per_layer_input = 0;
  c.text.enable_moe_block = false;
  c.text.finalize("default DeepSpec DSpark config");
  c.block_size = 7;
  c.mask_token_id = std::min(4, target.vocab_size - 1);
  c.markov_rank = 256;
  c.confidence_head = true;
  c.confidence_with_markov = true;
  const int L = target.num_hidden_layers;
  for (int id : {5, 17, 29, 41, 46}) {
    const int scaled = std::min(L - 1, id * L / 48);
    if (c.target_layer_ids.empty() || scaled > c.target_layer_ids.back())
      c.target_layer_ids.push_back(scaled);
  }
  for (int id : c.target_layer_ids) c.taps.push_back(id + 1);
  c.target.hidden_size = target.hidden_size;
  c.target.vocab_size = target.vocab_size;
  c.target.num_hidden_layers = L;
  c.hidden_size = target.hidden_size;
  c.num_layers = 5;
  c.num_heads = target.num_attention_heads;
  c.head_dim = target.global_head_dim;
  c.k_eq_v = target.attention_k_eq_v;
  c.num_kv_heads = c.text.layers[0].n_kv_heads;
  c.intermediate_size = target.intermediate_size;
  c.rms_norm_eps = target.rms_norm_eps;
  return c;
}

}  // namespace specula::dspark
