// SPDX-License-Identifier: Apache-2.0
#include "engine/model/gemma4/weights.h"

#include <algorithm>
#include <cmath>

#include <fmt/format.h>

#include "engine/io/quantize.h"

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

namespace {

size_t aligned_bytes(size_t n) {
  return (n + 255) / 256 * 256;
}

bool is_float(DType d) {
  return d == DType::kF32 || d == DType::kBF16 || d == DType::kF16;
}

}  // namespace

DeviceBuffer place_weights(const io::WeightTable& table, Backend& backend,
                           const io::Checkpoint* scan) {
  // Quantized weights: the codes (fp8 has NaN codes) and their f32 scales.
  auto check = [&](const io::WeightTable::Entry& e) {
    if (scan == nullptr || e.field->empty()) return;
    if (e.field->scale_data() != nullptr) {
      const std::string name = e.name + io::kScaleSuffix;
      io::check_finite(e.field->scales(), name, scan->file_of(name));
    }
    io::check_finite(*e.field, e.name, scan->file_of(e.name));
  };
  if (backend.device().is_cpu()) {
    for (const io::WeightTable::Entry& e : table.entries()) check(e);
    return {};
  }
  size_t total = 0;
  for (const io::WeightTable::Entry& e : table.entries()) {
    if (!e.field->empty()) total += aligned_bytes(e.field->nbytes());
    if (e.field->scale_data() != nullptr) total += aligned_bytes(e.field->scales().nbytes());
  }
  DeviceBuffer buffer(backend, std::max<size_t>(total, 1));
  size_t offset = 0;
  for (const io::WeightTable::Entry& e : table.entries()) {
    Tensor& field = *e.field;
    if (field.empty()) continue;
    check(e);
    Tensor dst(static_cast<char*>(buffer.data()) + offset, field.dtype(), field.shape(),
               backend.device());
    backend.upload(field.data(), dst);
    offset += aligned_bytes(dst.nbytes());
    if (field.scale_data() != nullptr) {
      const Tensor scales = field.scales();
      Tensor dst_scales(static_cast<char*>(buffer.data()) + offset, DType::kF32, scales.shape(),
                        backend.device());
      backend.upload(scales.data(), dst_scales);
      offset += aligned_bytes(dst_scales.nbytes());
      dst = dst.with_scales(dst_scales.data_as<const float>());
    }
    field = dst;
  }
  return buffer;
}

DeviceBuffer random_weights(const io::WeightTable& table, Backend& backend, uint64_t seed,
                            DType dtype) {
  auto wanted = [&](const io::WeightTable::Entry& e) {
    for (DType d : e.dtypes)
      if (is_float(d)) return true;
    return false;
  };
  size_t total = 0;
  for (const io::WeightTable::Entry& e : table.entries()) {
    if (wanted(e)) total += aligned_bytes(static_cast<size_t>(e.shape.numel()) * dtype_size(dtype));
  }
  DeviceBuffer buffer(backend, std::max<size_t>(total, 1));
  size_t offset = 0;
  uint64_t index = 0;
  for (const io::WeightTable::Entry& e : table.entries()) {
    ++index;
    if (!wanted(e)) {
      *e.field = Tensor();
      continue;
    }
    Tensor t(static_cast<char*>(buffer.data()) + offset, dtype, e.shape, backend.device());
    offset += aligned_bytes(t.nbytes());
    if (e.shape.rank() <= 1) {
      backend.fill_uniform(t, seed + index, 0.9f, 1.1f);
    } else {
      const float fan_in = static_cast<float>(e.shape[e.shape.rank() - 1]);
      const float bound = std::sqrt(3.0f / fan_in);
      backend.fill_uniform(t, seed + index, -bound, bound);
    }
    *e.field = t;
  }
  backend.synchronize();
  return buffer;
}

DeviceBuffer quantize_weights(const io::WeightTable& table, Backend& backend, DType dtype) {
  auto quantize = [&](const io::WeightTable::Entry& e) {
    return e.quantizable && !e.field->empty() && is_float(e.field->dtype()) && e.field->rank() == 2;
  };
  size_t total = 0;
  for (const io::WeightTable::Entry& e : table.entries()) {
    if (e.field->empty()) continue;
    if (quantize(e)) {
      total += aligned_bytes(static_cast<size_t>(e.field->numel())) +
               aligned_bytes(static_cast<size_t>(e.field->dim(0)) * sizeof(float));
    } else {
      total += aligned_bytes(e.field->nbytes());
      if (e.field->scale_data() != nullptr) total += aligned_bytes(e.field->scales().nbytes());
    }
  }
  DeviceBuffer buffer(backend, std::max<size_t>(total, 1));
  size_t offset = 0;
  auto carve = [&](DType d, const Shape& shape) {
    Tensor t(static_cast<char*>(buffer.data()) + offset, d, shape, backend.device());
    offset += aligned_bytes(t.nbytes());
    return t;
  };
  for (const io::WeightTable::Entry& e : table.entries()) {
    Tensor& field = *e.field;
    if (field.empty()) continue;
    if (!quantize(e)) {
      Tensor dst = carve(field.dtype(), field.shape());
      backend.copy(field, dst);
      if (field.scale_data() != nullptr) {
        const Tensor scales = carve(DType::kF32, field.scales().shape());
        backend.copy(field.scales(), scales);
        dst = dst.with_scales(scales.data_as<const float>());
      }
      field = dst;
      continue;
    }
    HostTensor host(field.dtype(), field.shape());
    backend.download(field, host.view().data());
    const io::QuantizedMatrix q = io::quantize_rows(host, dtype, e.name);
    const Tensor codes = carve(dtype, field.shape());
    const Tensor scales = carve(DType::kF32, q.scales.shape());
    backend.upload(q.q.view().data(), codes);
    backend.upload(q.scales.view().data(), scales);
    field = codes.with_scales(scales.data_as<const float>());
  }
  backend.synchronize();
  return buffer;
}

float read_scalar(Backend& backend, const Tensor& t, const std::string& what) {
  if (t.device().is_cpu()) return host_scalar(t, what);
  if (t.numel() != 1) fail("{}: expected one element, got {}", what, t.describe());
  uint32_t raw = 0;
  backend.download(t, &raw);
  return host_scalar(Tensor(&raw, t.dtype(), t.shape()), what);
}

}  // namespace specula::gemma4
