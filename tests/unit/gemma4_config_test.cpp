// SPDX-License-Identifier: Apache-2.0
#include "engine/model/gemma4/config.h"

#include <gtest/gtest.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <functional>
#include <nlohmann/json.hpp>

#include "engine/core/error.h"

namespace specula::gemma4 {
namespace {

using nlohmann::json;

constexpr char kOrigin[] = "cfg/config.json";

// `pattern` repeated `times`, e.g. ("SSSSF", 7) for E2B.
json layer_types(const std::string& pattern, int times) {
  json out = json::array();
  for (int t = 0; t < times; ++t) {
    for (char c : pattern) out.push_back(c == 'S' ? "sliding_attention" : "full_attention");
  }
  return out;
}

// The released text configs of gemma4-architecture.md §8, flat form (transformers <= 5.14).
json e2b() {
  return {{"model_type", "gemma4_text"},
          {"vocab_size", 262144},
          {"hidden_size", 1536},
          {"intermediate_size", 6144},
          {"num_hidden_layers", 35},
          {"layer_types", layer_types("SSSSF", 7)},
          {"num_attention_heads", 8},
          {"num_key_value_heads", 1},
          {"head_dim", 256},
          {"global_head_dim", 512},
          {"num_global_key_value_heads", nullptr},
          {"attention_k_eq_v", false},
          {"hidden_size_per_layer_input", 256},
          {"vocab_size_per_layer_input", 262144},
          {"num_kv_shared_layers", 20},
          {"use_double_wide_mlp", true},
          {"sliding_window", 512},
          {"max_position_embeddings", 131072},
          {"final_logit_softcapping", 30.0},
          {"hidden_activation", "gelu_pytorch_tanh"},
          {"rms_norm_eps", 1e-6},
          {"eos_token_id", json::array({1, 106})},
          {"rope_parameters",
           {{"sliding_attention", {{"rope_type", "default"}, {"rope_theta", 10000.0}}},
            {"full_attention",
             {{"rope_type", "proportional"},
              {"partial_rotary_factor", 0.25},
              {"rope_theta", 1000000.0}}}}},
          {"enable_moe_block", false},
          {"num_experts", nullptr},
          {"torch_dtype", "bfloat16"},  // unknown fields are fine
          {"use_bidirectional_attention", nullptr}};
}

json e4b() {
  json c = e2b();
  c["hidden_size"] = 2560;
  c["intermediate_size"] = 10240;
  c["num_hidden_layers"] = 42;
  c["layer_types"] = layer_types("SSSSSF", 7);
  c["num_key_value_heads"] = 2;
  c["num_kv_shared_layers"] = 18;
  c["use_double_wide_mlp"] = false;
  return c;
}

json b31() {
  json c = e2b();
  c["hidden_size"] = 5376;
  c["intermediate_size"] = 21504;
  c["num_hidden_layers"] = 60;
  c["layer_types"] = layer_types("SSSSSF", 10);
  c["num_attention_heads"] = 32;
  c["num_key_value_heads"] = 16;
  c["num_global_key_value_heads"] = 4;
  c["attention_k_eq_v"] = true;
  c["hidden_size_per_layer_input"] = 0;
  c["num_kv_shared_layers"] = 0;
  c["use_double_wide_mlp"] = false;
  c["sliding_window"] = 1024;
  c["max_position_embeddings"] = 262144;
  c["use_bidirectional_attention"] = "vision";
  return c;
}

json b26() {
  json c = b31();
  c["hidden_size"] = 2816;
  c["intermediate_size"] = 2112;
  c["num_hidden_layers"] = 30;
  c["layer_types"] = layer_types("SSSSSF", 5);
  c["num_attention_heads"] = 16;
  c["num_key_value_heads"] = 8;
  c["num_global_key_value_heads"] = 2;
  c["enable_moe_block"] = true;
  c["num_experts"] = 128;
  c["top_k_experts"] = 8;
  c["moe_intermediate_size"] = 704;
  return c;
}

// The same config in the newer form: per-layer overrides instead of global_* fields.
json to_per_layer_form(json c) {
  json plc = json::object();
  for (size_t i = 0; i < c["layer_types"].size(); ++i) {
    if (c["layer_types"][i] != "full_attention") continue;
    json o = {{"head_dim", c["global_head_dim"]}};
    if (c["attention_k_eq_v"].get<bool>())
      o["num_key_value_heads"] = c["num_global_key_value_heads"];
    plc[std::to_string(i)] = o;
  }
  c.erase("global_head_dim");
  c.erase("num_global_key_value_heads");
  c["per_layer_config"] = plc;
  return c;
}

// Wraps a text config as the multimodal `gemma4` config.json does.
json wrap_multimodal(json text) {
  json eos = text["eos_token_id"];
  text.erase("model_type");
  return {{"model_type", "gemma4"}, {"architectures", {"Gemma4ForConditionalGeneration"}},
          {"text_config", text},    {"vision_config", {{"hidden_size", 768}}},
          {"eos_token_id", eos},    {"tie_word_embeddings", true}};
}

json as_causal_lm(json text) {
  text["architectures"] = {"Gemma4ForCausalLM"};
  return text;
}

struct Expected {
  const char* name;
  std::function<json()> make;
  int layers;
  int first_shared;
  int sliding_donor;
  int full_donor;
};

const Expected kReleased[] = {
    {"E2B", e2b, 35, 15, 13, 14},
    {"E4B", e4b, 42, 24, 22, 23},
    {"31B", b31, 60, 60, 58, 59},
    {"26B-A4B", b26, 30, 30, 28, 29},
};

void check_released(const Gemma4Config& c, const Expected& e, const json& text) {
  SCOPED_TRACE(e.name);
  ASSERT_EQ(c.layers.size(), static_cast<size_t>(e.layers));
  EXPECT_EQ(c.first_shared_layer, e.first_shared);
  EXPECT_EQ(c.sliding_donor, e.sliding_donor);
  EXPECT_EQ(c.full_donor, e.full_donor);
  EXPECT_EQ(c.donor_of_type(LayerType::kSliding), e.sliding_donor);
  EXPECT_EQ(c.global_head_dim, 512);
  EXPECT_EQ(c.hidden_size, text["hidden_size"].get<int>());
  const bool k_eq_v = text["attention_k_eq_v"].get<bool>();
  for (int i = 0; i < e.layers; ++i) {
    const LayerSpec& s = c.layers[static_cast<size_t>(i)];
    const bool full = text["layer_types"][static_cast<size_t>(i)] == "full_attention";
    EXPECT_EQ(s.type, full ? LayerType::kFull : LayerType::kSliding) << i;
    EXPECT_EQ(s.head_dim, full ? 512 : 256) << i;
    EXPECT_EQ(s.k_eq_v, full && k_eq_v) << i;
    const int kv = full && k_eq_v ? text["num_global_key_value_heads"].get<int>()
                                  : text["num_key_value_heads"].get<int>();
    EXPECT_EQ(s.n_kv_heads, kv) << i;
    EXPECT_EQ(s.kv_shared, i >= e.first_shared) << i;
    EXPECT_EQ(s.is_donor, i == e.sliding_donor || i == e.full_donor) << i;
    if (s.kv_shared) {
      EXPECT_EQ(s.kv_donor, full ? e.full_donor : e.sliding_donor) << i;
    } else {
      EXPECT_EQ(s.kv_donor, i) << i;
    }
  }
}

TEST(Gemma4Config, ReleasedConfigsDeriveTheDonorTable) {
  for (const Expected& e : kReleased) {
    const json text = e.make();
    check_released(parse_gemma4_config(text, kOrigin), e, text);
    check_released(parse_gemma4_config(to_per_layer_form(text), kOrigin), e, text);
    check_released(parse_gemma4_config(wrap_multimodal(to_per_layer_form(text)), kOrigin), e, text);
  }
}

TEST(Gemma4Config, E2BDoublesTheMlpOfSharedLayers) {
  const Gemma4Config c = parse_gemma4_config(e2b(), kOrigin);
  for (int i = 0; i < 35; ++i) {
    EXPECT_EQ(c.layers[static_cast<size_t>(i)].intermediate_size, i >= 15 ? 12288 : 6144) << i;
  }
  EXPECT_TRUE(c.has_ple());
  EXPECT_EQ(c.hidden_size_per_layer_input, 256);
  // E4B shares 18 layers but does not widen them.
  const Gemma4Config e4 = parse_gemma4_config(e4b(), kOrigin);
  for (const LayerSpec& s : e4.layers) EXPECT_EQ(s.intermediate_size, 10240);
}

TEST(Gemma4Config, ReadsEveryScalarField) {
  const Gemma4Config c = parse_gemma4_config(b26(), kOrigin);
  EXPECT_EQ(c.source_kind, "gemma4_text");
  EXPECT_EQ(c.weight_prefix, "model.");
  EXPECT_EQ(c.vocab_size, 262144);
  EXPECT_EQ(c.num_attention_heads, 16);
  EXPECT_EQ(c.num_global_key_value_heads, std::optional<int>(2));
  EXPECT_TRUE(c.attention_k_eq_v);
  EXPECT_TRUE(c.enable_moe_block);
  EXPECT_EQ(c.num_experts, 128);
  EXPECT_EQ(c.top_k_experts, 8);
  EXPECT_EQ(c.moe_intermediate_size, 704);
  EXPECT_FALSE(c.has_ple());
  EXPECT_EQ(c.sliding_window, 1024);
  EXPECT_EQ(c.max_position_embeddings, 262144);
  EXPECT_EQ(c.final_logit_softcapping, std::optional<double>(30.0));
  EXPECT_EQ(c.eos_token_ids, (std::vector<int>{1, 106}));
  EXPECT_DOUBLE_EQ(c.rms_norm_eps, 1e-6);
  EXPECT_EQ(c.rope_sliding.kind, RopeConfig::Kind::kDefault);
  EXPECT_DOUBLE_EQ(c.rope_sliding.theta, 10000.0);
  EXPECT_EQ(c.rope_full.kind, RopeConfig::Kind::kProportional);
  EXPECT_DOUBLE_EQ(c.rope_full.theta, 1e6);
  EXPECT_DOUBLE_EQ(c.rope_full.partial_rotary_factor, 0.25);
  EXPECT_DOUBLE_EQ(c.rope_full.factor, 1.0);
}

TEST(Gemma4Config, ThreeWrapperKindsAndTheirPrefixes) {
  const Gemma4Config text = parse_gemma4_config(e2b(), kOrigin);
  EXPECT_EQ(text.source_kind, "gemma4_text");
  EXPECT_EQ(text.weight_prefix, "model.");
  const Gemma4Config mm = parse_gemma4_config(wrap_multimodal(e2b()), kOrigin);
  EXPECT_EQ(mm.source_kind, "gemma4");
  EXPECT_EQ(mm.weight_prefix, "model.language_model.");
  EXPECT_EQ(mm.hidden_size, 1536);
  const Gemma4Config lm = parse_gemma4_config(as_causal_lm(e2b()), kOrigin);
  EXPECT_EQ(lm.source_kind, "Gemma4ForCausalLM");
  EXPECT_EQ(lm.weight_prefix, "model.");
  json no_type = as_causal_lm(e2b());
  no_type.erase("model_type");
  EXPECT_EQ(parse_gemma4_config(no_type, kOrigin).source_kind, "Gemma4ForCausalLM");
}

TEST(Gemma4Config, MultimodalTokenIdsComeFromTheRoot) {
  json c = wrap_multimodal(e2b());
  c["text_config"]["eos_token_id"] = 1;
  c["eos_token_id"] = json::array({1, 106, 50});
  EXPECT_EQ(parse_gemma4_config(c, kOrigin).eos_token_ids, (std::vector<int>{1, 106, 50}));
  c.erase("eos_token_id");
  EXPECT_EQ(parse_gemma4_config(c, kOrigin).eos_token_ids, (std::vector<int>{1}));
}

TEST(Gemma4Config, DefaultsWhenFieldsAreAbsent) {
  // A minimal config: every field but num_hidden_layers takes the HF default (§1).
  const Gemma4Config c =
      parse_gemma4_config({{"model_type", "gemma4_text"}, {"num_hidden_layers", 30}}, kOrigin);
  EXPECT_EQ(c.num_hidden_layers, 30);
  EXPECT_EQ(c.hidden_size, 2304);
  EXPECT_EQ(c.global_head_dim, 512);
  EXPECT_EQ(c.eos_token_ids, (std::vector<int>{1}));
  EXPECT_FALSE(c.final_logit_softcapping.has_value());
  EXPECT_EQ(c.rope_full.kind, RopeConfig::Kind::kProportional);
  EXPECT_DOUBLE_EQ(c.rope_full.partial_rotary_factor, 0.25);
  // Default pattern: layer i is full iff (i + 1) % 6 == 0, and the last layer is full.
  for (int i = 0; i < 30; ++i) {
    EXPECT_EQ(c.layers[static_cast<size_t>(i)].type,
              (i + 1) % 6 == 0 ? LayerType::kFull : LayerType::kSliding)
        << i;
  }
  const Gemma4Config eight =
      parse_gemma4_config({{"model_type", "gemma4_text"}, {"num_hidden_layers", 8}}, kOrigin);
  EXPECT_EQ(eight.layers[5].type, LayerType::kFull);
  EXPECT_EQ(eight.layers[6].type, LayerType::kSliding);
  EXPECT_EQ(eight.layers[7].type, LayerType::kFull);  // forced
  EXPECT_EQ(eight.sliding_donor, 6);
  EXPECT_EQ(eight.full_donor, 7);
}

TEST(Gemma4Config, ScalarOrListEosAndNullSoftcap) {
  json c = e2b();
  c["eos_token_id"] = 7;
  c["final_logit_softcapping"] = nullptr;
  const Gemma4Config p = parse_gemma4_config(c, kOrigin);
  EXPECT_EQ(p.eos_token_ids, (std::vector<int>{7}));
  EXPECT_FALSE(p.final_logit_softcapping.has_value());
}

TEST(Gemma4Config, ExplicitLastLayerIsForcedFull) {
  json c = {{"model_type", "gemma4_text"},
            {"num_hidden_layers", 3},
            {"layer_types", {"sliding_attention", "full_attention", "sliding_attention"}}};
  const Gemma4Config p = parse_gemma4_config(c, kOrigin);
  EXPECT_EQ(p.layers[2].type, LayerType::kFull);
  EXPECT_EQ(p.full_donor, 2);
  EXPECT_EQ(p.sliding_donor, 0);
}

TEST(Gemma4Config, PerLayerConfigAsAList) {
  json c = {{"model_type", "gemma4_text"},
            {"num_hidden_layers", 2},
            {"layer_types", {"sliding_attention", "full_attention"}},
            {"head_dim", 16},
            {"per_layer_config", json::array({nullptr, {{"head_dim", 32}}})}};
  const Gemma4Config p = parse_gemma4_config(c, kOrigin);
  EXPECT_EQ(p.layers[0].head_dim, 16);
  EXPECT_EQ(p.layers[1].head_dim, 32);
}

TEST(Gemma4Config, TinyGoldenRecipeNeedsAFullDonor) {
  // gemma4-architecture.md §12.2 config (A) as written: 5 layers [S,S,S,S,F], 2 shared.
  // Shared layer 4 is full but no full layer precedes the first shared layer 3, so
  // HF itself cannot build it; the parser must say so rather than derive nonsense.
  json c = {{"model_type", "gemma4_text"},
            {"vocab_size", 128},
            {"hidden_size", 32},
            {"intermediate_size", 64},
            {"num_hidden_layers", 5},
            {"layer_types", layer_types("SSSSF", 1)},
            {"num_attention_heads", 2},
            {"num_key_value_heads", 1},
            {"head_dim", 16},
            {"global_head_dim", 32},
            {"hidden_size_per_layer_input", 8},
            {"vocab_size_per_layer_input", 128},
            {"num_kv_shared_layers", 2},
            {"use_double_wide_mlp", true},
            {"sliding_window", 4},
            {"eos_token_id", 1}};
  EXPECT_THROW((void)parse_gemma4_config(c, kOrigin), Error);
  // [S,S,F,S,F]: donors 1 (sliding) and 2 (full); the two shared layers are widened.
  c["layer_types"] = layer_types("SSFSF", 1);
  const Gemma4Config p = parse_gemma4_config(c, kOrigin);
  EXPECT_EQ(p.first_shared_layer, 3);
  EXPECT_EQ(p.sliding_donor, 1);
  EXPECT_EQ(p.full_donor, 2);
  EXPECT_EQ(p.layers[3].kv_donor, 1);
  EXPECT_EQ(p.layers[4].kv_donor, 2);
  EXPECT_EQ(p.layers[4].head_dim, 32);
  EXPECT_EQ(p.layers[3].head_dim, 16);
  EXPECT_EQ(p.layers[2].intermediate_size, 64);
  EXPECT_EQ(p.layers[3].intermediate_size, 128);
  EXPECT_EQ(p.layers[4].intermediate_size, 128);
}

TEST(Gemma4Config, AllSharedDrafterStackHasExternalDonors) {
  // The assistant drafter: every layer KV-shared, K/V come from the target model.
  json c = {{"model_type", "gemma4_text"},           {"num_hidden_layers", 4},
            {"layer_types", layer_types("SSSF", 1)}, {"num_kv_shared_layers", 4},
            {"hidden_size_per_layer_input", 0},      {"vocab_size_per_layer_input", 0},
            {"use_double_wide_mlp", false}};
  const Gemma4Config p = parse_gemma4_config(c, kOrigin);
  EXPECT_EQ(p.first_shared_layer, 0);
  EXPECT_EQ(p.sliding_donor, -1);
  EXPECT_EQ(p.full_donor, -1);
  for (const LayerSpec& s : p.layers) {
    EXPECT_TRUE(s.kv_shared);
    EXPECT_EQ(s.kv_donor, -1);
    EXPECT_FALSE(s.is_donor);
  }
}

TEST(Gemma4Config, LoadsFromADirectoryOrFile) {
  const std::string dir = fmt::format("{}/specula_cfg_{}", ::testing::TempDir(), ::getpid());
  std::filesystem::create_directories(dir);
  std::ofstream(dir + "/config.json") << wrap_multimodal(e4b()).dump(2);
  EXPECT_EQ(load_gemma4_config(dir).full_donor, 23);
  EXPECT_EQ(load_gemma4_config(dir + "/config.json").sliding_donor, 22);
  std::ofstream(dir + "/config.json")
      << R"({"model_type": "gemma4", "text_config": {"hidden_size": "big"}})";
  try {
    (void)load_gemma4_config(dir);
    ADD_FAILURE() << "expected an Error";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find(dir + "/config.json"), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("text_config.hidden_size"), std::string::npos) << e.what();
  }
  std::filesystem::remove_all(dir);
  EXPECT_THROW((void)load_gemma4_config(dir), Error);
}

// --- bad configs: each must throw an Error naming the origin, the field and the value.

struct BadCase {
  const char* what;
  std::function<json()> make;
  std::vector<std::string> parts;  // substrings the message must contain (besides the origin)
};

json with(json c, const std::string& key, json value) {
  c[key] = std::move(value);
  return c;
}

const std::vector<BadCase>& bad_cases() {
  static const std::vector<BadCase> cases = {
      {"activation",
       [] { return with(e2b(), "hidden_activation", "gelu"); },
       {"hidden_activation", "'gelu'"}},
      {"rope type",
       [] {
         json c = e2b();
         c["rope_parameters"]["full_attention"]["rope_type"] = "yarn";
         return c;
       },
       {"rope_parameters.full_attention.rope_type", "'yarn'"}},
      {"flat rope",
       [] {
         return with(e2b(), "rope_parameters", {{"rope_type", "default"}, {"rope_theta", 1e4}});
       },
       {"rope_parameters", "keyed by layer type"}},
      {"rope theta",
       [] {
         json c = e2b();
         c["rope_parameters"]["sliding_attention"]["rope_theta"] = -5;
         return c;
       },
       {"rope_theta", "-5"}},
      {"no num_hidden_layers",
       [] {
         json c = e2b();
         c.erase("num_hidden_layers");
         return c;
       },
       {"num_hidden_layers is missing"}},
      {"no num_hidden_layers in text_config",
       [] {
         json c = wrap_multimodal(e2b());
         c["text_config"].erase("num_hidden_layers");
         return c;
       },
       {"text_config.num_hidden_layers is missing"}},
      {"layer_types length",
       [] { return with(e2b(), "layer_types", layer_types("SSSSF", 6)); },
       {"layer_types", "30 entries", "num_hidden_layers is 35"}},
      {"layer type name",
       [] {
         json c = e2b();
         c["layer_types"][3] = "local_attention";
         return c;
       },
       {"layer_types[3]", "local_attention"}},
      {"zero hidden", [] { return with(e2b(), "hidden_size", 0); }, {"hidden_size", "0"}},
      {"negative heads",
       [] { return with(e2b(), "num_attention_heads", -8); },
       {"num_attention_heads", "-8"}},
      {"zero layers",
       [] { return with(e2b(), "num_hidden_layers", 0); },
       {"num_hidden_layers", "0"}},
      {"huge layers",
       [] { return with(e2b(), "num_hidden_layers", 2000000000); },
       {"num_hidden_layers", "2000000000"}},
      {"int overflow",
       [] { return with(e2b(), "hidden_size", 4294967296); },
       {"hidden_size", "4294967296", "out of range"}},
      {"heads not divisible",
       [] { return with(e2b(), "num_key_value_heads", 3); },
       {"num_attention_heads (8)", "num_key_value_heads (3)"}},
      {"global heads not divisible",
       [] { return with(b31(), "num_global_key_value_heads", 5); },
       {"num_global_key_value_heads (5)"}},
      {"k_eq_v without global kv",
       [] { return with(b31(), "num_global_key_value_heads", nullptr); },
       {"attention_k_eq_v", "num_global_key_value_heads"}},
      {"too many shared",
       [] { return with(e2b(), "num_kv_shared_layers", 36); },
       {"num_kv_shared_layers", "36"}},
      {"moe without experts",
       [] {
         json c = b26();
         c.erase("num_experts");
         return c;
       },
       {"enable_moe_block", "num_experts (0)"}},
      {"moe without size",
       [] { return with(b26(), "moe_intermediate_size", nullptr); },
       {"enable_moe_block", "moe_intermediate_size (0)"}},
      {"top_k above experts",
       [] { return with(b26(), "top_k_experts", 129); },
       {"top_k_experts (129)", "num_experts (128)"}},
      {"plc sliding head_dim",
       [] {
         json c = to_per_layer_form(e2b());
         c["per_layer_config"]["3"] = {{"head_dim", 512}};
         return c;
       },
       {"per_layer_config[\"3\"].head_dim", "512", "sliding layer", "256"}},
      {"plc disagreeing full layers",
       [] {
         json c = to_per_layer_form(e2b());
         c["per_layer_config"]["9"] = {{"head_dim", 256}};
         return c;
       },
       {"per_layer_config[\"9\"].head_dim", "256", "layer 4", "512"}},
      {"plc bad key",
       [] {
         json c = to_per_layer_form(e2b());
         c["per_layer_config"]["four"] = {{"head_dim", 512}};
         return c;
       },
       {"per_layer_config", "\"four\""}},
      {"plc index out of range",
       [] {
         json c = to_per_layer_form(e2b());
         c["per_layer_config"]["35"] = {{"head_dim", 512}};
         return c;
       },
       {"per_layer_config", "\"35\"", "[0, 35)"}},
      {"plc contradicts flat",
       [] { return with(to_per_layer_form(e2b()), "global_head_dim", 256); },
       {"global_head_dim is 256", "512"}},
      {"no donor for a shared type",
       [] {
         return json{{"model_type", "gemma4_text"},
                     {"num_hidden_layers", 4},
                     {"layer_types", layer_types("FFSF", 1)},
                     {"num_kv_shared_layers", 2}};
       },
       {"layer 2", "sliding_attention", "KV-shared"}},
      {"string size",
       [] { return with(e2b(), "hidden_size", "1536"); },
       {"hidden_size", "must be an integer", "\"1536\""}},
      {"float size",
       [] { return with(e2b(), "hidden_size", 1536.5); },
       {"hidden_size", "must be an integer", "1536.5"}},
      {"null size",
       [] { return with(e2b(), "intermediate_size", nullptr); },
       {"intermediate_size", "null"}},
      {"int as bool",
       [] { return with(e2b(), "attention_k_eq_v", 1); },
       {"attention_k_eq_v", "true or false", "1"}},
      {"layer_types not a list",
       [] { return with(e2b(), "layer_types", "sliding"); },
       {"layer_types", "\"sliding\""}},
      {"eos string", [] { return with(e2b(), "eos_token_id", "1"); }, {"eos_token_id", "\"1\""}},
      {"eos list of strings",
       [] {
         return with(e2b(), "eos_token_id", {1, "x"});
       },
       {"eos_token_id[1]", "\"x\""}},
      {"eos outside vocab",
       [] { return with(e2b(), "eos_token_id", 262144); },
       {"eos_token_id", "262144"}},
      {"empty eos",
       [] { return with(e2b(), "eos_token_id", json::array()); },
       {"eos_token_id", "empty"}},
      {"rope list",
       [] { return with(e2b(), "rope_parameters", json::array()); },
       {"rope_parameters", "[]"}},
      {"softcap zero",
       [] { return with(e2b(), "final_logit_softcapping", 0); },
       {"final_logit_softcapping", "0"}},
      {"odd head dim", [] { return with(e2b(), "head_dim", 255); }, {"head_dim", "255"}},
      {"bias", [] { return with(e2b(), "attention_bias", true); }, {"attention_bias"}},
      {"bidirectional all",
       [] { return with(e2b(), "use_bidirectional_attention", "all"); },
       {"use_bidirectional_attention", "\"all\""}},
      {"unknown model type",
       [] { return with(e2b(), "model_type", "llama"); },
       {"model_type", "'llama'"}},
      {"wrapper without text_config",
       [] {
         json c = wrap_multimodal(e2b());
         c.erase("text_config");
         return c;
       },
       {"text_config"}},
      {"wrapper with wrong inner type",
       [] {
         json c = wrap_multimodal(e2b());
         c["text_config"]["model_type"] = "gemma3_text";
         return c;
       },
       {"text_config.model_type", "gemma3_text"}},
      {"nested field path",
       [] {
         json c = wrap_multimodal(e2b());
         c["text_config"]["sliding_window"] = -1;
         return c;
       },
       {"(text_config)", "sliding_window", "-1"}},
      {"architectures not a list",
       [] { return with(e2b(), "architectures", "Gemma4ForCausalLM"); },
       {"architectures"}},
      {"not an object", [] { return json::array({1}); }, {"JSON object", "array"}},
  };
  return cases;
}

TEST(Gemma4Config, BadConfigsFailWithClearErrors) {
  for (const BadCase& bad : bad_cases()) {
    SCOPED_TRACE(bad.what);
    try {
      (void)parse_gemma4_config(bad.make(), kOrigin);
      ADD_FAILURE() << "expected an Error for: " << bad.what;
    } catch (const Error& e) {
      const std::string msg = e.what();
      EXPECT_NE(msg.find(kOrigin), std::string::npos) << msg;
      for (const std::string& p : bad.parts) {
        EXPECT_NE(msg.find(p), std::string::npos) << "lacks \"" << p << "\": " << msg;
      }
    }
  }
}

}  // namespace
}  // namespace specula::gemma4
