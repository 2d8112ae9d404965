// SPDX-License-Identifier: Apache-2.0
#include "engine/model/gemma4/weights.h"

#include <fmt/format.h>

namespace specula::gemma4 {

void declare_gemma4_weights(const Gemma4Config& c, Gemma4Weights* w, io::WeightTable* t) {
  const std::string& p = c.weight_prefix;
  const int64_t H = c.hidden_size;
  const int64_t L = c.num_hidden_layers;
  const int64_t P = c.hidden_size_per_layer_input;

  t->add(p + "embed_tokens.weight", {c.vocab_size, H}, &w->embed_tokens);
  t->add(p + "norm.weight", {H}, &w->norm);
  if (P > 0) {
    t->add(p + "embed_tokens_per_layer.weight", {c.vocab_size_per_layer_input, L * P},
           &w->embed_tokens_per_layer);
    t->add(p + "per_layer_model_projection.weight", {L * P, H}, &w->per_layer_model_projection);
    t->add(p + "per_layer_projection_norm.weight", {P}, &w->per_layer_projection_norm);
  }
  // Tied checkpoints sometimes still carry the head; the model always uses embed_tokens.
  t->ignore("lm_head.weight");
  // The multimodal wrapper's towers and embedders are not part of the text decoder.
  for (const char* tower : {"model.vision_tower.", "model.audio_tower.", "model.embed_vision.",
                            "model.embed_audio.", "model.multi_modal_projector."}) {
    t->ignore_prefix(tower);
  }

  w->layers.resize(static_cast<size_t>(L));
  for (int64_t i = 0; i < L; ++i) {
    const LayerSpec& spec = c.layers[static_cast<size_t>(i)];
    Gemma4LayerWeights& lw = w->layers[static_cast<size_t>(i)];
    const std::string lp = fmt::format("{}layers.{}.", p, i);
    const int64_t D = spec.head_dim;
    const int64_t I = spec.intermediate_size;
    t->add(lp + "input_layernorm.weight", {H}, &lw.input_layernorm);
    t->add(lp + "post_attention_layernorm.weight", {H}, &lw.post_attention_layernorm);
    t->add(lp + "pre_feedforward_layernorm.weight", {H}, &lw.pre_feedforward_layernorm);
    t->add(lp + "post_feedforward_layernorm.weight", {H}, &lw.post_feedforward_layernorm);
    t->add(lp + "self_attn.q_proj.weight", {c.num_attention_heads * D, H}, &lw.q_proj);
    t->add(lp + "self_attn.q_norm.weight", {D}, &lw.q_norm);
    t->add(lp + "self_attn.o_proj.weight", {H, c.num_attention_heads * D}, &lw.o_proj);
    if (spec.kv_shared) {
      // Shared layers read their donor's K/V; checkpoint copies are ignored (§5).
      for (const char* n : {"self_attn.k_proj.weight", "self_attn.v_proj.weight",
                            "self_attn.k_norm.weight", "self_attn.v_norm.weight"}) {
        t->ignore(lp + n);
      }
    } else {
      t->add(lp + "self_attn.k_proj.weight", {spec.n_kv_heads * D, H}, &lw.k_proj);
      t->add(lp + "self_attn.k_norm.weight", {D}, &lw.k_norm);
      if (!spec.k_eq_v)
        t->add(lp + "self_attn.v_proj.weight", {spec.n_kv_heads * D, H}, &lw.v_proj);
    }
    t->add(lp + "mlp.gate_proj.weight", {I, H}, &lw.gate_proj);
    t->add(lp + "mlp.up_proj.weight", {I, H}, &lw.up_proj);
    t->add(lp + "mlp.down_proj.weight", {H, I}, &lw.down_proj);
    t->add(lp + "layer_scalar", {1}, &lw.layer_scalar);
    if (P > 0) {
      t->add(lp + "per_layer_input_gate.weight", {P, H}, &lw.per_layer_input_gate);
      t->add(lp + "per_layer_projection.weight", {H, P}, &lw.per_layer_projection);
      t->add(lp + "post_per_layer_input_norm.weight", {H}, &lw.post_per_layer_input_norm);
    }
    if (c.enable_moe_block) {
      const int64_t E = c.num_experts;
      const int64_t Im = c.moe_intermediate_size;
      t->add(lp + "router.proj.weight", {E, H}, &lw.router_proj);
      t->add(lp + "router.scale", {H}, &lw.router_scale);
      t->add(lp + "router.per_expert_scale", {E}, &lw.router_per_expert_scale);
      t->add(lp + "experts.gate_up_proj", {E, 2 * Im, H}, &lw.experts_gate_up);
      t->add(lp + "experts.down_proj", {E, H, Im}, &lw.experts_down);
      t->add(lp + "pre_feedforward_layernorm_2.weight", {H}, &lw.pre_feedforward_layernorm_2);
      t->add(lp + "post_feedforward_layernorm_1.weight", {H}, &lw.post_feedforward_layernorm_1);
      t->add(lp + "post_feedforward_layernorm_2.weight", {H}, &lw.post_feedforward_layernorm_2);
    }
  }
}

}  // namespace specula::gemma4
