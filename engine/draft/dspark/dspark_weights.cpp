// SPDX-License-Identifier: Apache-2.0
#include "engine/draft/dspark/dspark_weights.h"

#include <fmt/format.h>

namespace specula::dspark {
namespace {

void declare_heads(const DSparkConfig& c, int64_t V, const char* w1, const char* w2,
                   const char* conf_w, const char* conf_b, DSparkWeights* w,
                   io::WeightTable* table) {
  const int64_t r = c.markov_rank;
  if (r > 0) {
    table->add_matrix(w1, {V, r}, &w->markov_w1);
    table->add_matrix(w2, {V, r}, &w->markov_w2);
  }
  if (c.confidence_head) {
    const int64_t in = c.hidden_size + (c.confidence_with_markov ? r : 0);
    table->add(conf_w, {1, in}, &w->confidence_weight);
    table->add(conf_b, {1}, &w->confidence_bias);
  }
}

void declare_specula(const DSparkConfig& c, int64_t H, int64_t V, DSparkWeights* w,
                     io::WeightTable* table) {
  const int64_t d = c.hidden_size, F = c.intermediate_size, G = c.block_size;
  const int64_t m = static_cast<int64_t>(c.taps.size());
  w->layers.resize(static_cast<size_t>(c.num_layers));
  for (int i = 0; i < c.num_layers; ++i) {
    DSparkLayerWeights& l = w->layers[static_cast<size_t>(i)];
    const std::string p = fmt::format("layers.{}.", i);
    table->add(p + "attn_norm", {d}, &l.attn_norm);
    table->add_matrix(p + "q_proj", {d, d}, &l.q_proj);
    table->add_matrix(p + "k_proj", {d, d}, &l.k_proj);
    table->add_matrix(p + "v_proj", {d, d}, &l.v_proj);
    table->add_matrix(p + "o_proj", {d, d}, &l.o_proj);
    table->add(p + "ffn_norm", {d}, &l.ffn_norm);
    table->add_matrix(p + "gate_proj", {F, d}, &l.gate_proj);
    table->add_matrix(p + "up_proj", {F, d}, &l.up_proj);
    table->add_matrix(p + "down_proj", {d, F}, &l.down_proj);
  }
  table->add_matrix("context_proj", {d, m * H}, &w->context_proj);
  table->add("context_norm", {d}, &w->context_norm);
  table->add_matrix("token_proj", {d, H}, &w->token_proj);
  if (G > 1) table->add("mask_embed", {G - 1, d}, &w->mask_embed);
  table->add("block_pos", {G, d}, &w->block_pos);
  table->add("out_norm", {d}, &w->out_norm);
  table->add_matrix("out_proj", {H, d}, &w->out_proj);
  declare_heads(c, V, "markov.w1", "markov.w2", "confidence.weight", "confidence.bias", w, table);
}

void declare_deepspec(const DSparkConfig& c, int64_t H, int64_t V, DSparkWeights* w,
                      io::WeightTable* table) {
  const int64_t Nh = c.num_heads, KV = c.num_kv_heads, D = c.head_dim, F = c.intermediate_size;
  const int64_t m = static_cast<int64_t>(c.taps.size());
  w->layers.resize(static_cast<size_t>(c.num_layers));
  for (int i = 0; i < c.num_layers; ++i) {
    DSparkLayerWeights& l = w->layers[static_cast<size_t>(i)];
    const std::string p = fmt::format("layers.{}.", i);
    table->add_matrix(p + "self_attn.q_proj.weight", {Nh * D, H}, &l.q_proj);
    table->add_matrix(p + "self_attn.k_proj.weight", {KV * D, H}, &l.k_proj);
    if (!c.k_eq_v) table->add_matrix(p + "self_attn.v_proj.weight", {KV * D, H}, &l.v_proj);
    table->add_matrix(p + "self_attn.o_proj.weight", {H, Nh * D}, &l.o_proj);
    table->add(p + "self_attn.q_norm.weight", {D}, &l.q_norm);
    table->add(p + "self_attn.k_norm.weight", {D}, &l.k_norm);
    table->add_matrix(p + "mlp.gate_proj.weight", {F, H}, &l.gate_proj);
    table->add_matrix(p + "mlp.up_proj.weight", {F, H}, &l.up_proj);
    table->add_matrix(p + "mlp.down_proj.weight", {H, F}, &l.down_proj);
    table->add(p + "input_layernorm.weight", {H}, &l.input_layernorm);
    table->add(p + "post_attention_layernorm.weight", {H}, &l.post_attention_layernorm);
    table->add(p + "pre_feedforward_layernorm.weight", {H}, &l.pre_feedforward_layernorm);
    table->add(p + "post_feedforward_layernorm.weight", {H}, &l.post_feedforward_layernorm);
    table->add(p + "layer_scalar", {1}, &l.layer_scalar);
  }
  table->add_matrix("fc.weight", {H, m * H}, &w->context_proj);
  table->add("hidden_norm.weight", {H}, &w->context_norm);
  table->add("norm.weight", {H}, &w->out_norm);
  table->add_matrix("embed_tokens.weight", {V, H}, &w->embed_tokens, /*required=*/false);
  table->add_matrix("lm_head.weight", {V, H}, &w->lm_head, /*required=*/false);
  declare_heads(c, V, "markov_head.markov_w1.weight", "markov_head.markov_w2.weight",
                "confidence_head.proj.weight", "confidence_head.proj.bias", w, table);
}

}  // namespace

void declare_dspark_weights(const DSparkConfig& c, int64_t target_hidden, int64_t vocab,
                            DSparkWeights* w, io::WeightTable* table) {
  if (c.layout == DSparkLayout::kSpecula) {
    declare_specula(c, target_hidden, vocab, w, table);
  } else {
    declare_deepspec(c, target_hidden, vocab, w, table);
  }
}

std::vector<std::string> dspark_matrix_names(const std::string& dir) {
  const DSparkConfig c = load_dspark_config(dir);
  // Names do not depend on sizes; the target's H and V come from the config.
  const bool specula = c.layout == DSparkLayout::kSpecula;
  const int64_t H = specula ? c.target.hidden_size : c.hidden_size;
  const int64_t V = specula ? c.target.vocab_size : c.text.vocab_size;
  DSparkWeights w;
  io::WeightTable table;
  declare_dspark_weights(c, H, V, &w, &table);
  return table.matrix_names();
}

}  // namespace specula::dspark
