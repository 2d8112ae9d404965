// SPDX-License-Identifier: Apache-2.0
#include "engine/model/gemma4/presets.h"

#include <gtest/gtest.h>

#include <cmath>
#include <nlohmann/json.hpp>
#include <string>

#include "engine/core/error.h"
#include "engine/draft/assistant/assistant.h"

namespace specula::gemma4 {
namespace {

// Parameters of the text decoder, counted from the config's shapes
// (gemma4-architecture.md §3-§7): embeddings (tied head), PLE, per-layer
// attention / MLP / MoE / norms / layer_scalar, final norm.
double count_params(const Gemma4Config& c) {
  const double H = c.hidden_size, V = c.vocab_size, L = c.num_hidden_layers;
  const double P = c.hidden_size_per_layer_input;
  double n = V * H + H;
  if (c.has_ple()) n += c.vocab_size_per_layer_input * L * P + L * P * H + P;
  for (const LayerSpec& s : c.layers) {
    const double D = s.head_dim, Nh = c.num_attention_heads, kv = s.n_kv_heads;
    n += 4 * H + 1;                    // four sandwich norms, layer_scalar
    n += Nh * D * H + D + H * Nh * D;  // q_proj, q_norm, o_proj
    if (!s.kv_shared) {
      n += kv * D * H + D;             // k_proj, k_norm
      if (!s.k_eq_v) n += kv * D * H;  // v_proj
    }
    n += 3 * H * s.intermediate_size;     // gate, up, down
    if (c.has_ple()) n += 2 * P * H + H;  // per_layer_input_gate, per_layer_projection, norm
    if (c.enable_moe_block) {
      const double E = c.num_experts, I = c.moe_intermediate_size;
      n += E * H + H + E;                      // router.proj, router.scale, per_expert_scale
      n += E * 2 * I * H + E * H * I + 3 * H;  // experts, three extra norms
    }
  }
  return n;
}

// Relative difference, for "roughly right" parameter counts.
double rel(double got, double want) {
  return std::abs(got - want) / want;
}

TEST(Gemma4Presets, NamesAreTheReleasedModels) {
  EXPECT_EQ(gemma4_preset_names(), (std::vector<std::string>{"e2b", "e4b", "31b", "26b-a4b"}));
}

TEST(Gemma4Presets, EveryPresetParses) {
  for (const std::string& name : gemma4_preset_names()) {
    SCOPED_TRACE(name);
    const Gemma4Config c = gemma4_preset(name);
    EXPECT_EQ(c.vocab_size, 262144);
    EXPECT_EQ(c.head_dim, 256);
    EXPECT_EQ(c.global_head_dim, 512);
    ASSERT_TRUE(c.final_logit_softcapping.has_value());
    EXPECT_EQ(*c.final_logit_softcapping, 30.0);
    EXPECT_TRUE(c.tie_word_embeddings);
    EXPECT_EQ(c.rope_full.kind, RopeConfig::Kind::kProportional);
    EXPECT_EQ(c.rope_full.partial_rotary_factor, 0.25);
    EXPECT_EQ(c.rope_sliding.kind, RopeConfig::Kind::kDefault);
    EXPECT_EQ(c.layer_types.back(), LayerType::kFull);
    // The JSON is the input of parse_gemma4_config, unchanged by parsing it again.
    const nlohmann::json j = gemma4_preset_json(name);
    EXPECT_EQ(j["model_type"], "gemma4_text");
    EXPECT_EQ(parse_gemma4_config(j, "again").layers.size(), c.layers.size());
  }
}

TEST(Gemma4Presets, LayerGeometryMatchesTheReleasedModels) {
  struct Want {
    const char* name;
    int layers, hidden, period, heads, kv, full_kv;
    bool k_eq_v;
    int first_shared, sliding_donor, full_donor, window, ple;
  };
  const Want wants[] = {
      {"e2b", 35, 1536, 5, 8, 1, 1, false, 15, 13, 14, 512, 256},
      {"e4b", 42, 2560, 6, 8, 2, 2, false, 24, 22, 23, 512, 256},
      {"31b", 60, 5376, 6, 32, 16, 4, true, 60, 58, 59, 1024, 0},
      {"26b-a4b", 30, 2816, 6, 16, 8, 2, true, 30, 28, 29, 1024, 0},
  };
  for (const Want& w : wants) {
    SCOPED_TRACE(w.name);
    const Gemma4Config c = gemma4_preset(w.name);
    ASSERT_EQ(c.layers.size(), static_cast<size_t>(w.layers));
    EXPECT_EQ(c.hidden_size, w.hidden);
    EXPECT_EQ(c.num_attention_heads, w.heads);
    EXPECT_EQ(c.first_shared_layer, w.first_shared);
    EXPECT_EQ(c.sliding_donor, w.sliding_donor);
    EXPECT_EQ(c.full_donor, w.full_donor);
    EXPECT_EQ(c.sliding_window, w.window);
    EXPECT_EQ(c.hidden_size_per_layer_input, w.ple);
    int full_layers = 0;
    for (int i = 0; i < w.layers; ++i) {
      const LayerSpec& s = c.layers[static_cast<size_t>(i)];
      const bool full = (i + 1) % w.period == 0;
      full_layers += full;
      EXPECT_EQ(s.type, full ? LayerType::kFull : LayerType::kSliding) << i;
      EXPECT_EQ(s.head_dim, full ? 512 : 256) << i;
      EXPECT_EQ(s.n_kv_heads, full ? w.full_kv : w.kv) << i;
      EXPECT_EQ(s.k_eq_v, full && w.k_eq_v) << i;
      EXPECT_EQ(s.kv_shared, i >= w.first_shared) << i;
    }
    EXPECT_EQ(full_layers, w.layers / w.period);
  }
}

TEST(Gemma4Presets, MlpWidthsAndMoe) {
  const Gemma4Config e2b = gemma4_preset("e2b");
  for (int i = 0; i < 35; ++i)
    EXPECT_EQ(e2b.layers[static_cast<size_t>(i)].intermediate_size, i >= 15 ? 12288 : 6144) << i;
  EXPECT_EQ(gemma4_preset("e4b").layers.back().intermediate_size, 10240);
  EXPECT_EQ(gemma4_preset("31b").layers[0].intermediate_size, 21504);
  const Gemma4Config moe = gemma4_preset("26b-a4b");
  EXPECT_TRUE(moe.enable_moe_block);
  EXPECT_EQ(moe.num_experts, 128);
  EXPECT_EQ(moe.top_k_experts, 8);
  EXPECT_EQ(moe.moe_intermediate_size, 704);
  EXPECT_EQ(moe.intermediate_size, 2112);
  for (const char* dense : {"e2b", "e4b", "31b"})
    EXPECT_FALSE(gemma4_preset(dense).enable_moe_block);
}

TEST(Gemma4Presets, ParameterCountsAreRoughlyTheReleasedSizes) {
  // Model cards: 31B "30.7B", 26B-A4B "25.2B total, 3.8B active". E2B / E4B quote 5.1B / 8B
  // with their vision and audio towers (text decoder alone: ~4.63B / ~7.46B) and 2.3B / 4.5B
  // "effective" (without the per-layer-embedding table).
  const double b31 = count_params(gemma4_preset("31b"));
  EXPECT_LT(rel(b31, 30.7e9), 0.01) << b31;
  const Gemma4Config moe = gemma4_preset("26b-a4b");
  const double b26 = count_params(moe);
  EXPECT_LT(rel(b26, 25.2e9), 0.01) << b26;
  const double experts = 30.0 * 128 * 3 * 704 * 2816;
  EXPECT_LT(rel(b26 - experts + experts * 8 / 128, 3.8e9), 0.02);
  const Gemma4Config e2b = gemma4_preset("e2b");
  const double ple_table = 262144.0 * 35 * 256;
  const double b2 = count_params(e2b);
  EXPECT_LT(rel(b2, 4.63e9), 0.01) << b2;
  EXPECT_LT(rel(b2 - ple_table, 2.3e9), 0.03) << b2 - ple_table;
  const double b4 = count_params(gemma4_preset("e4b"));
  EXPECT_LT(rel(b4, 7.46e9), 0.01) << b4;
  EXPECT_LT(rel(b4 - 262144.0 * 42 * 256, 4.5e9), 0.05) << b4;
}

TEST(Gemma4Presets, AssistantMirrorsTheTargetDonors) {
  for (const std::string& name : gemma4_preset_names()) {
    SCOPED_TRACE(name);
    const Gemma4Config target = gemma4_preset(name);
    const nlohmann::json a = gemma4_assistant_preset_json(name);
    EXPECT_EQ(a["model_type"], "gemma4_assistant");
    EXPECT_EQ(a["backbone_hidden_size"], target.hidden_size);
    EXPECT_EQ(a["use_ordered_embeddings"], name == "e2b" || name == "e4b");
    const Gemma4Config text = parse_gemma4_config(a["text_config"], "assistant:" + name);
    EXPECT_EQ(text.num_hidden_layers, 4);
    EXPECT_EQ(text.first_shared_layer, 0);  // every drafter layer reads the target's K/V
    EXPECT_EQ(text.vocab_size, target.vocab_size);
    EXPECT_FALSE(text.final_logit_softcapping.has_value());
    for (const LayerSpec& s : text.layers) {
      const LayerSpec& donor = target.layers[static_cast<size_t>(target.donor_of_type(s.type))];
      EXPECT_EQ(s.head_dim, donor.head_dim);
      EXPECT_EQ(s.n_kv_heads, donor.n_kv_heads);
      EXPECT_EQ(text.num_attention_heads % s.n_kv_heads, 0);
    }
  }
}

// tools/gpu/torch_bench.py builds its drafter from gemma4_assistant_preset_json while
// `specula bench --draft random` uses assistant_config_for: both must be the same shape.
TEST(Gemma4Presets, AssistantJsonAgreesWithAssistantConfigFor) {
  for (const std::string& name : gemma4_preset_names()) {
    SCOPED_TRACE(name);
    const nlohmann::json a = gemma4_assistant_preset_json(name);
    const Gemma4Config text = parse_gemma4_config(a["text_config"], "assistant:" + name);
    const assistant::AssistantConfig want = assistant::assistant_config_for(gemma4_preset(name));
    EXPECT_EQ(a["backbone_hidden_size"].get<int>(), want.backbone_hidden_size);
    EXPECT_EQ(a["use_ordered_embeddings"].get<bool>(), want.use_ordered_embeddings);
    EXPECT_EQ(a["num_centroids"].get<int>(), want.num_centroids);
    EXPECT_EQ(a["centroid_intermediate_top_k"].get<int>(), want.centroid_intermediate_top_k);
    const Gemma4Config& t = want.text;
    EXPECT_EQ(text.hidden_size, t.hidden_size);
    EXPECT_EQ(text.intermediate_size, t.intermediate_size);
    EXPECT_EQ(text.num_attention_heads, t.num_attention_heads);
    EXPECT_EQ(text.sliding_window, t.sliding_window);
    ASSERT_EQ(text.layers.size(), t.layers.size());
    for (size_t i = 0; i < t.layers.size(); ++i) {
      EXPECT_EQ(text.layers[i].type, t.layers[i].type) << i;
      EXPECT_EQ(text.layers[i].head_dim, t.layers[i].head_dim) << i;
      EXPECT_EQ(text.layers[i].n_kv_heads, t.layers[i].n_kv_heads) << i;
      EXPECT_EQ(text.layers[i].kv_shared, t.layers[i].kv_shared) << i;
    }
  }
}

TEST(Gemma4Presets, UnknownNameListsTheValidOnes) {
  try {
    gemma4_preset("70b");
    FAIL() << "no error";
  } catch (const Error& e) {
    const std::string msg = e.what();
    EXPECT_NE(msg.find("'70b'"), std::string::npos) << msg;
    for (const std::string& name : gemma4_preset_names())
      EXPECT_NE(msg.find(name), std::string::npos) << msg;
  }
  EXPECT_THROW(gemma4_preset_json(""), Error);
  EXPECT_THROW(gemma4_assistant_preset_json("E2B"), Error);  // names are lower case
}

}  // namespace
}  // namespace specula::gemma4
