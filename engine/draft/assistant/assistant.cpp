// SPDX-License-Identifier: Apache-2.0
#include "engine/draft/assistant/assistant.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <numeric>

#include "engine/io/json_util.h"
#include "engine/model/gemma4/gemma4.h"

namespace specula::assistant {
namespace {

std::string config_file(const std::string& path) {
  return std::filesystem::is_directory(path) ? path + "/config.json" : path;
}

const char* type_name(gemma4::LayerType t) {
  return t == gemma4::LayerType::kSliding ? "sliding_attention" : "full_attention";
}

}  // namespace

AssistantConfig load_assistant_config(const std::string& path) {
  const std::string file = config_file(path);
  const nlohmann::json root = io::read_json_file(file);
  if (!root.is_object()) fail("{}: expected a JSON object", file);
  const std::string model_type = root.value("model_type", std::string());
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
  const int n_layers = text.value("num_hidden_layers", 0);
  if (text.value("num_kv_shared_layers", 0) == 0) text["num_kv_shared_layers"] = n_layers;

  AssistantConfig c;
  c.text = gemma4::parse_gemma4_config(text, file + " (text_config)");
  auto get_int = [&](const char* field, int fallback) {
    if (!root.contains(field) || root[field].is_null()) return fallback;
    if (!root[field].is_number_integer())
      fail("{}: field '{}' must be an integer, got {}", file, field, root[field].dump());
    return root[field].get<int>();
  };
  c.backbone_hidden_size = get_int("backbone_hidden_size", 1536);
  c.use_ordered_embeddings = root.value("use_ordered_embeddings", false);
  c.num_centroids = get_int("num_centroids", 2048);
  c.centroid_intermediate_top_k = get_int("centroid_intermediate_top_k", 32);

  const gemma4::Gemma4Config& t = c.text;
  if (t.hidden_size_per_layer_input != 0) {
    fail("{}: text_config.hidden_size_per_layer_input must be 0 for an assistant drafter, got {}",
         file, t.hidden_size_per_layer_input);
  }
  if (t.enable_moe_block)
    fail("{}: text_config.enable_moe_block must be false for an assistant drafter", file);
  if (t.use_double_wide_mlp)
    fail("{}: text_config.use_double_wide_mlp must be false for an assistant drafter", file);
  if (t.num_kv_shared_layers != t.num_hidden_layers) {
    fail(
        "{}: text_config.num_kv_shared_layers ({}) must equal num_hidden_layers ({}) for an "
        "assistant drafter",
        file, t.num_kv_shared_layers, t.num_hidden_layers);
  }
  if (c.backbone_hidden_size <= 0)
    fail("{}: backbone_hidden_size must be positive, got {}", file, c.backbone_hidden_size);
  return c;
}

AssistantDrafter::~AssistantDrafter() = default;

std::unique_ptr<AssistantDrafter> AssistantDrafter::load(const std::string& path,
                                                         const gemma4::Gemma4Config& target,
                                                         Backend& backend) {
  std::unique_ptr<AssistantDrafter> d(new AssistantDrafter());
  d->config_ = load_assistant_config(path);
  d->backend_ = &backend;
  const AssistantConfig& c = d->config_;
  const gemma4::Gemma4Config& t = c.text;
  const std::string file = config_file(path);

  // The drafter reads the target's donor K/V and emits target tokens: its
  // geometry must mirror the target's donor layers.
  if (c.backbone_hidden_size != target.hidden_size) {
    fail("{}: backbone_hidden_size {} does not match the target's hidden_size {}", file,
         c.backbone_hidden_size, target.hidden_size);
  }
  if (t.vocab_size != target.vocab_size) {
    fail("{}: vocab_size {} does not match the target's vocab_size {}", file, t.vocab_size,
         target.vocab_size);
  }
  for (int i = 0; i < t.num_hidden_layers; ++i) {
    const gemma4::LayerSpec& mine = t.layers[static_cast<size_t>(i)];
    const int donor = target.donor_of_type(mine.type);
    if (donor < 0) {
      fail("{}: drafter layer {} attends to {} K/V but the target has no such donor layer", file, i,
           type_name(mine.type));
    }
    const gemma4::LayerSpec& theirs = target.layers[static_cast<size_t>(donor)];
    if (mine.head_dim != theirs.head_dim || mine.n_kv_heads != theirs.n_kv_heads) {
      fail(
          "{}: drafter layer {} ({}) expects head_dim {} with {} KV heads, but the target's donor "
          "layer {} has "
          "head_dim {} with {} KV heads",
          file, i, type_name(mine.type), mine.head_dim, mine.n_kv_heads, donor, theirs.head_dim,
          theirs.n_kv_heads);
    }
    if (t.num_attention_heads % theirs.n_kv_heads != 0) {
      fail("{}: drafter num_attention_heads {} is not a multiple of the target's {} KV heads", file,
           t.num_attention_heads, theirs.n_kv_heads);
    }
  }

  d->checkpoint_ = std::make_unique<io::Checkpoint>(path);
  const io::Checkpoint& ckpt = *d->checkpoint_;
  AssistantWeights& w = d->weights_;
  io::WeightTable table;
  const int64_t Ha = t.hidden_size, Hb = c.backbone_hidden_size;
  table.add("pre_projection.weight", {Ha, 2 * Hb}, &w.pre_projection);
  table.add("post_projection.weight", {Hb, Ha}, &w.post_projection);
  table.add("model.embed_tokens.weight", {t.vocab_size, Ha}, &w.embed_tokens);
  table.add("model.norm.weight", {Ha}, &w.norm);
  table.ignore("lm_head.weight");
  // The head is chosen by which tensors exist, as the shipped 12B/26B drafters
  // declare centroids in their config but ship none.
  const bool has_centroids = ckpt.contains("masked_embedding.centroids.weight");
  if (has_centroids) {
    if (c.num_centroids <= 0 || t.vocab_size % c.num_centroids != 0) {
      fail("{}: vocab_size {} is not divisible by num_centroids {}", file, t.vocab_size,
           c.num_centroids);
    }
    if (c.centroid_intermediate_top_k <= 0 || c.centroid_intermediate_top_k > c.num_centroids) {
      fail("{}: centroid_intermediate_top_k {} must be in [1, num_centroids={}]", file,
           c.centroid_intermediate_top_k, c.num_centroids);
    }
    table.add("masked_embedding.centroids.weight", {c.num_centroids, Ha}, &w.centroids);
    table.add_typed("masked_embedding.token_ordering", {t.vocab_size}, {DType::kI64, DType::kI32},
                    &w.token_ordering);
  } else {
    table.ignore("masked_embedding.token_ordering");
  }
  w.layers.resize(static_cast<size_t>(t.num_hidden_layers));
  for (int i = 0; i < t.num_hidden_layers; ++i) {
    const gemma4::LayerSpec& spec = t.layers[static_cast<size_t>(i)];
    AssistantLayerWeights& lw = w.layers[static_cast<size_t>(i)];
    const std::string lp = fmt::format("model.layers.{}.", i);
    const int64_t D = spec.head_dim, I = spec.intermediate_size, Nh = t.num_attention_heads;
    table.add(lp + "input_layernorm.weight", {Ha}, &lw.input_layernorm);
    table.add(lp + "post_attention_layernorm.weight", {Ha}, &lw.post_attention_layernorm);
    table.add(lp + "pre_feedforward_layernorm.weight", {Ha}, &lw.pre_feedforward_layernorm);
    table.add(lp + "post_feedforward_layernorm.weight", {Ha}, &lw.post_feedforward_layernorm);
    table.add(lp + "self_attn.q_proj.weight", {Nh * D, Ha}, &lw.q_proj);
    table.add(lp + "self_attn.q_norm.weight", {D}, &lw.q_norm);
    table.add(lp + "self_attn.o_proj.weight", {Ha, Nh * D}, &lw.o_proj);
    table.add(lp + "mlp.gate_proj.weight", {I, Ha}, &lw.gate_proj);
    table.add(lp + "mlp.up_proj.weight", {I, Ha}, &lw.up_proj);
    table.add(lp + "mlp.down_proj.weight", {Ha, I}, &lw.down_proj);
    table.add(lp + "layer_scalar", {1}, &lw.layer_scalar);
    for (const char* n :
         {"self_attn.k_proj.weight", "self_attn.v_proj.weight", "self_attn.k_norm.weight"}) {
      table.ignore(lp + n);
    }
  }
  table.bind(ckpt);

  for (int i = 0; i < t.num_hidden_layers; ++i) {
    d->layer_scalars_.push_back(host_scalar(w.layers[static_cast<size_t>(i)].layer_scalar,
                                            fmt::format("model.layers.{}.layer_scalar", i)));
  }
  if (has_centroids) {
    // Every token must appear exactly once, or a candidate id could fall outside the vocabulary.
    const int64_t V = t.vocab_size;
    d->ordering_.resize(static_cast<size_t>(V));
    std::vector<char> seen(static_cast<size_t>(V), 0);
    for (int64_t i = 0; i < V; ++i) {
      const int64_t id = w.token_ordering.dtype() == DType::kI64
                             ? w.token_ordering.data_as<const int64_t>()[i]
                             : w.token_ordering.data_as<const int32_t>()[i];
      if (id < 0 || id >= V || seen[static_cast<size_t>(id)]) {
        fail("{}: masked_embedding.token_ordering is not a permutation of [0, {}): entry {} is {}",
             ckpt.path(), V, i, id);
      }
      seen[static_cast<size_t>(id)] = 1;
      d->ordering_[static_cast<size_t>(i)] = static_cast<int32_t>(id);
    }
  }
  if (has_centroids) {
    const int64_t n_cand =
        int64_t{c.centroid_intermediate_top_k} * (t.vocab_size / c.num_centroids);
    d->candidates_ = HostTensor(DType::kI32, {n_cand});
    d->candidate_rows_ = HostTensor(DType::kF32, {n_cand, Ha});
    d->candidate_scores_ = HostTensor(DType::kF32, {1, n_cand});
    d->centroid_order_.resize(static_cast<size_t>(c.num_centroids));
  }
  d->inv_freq_sliding_ = gemma4::rope_inv_freq(t.rope_sliding, t.head_dim);
  d->inv_freq_full_ = gemma4::rope_inv_freq(t.rope_full, t.global_head_dim);
  return d;
}

std::string AssistantDrafter::head_description() const {
  if (centroid_head()) {
    return fmt::format(
        "centroid head ({} centroids, top-{}, {} candidates per step)", config_.num_centroids,
        config_.centroid_intermediate_top_k,
        config_.centroid_intermediate_top_k * (config_.text.vocab_size / config_.num_centroids));
  }
  return fmt::format("tied dense head over {} tokens", config_.text.vocab_size);
}

DraftStepOutputs AssistantDrafter::step(const DraftStepInputs& in, DonorAttention& donors) {
  Backend& be = *backend_;
  const gemma4::Gemma4Config& t = config_.text;
  const int64_t B = in.token_embeds.dim(0);
  const int64_t Hb = config_.backbone_hidden_size, Ha = t.hidden_size, Nh = t.num_attention_heads;
  const int64_t V = t.vocab_size;
  const float eps = static_cast<float>(t.rms_norm_eps);
  check_tensor(in.token_embeds, {B, Hb}, DType::kF32, "draft step token_embeds");
  check_tensor(in.hidden, {B, Hb}, DType::kF32, "draft step hidden");
  check_tensor(in.positions, {B}, DType::kI32, "draft step positions");
  int max_d = std::max(t.head_dim, t.global_head_dim), max_i = 0;
  for (const auto& l : t.layers) max_i = std::max(max_i, l.intermediate_size);

  struct Scratch {
    Tensor x_in, x, xn, o, q, attn, gate, up, h, next_hidden, logits, tokens;
  } s;
  auto carve = [&](Arena& a) {
    s.x_in = a.alloc(DType::kF32, {B, 2 * Hb});
    s.x = a.alloc(DType::kF32, {B, Ha});
    s.xn = a.alloc(DType::kF32, {B, Ha});
    s.o = a.alloc(DType::kF32, {B, Ha});
    s.q = a.alloc(DType::kF32, {B, Nh * max_d});
    s.attn = a.alloc(DType::kF32, {B, Nh * max_d});
    s.gate = a.alloc(DType::kF32, {B, max_i});
    s.up = a.alloc(DType::kF32, {B, max_i});
    s.h = a.alloc(DType::kF32, {B, Ha});
    s.next_hidden = a.alloc(DType::kF32, {B, Hb});
    s.logits = a.alloc(DType::kF32, {B, V});
    s.tokens = a.alloc(DType::kI32, {B});
  };
  Arena measure = Arena::measuring();
  carve(measure);
  if (measure.used() > arena_.capacity()) arena_ = Arena(measure.used() + measure.used() / 4);
  arena_.reset();
  carve(arena_);

  // [embedding ; hidden], embedding first (§11).
  for (int64_t b = 0; b < B; ++b) {
    be.copy(in.token_embeds.row(b), s.x_in.row(b).reshape({2, Hb}).row(0));
    be.copy(in.hidden.row(b), s.x_in.row(b).reshape({2, Hb}).row(1));
  }
  be.linear(s.x_in, weights_.pre_projection, s.x);

  for (int l = 0; l < t.num_hidden_layers; ++l) {
    const gemma4::LayerSpec& spec = t.layers[static_cast<size_t>(l)];
    const AssistantLayerWeights& w = weights_.layers[static_cast<size_t>(l)];
    const bool sliding = spec.type == gemma4::LayerType::kSliding;
    const int64_t D = spec.head_dim, I = spec.intermediate_size;
    be.rms_norm(s.x, w.input_layernorm, eps, s.xn);
    Tensor q(s.q.data(), DType::kF32, {B, Nh * D});
    be.linear(s.xn, w.q_proj, q);
    be.rms_norm(q.reshape({B * Nh, D}), w.q_norm, eps, q.reshape({B * Nh, D}));
    be.rope(q.reshape({B, Nh, D}), in.positions,
            sliding ? inv_freq_sliding_.view() : inv_freq_full_.view());
    Tensor attn(s.attn.data(), DType::kF32, {B, Nh, D});
    // transformers' drafter mask keeps the newest sliding_window + 1 sliding entries
    // (an inclusive |q - k| <= W overlay) and every full-attention entry.
    donors.attend(spec.type, q.reshape({B, Nh, D}), sliding ? t.sliding_window + 1 : 0, 1.0f, attn);
    be.linear(attn.reshape({B, Nh * D}), w.o_proj, s.o);
    be.rms_norm(s.o, w.post_attention_layernorm, eps, s.o);
    be.add(s.x, s.o, s.x);
    Tensor gate(s.gate.data(), DType::kF32, {B, I}), up(s.up.data(), DType::kF32, {B, I});
    be.rms_norm(s.x, w.pre_feedforward_layernorm, eps, s.xn);
    be.linear(s.xn, w.gate_proj, gate);
    be.linear(s.xn, w.up_proj, up);
    be.gelu_mul(gate, up, gate);
    be.linear(gate, w.down_proj, s.o);
    be.rms_norm(s.o, w.post_feedforward_layernorm, eps, s.o);
    be.add(s.x, s.o, s.x);
    be.scale(s.x, layer_scalars_[static_cast<size_t>(l)], s.x);
  }
  be.rms_norm(s.x, weights_.norm, eps, s.h);
  be.linear(s.h, weights_.post_projection, s.next_hidden);
  if (centroid_head()) {
    centroid_logits(s.h, s.logits);
  } else {
    be.linear(s.h, weights_.embed_tokens, s.logits);
  }
  be.argmax_rows(s.logits, s.tokens);
  return {.logits = s.logits, .tokens = s.tokens, .next_hidden = s.next_hidden};
}

// Centroid head (§10.3 step 5): score the centroids, keep the top-k clusters,
// score only their tokens, and fill every other logit with (min score − 1).
void AssistantDrafter::centroid_logits(const Tensor& h, const Tensor& logits) {
  Backend& be = *backend_;
  const int64_t B = h.dim(0), Ha = h.dim(1);
  const int64_t G = config_.num_centroids, K = config_.centroid_intermediate_top_k;
  const int64_t per = config_.text.vocab_size / G;
  if (centroid_scores_.view().empty() || centroid_scores_.shape()[0] < B) {
    centroid_scores_ = HostTensor(DType::kF32, {B, G});
  }
  Tensor scores = centroid_scores_.view().slice_rows(0, B);
  const HostTensor& cand = candidates_;
  const HostTensor& rows = candidate_rows_;
  const HostTensor& cand_scores = candidate_scores_;
  std::vector<int32_t>& order = centroid_order_;
  be.linear(h, weights_.centroids, scores);
  for (int64_t b = 0; b < B; ++b) {
    const float* sc = scores.data_as<const float>() + b * G;
    std::iota(order.begin(), order.end(), 0);
    // torch.topk order: descending score, lower index first among equals.
    std::partial_sort(order.begin(), order.begin() + K, order.end(),
                      [&](int32_t x, int32_t y) { return sc[x] != sc[y] ? sc[x] > sc[y] : x < y; });
    int32_t* ids = cand.data<int32_t>();
    for (int64_t k = 0; k < K; ++k) {
      std::memcpy(ids + k * per, ordering_.data() + order[static_cast<size_t>(k)] * per,
                  static_cast<size_t>(per) * sizeof(int32_t));
    }
    be.embedding(weights_.embed_tokens, cand, 1.0f, rows);
    be.linear(h.row(b).reshape({1, Ha}), rows, cand_scores);
    const float* cs = cand_scores.data<float>();
    const float fill = *std::min_element(cs, cs + K * per) - 1.0f;
    float* out = logits.data_as<float>() + b * config_.text.vocab_size;
    std::fill(out, out + config_.text.vocab_size, fill);
    for (int64_t j = 0; j < K * per; ++j) out[ids[j]] = cs[j];
  }
}

}  // namespace specula::assistant
