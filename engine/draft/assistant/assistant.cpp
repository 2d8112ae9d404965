// SPDX-License-Identifier: Apache-2.0
#include "engine/draft/assistant/assistant.h"

#include <algorithm>
#include <climits>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <numeric>

#include "engine/io/json_util.h"
#include "engine/model/gemma4/gemma4.h"
#include "engine/model/gemma4/weights.h"

namespace specula::assistant {
namespace {

// Declares every weight the drafter reads (§10.2) into `table`, bound to `w`.
// Tensors it never reads are declared ignored. Matrices (projections, MLP, the
// embedding / tied head, the centroids) may be stored quantized (add_matrix);
// norms and layer scalars may not.
void declare_assistant_weights(const AssistantConfig& c, bool centroids, AssistantWeights* w,
                               io::WeightTable* table) {
  const gemma4::Gemma4Config& t = c.text;
  const int64_t Ha = t.hidden_size, Hb = c.backbone_hidden_size;
  table->add_matrix("pre_projection.weight", {Ha, 2 * Hb}, &w->pre_projection);
  table->add_matrix("post_projection.weight", {Hb, Ha}, &w->post_projection);
  table->add_matrix("model.embed_tokens.weight", {t.vocab_size, Ha}, &w->embed_tokens);
  table->add("model.norm.weight", {Ha}, &w->norm);
  table->ignore("lm_head.weight");
  if (centroids) {
    table->add_matrix("masked_embedding.centroids.weight", {c.num_centroids, Ha}, &w->centroids);
    table->add_typed("masked_embedding.token_ordering", {t.vocab_size}, {DType::kI64, DType::kI32},
                     &w->token_ordering);
  } else {
    table->ignore("masked_embedding.token_ordering");
  }
  w->layers.resize(static_cast<size_t>(t.num_hidden_layers));
  for (int i = 0; i < t.num_hidden_layers; ++i) {
    const gemma4::LayerSpec& spec = t.layers[static_cast<size_t>(i)];
    AssistantLayerWeights& lw = w->layers[static_cast<size_t>(i)];
    const std::string lp = fmt::format("model.layers.{}.", i);
    const int64_t D = spec.head_dim, I = spec.intermediate_size, Nh = t.num_attention_heads;
    table->add(lp + "input_layernorm.weight", {Ha}, &lw.input_layernorm);
    table->add(lp + "post_attention_layernorm.weight", {Ha}, &lw.post_attention_layernorm);
    table->add(lp + "pre_feedforward_layernorm.weight", {Ha}, &lw.pre_feedforward_layernorm);
    table->add(lp + "post_feedforward_layernorm.weight", {Ha}, &lw.post_feedforward_layernorm);
    table->add_matrix(lp + "self_attn.q_proj.weight", {Nh * D, Ha}, &lw.q_proj);
    table->add(lp + "self_attn.q_norm.weight", {D}, &lw.q_norm);
    table->add_matrix(lp + "self_attn.o_proj.weight", {Ha, Nh * D}, &lw.o_proj);
    table->add_matrix(lp + "mlp.gate_proj.weight", {I, Ha}, &lw.gate_proj);
    table->add_matrix(lp + "mlp.up_proj.weight", {I, Ha}, &lw.up_proj);
    table->add_matrix(lp + "mlp.down_proj.weight", {Ha, I}, &lw.down_proj);
    table->add(lp + "layer_scalar", {1}, &lw.layer_scalar);
    for (const char* n :
         {"self_attn.k_proj.weight", "self_attn.v_proj.weight", "self_attn.k_norm.weight"}) {
      table->ignore(lp + n);
    }
  }
}

// SplitMix64 (Steele et al.): a tiny, portable generator, so that a seeded
// random drafter's token ordering is the same with every standard library.
uint64_t splitmix64(uint64_t* state) {
  uint64_t z = (*state += 0x9E3779B97F4A7C15ull);
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}

}  // namespace

std::vector<std::string> assistant_matrix_names(const std::string& path) {
  const AssistantConfig c = load_assistant_config(path);
  const io::Checkpoint ckpt(path);
  AssistantWeights w;
  io::WeightTable table;
  declare_assistant_weights(c, ckpt.contains("masked_embedding.centroids.weight"), &w, &table);
  return table.matrix_names();
}

AssistantModel::~AssistantModel() = default;

std::unique_ptr<AssistantModel> AssistantModel::load(const std::string& path,
                                                     const gemma4::Gemma4Config& target,
                                                     Backend& backend, bool scan_weights) {
  std::unique_ptr<AssistantModel> d(new AssistantModel());
  d->config_ = load_assistant_config(path);
  d->backend_ = &backend;
  const AssistantConfig& c = d->config_;
  const gemma4::Gemma4Config& t = c.text;
  const std::string file = assistant_config_path(path);
  check_against_target(c, target, file);

  d->checkpoint_ = std::make_unique<io::Checkpoint>(path);
  const io::Checkpoint& ckpt = *d->checkpoint_;
  AssistantWeights& w = d->weights_;
  io::WeightTable table;
  // The head is chosen by which tensors exist, as the shipped 12B/26B drafters
  // declare centroids in their config but ship none.
  const bool has_centroids = ckpt.contains("masked_embedding.centroids.weight");
  if (has_centroids) check_centroids(c, file);
  declare_assistant_weights(c, has_centroids, &w, &table);
  table.bind(ckpt);

  if (has_centroids) {
    // Every token must appear exactly once, or a candidate id could fall outside the vocabulary.
    // Read here, from the mapped checkpoint, and kept on the host only.
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
    w.token_ordering = Tensor();
  }
  d->weight_buffer_ = gemma4::place_weights(table, backend, scan_weights ? &ckpt : nullptr);
  d->init_after_weights();
  return d;
}

std::unique_ptr<AssistantModel> AssistantModel::random(const AssistantConfig& config,
                                                       const gemma4::Gemma4Config& target,
                                                       Backend& backend, uint64_t seed,
                                                       bool centroid_head, DType weight_dtype) {
  const std::string origin = fmt::format("random assistant drafter (seed {})", seed);
  std::unique_ptr<AssistantModel> d(new AssistantModel());
  d->config_ = config;
  d->backend_ = &backend;
  const AssistantConfig& c = d->config_;
  check_assistant_text(c, origin);
  check_against_target(c, target, origin);
  if (centroid_head) check_centroids(c, origin);
  io::WeightTable table;
  declare_assistant_weights(c, centroid_head, &d->weights_, &table);
  // token_ordering (integer) is left empty by random_weights: the permutation is host-only.
  d->weight_buffer_ = gemma4::random_weights(table, backend, seed, DType::kBF16);
  if (is_quantized(weight_dtype))
    d->weight_buffer_ = gemma4::quantize_weights(table, backend, weight_dtype);
  if (centroid_head) {
    // Fisher-Yates over the vocabulary with a stream of its own (the weights use seed + i).
    const int64_t V = c.text.vocab_size;
    d->ordering_.resize(static_cast<size_t>(V));
    std::iota(d->ordering_.begin(), d->ordering_.end(), 0);
    uint64_t state = seed ^ 0x5EED0D0E5EED0D0Eull;
    for (int64_t i = V - 1; i > 0; --i) {
      const int64_t j = static_cast<int64_t>(splitmix64(&state) % static_cast<uint64_t>(i + 1));
      std::swap(d->ordering_[static_cast<size_t>(i)], d->ordering_[static_cast<size_t>(j)]);
    }
  }
  d->init_after_weights();
  return d;
}

void AssistantModel::init_after_weights() {
  Backend& be = *backend_;
  const AssistantConfig& c = config_;
  const gemma4::Gemma4Config& t = c.text;
  layer_scalars_.clear();
  for (int i = 0; i < t.num_hidden_layers; ++i) {
    layer_scalars_.push_back(
        gemma4::read_scalar(be, weights_.layers[static_cast<size_t>(i)].layer_scalar,
                            fmt::format("model.layers.{}.layer_scalar", i)));
  }
  // RoPE tables: computed on the host, one upload into one device buffer.
  const HostTensor sliding = gemma4::rope_inv_freq(t.rope_sliding, t.head_dim);
  const HostTensor full = gemma4::rope_inv_freq(t.rope_full, t.global_head_dim);
  const size_t sliding_bytes = (sliding.view().nbytes() + 255) / 256 * 256;
  inv_freq_buffer_ = DeviceBuffer(be, sliding_bytes + full.view().nbytes());
  inv_freq_sliding_ = inv_freq_buffer_.view(DType::kF32, sliding.shape());
  inv_freq_full_ = Tensor(static_cast<char*>(inv_freq_buffer_.data()) + sliding_bytes, DType::kF32,
                          full.shape(), be.device());
  be.upload(sliding.view().data(), inv_freq_sliding_);
  be.upload(full.view().data(), inv_freq_full_);

  // Products' reduction widths: 2·Hb (pre_projection), Ha, Nh·D (o_proj), I (down_proj).
  int64_t max_width = std::max<int64_t>(2 * int64_t{c.backbone_hidden_size}, t.hidden_size);
  max_width = std::max<int64_t>(
      max_width, int64_t{t.num_attention_heads} * std::max(t.head_dim, t.global_head_dim));
  for (const gemma4::LayerSpec& l : t.layers)
    max_width = std::max<int64_t>(max_width, l.intermediate_size);
  be.reserve_scratch(0, max_width);
  if (centroid_head()) {
    // The token ordering on the device as [G, V/G]: row g lists centroid g's tokens.
    const int64_t G = c.num_centroids, per = t.vocab_size / G;
    ordering_buffer_ = DeviceBuffer(be, ordering_.size() * sizeof(int32_t));
    ordering_device_ = ordering_buffer_.view(DType::kI32, {G, per});
    be.upload(ordering_.data(), ordering_device_);
  }
}

std::string AssistantModel::head_description() const {
  if (centroid_head()) {
    return fmt::format(
        "centroid head ({} centroids, top-{}, {} candidates per step)", config_.num_centroids,
        config_.centroid_intermediate_top_k,
        config_.centroid_intermediate_top_k * (config_.text.vocab_size / config_.num_centroids));
  }
  return fmt::format("tied dense head over {} tokens", config_.text.vocab_size);
}

// Device scratch of the centroid head for one step (carved from the step arena).
struct AssistantModel::CentroidScratch {
  Tensor scores;            // f32 [B, G]
  Tensor top;               // i32 [B, K]: the best centroids, best first
  Tensor candidates;        // i32 [B, K · V/G]
  Tensor candidate_rows;    // f32 [K · V/G, Ha], reused row after row
  Tensor candidate_scores;  // f32 [B, K · V/G]
};

DraftStepOutputs AssistantModel::step(const DraftStepInputs& in, DonorAttention& donors) {
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
  const bool centroids = centroid_head();
  const int64_t G = config_.num_centroids;
  const int64_t n_cand = centroids ? int64_t{config_.centroid_intermediate_top_k} * (V / G) : 0;

  struct Scratch {
    Tensor stacked, x_in, x, xn, o, q, attn, gate, up, h, next_hidden, logits, tokens;
  } s;
  CentroidScratch cs;
  auto carve = [&](Arena& a) {
    s.stacked = a.alloc(DType::kF32, {2, B, Hb});
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
    if (centroids) {
      cs.scores = a.alloc(DType::kF32, {B, G});
      cs.top = a.alloc(DType::kI32, {B, int64_t{config_.centroid_intermediate_top_k}});
      cs.candidates = a.alloc(DType::kI32, {B, n_cand});
      cs.candidate_rows = a.alloc(DType::kF32, {n_cand, Ha});
      cs.candidate_scores = a.alloc(DType::kF32, {B, n_cand});
    }
  };
  Arena measure = Arena::measuring();
  carve(measure);
  if (measure.used() > arena_.capacity()) {
    arena_ = Arena(measure.used() + measure.used() / 4, backend_);
  }
  arena_.reset();
  carve(arena_);

  // [embedding ; hidden], embedding first (§11): stack both as [2, B, Hb] and
  // swap the leading axes into [B, 2, Hb] (three ops whatever B is).
  be.copy(in.token_embeds, s.stacked.row(0));
  be.copy(in.hidden, s.stacked.row(1));
  be.transpose01(s.stacked, s.x_in.reshape({B, 2, Hb}));
  be.linear(s.x_in, weights_.pre_projection, s.x);

  // Fused forms of the same ops (each equals its composition bit for bit): the
  // last residual update of a layer also takes the next layer's input norm, or
  // the final norm after the last layer.
  be.rms_norm(s.x, weights_.layers.front().input_layernorm, eps, s.xn);
  for (int l = 0; l < t.num_hidden_layers; ++l) {
    const gemma4::LayerSpec& spec = t.layers[static_cast<size_t>(l)];
    const AssistantLayerWeights& w = weights_.layers[static_cast<size_t>(l)];
    const bool sliding = spec.type == gemma4::LayerType::kSliding;
    const int64_t D = spec.head_dim, I = spec.intermediate_size;
    Tensor q(s.q.data(), DType::kF32, {B, Nh * D}, s.q.device());
    be.linear(s.xn, w.q_proj, q);
    be.attention_inputs({.q = q.reshape({B, Nh, D}),
                         .q_norm = w.q_norm,
                         .positions = in.positions,
                         .inv_freq = sliding ? inv_freq_sliding_ : inv_freq_full_,
                         .eps = eps});
    Tensor attn(s.attn.data(), DType::kF32, {B, Nh, D}, s.attn.device());
    // transformers' drafter mask keeps the newest sliding_window + 1 sliding entries
    // (an inclusive |q - k| <= W overlay) and every full-attention entry.
    donors.attend(spec.type, q.reshape({B, Nh, D}), sliding ? t.sliding_window + 1 : 0, 1.0f, attn);
    be.linear(attn.reshape({B, Nh * D}), w.o_proj, s.o);
    be.rms_norm_add_norm(s.o, w.post_attention_layernorm, eps, s.x, 1.0f,
                         w.pre_feedforward_layernorm, s.xn);
    Tensor gate(s.gate.data(), DType::kF32, {B, I}, s.gate.device());
    Tensor up(s.up.data(), DType::kF32, {B, I}, s.up.device());
    be.linear_gelu_mul(s.xn, w.gate_proj, w.up_proj, gate, up);
    be.linear(gate, w.down_proj, s.o);
    const bool last = l + 1 == t.num_hidden_layers;
    be.rms_norm_add_norm(
        s.o, w.post_feedforward_layernorm, eps, s.x, layer_scalars_[static_cast<size_t>(l)],
        last ? weights_.norm : weights_.layers[static_cast<size_t>(l) + 1].input_layernorm,
        last ? s.h : s.xn);
  }
  be.linear(s.h, weights_.post_projection, s.next_hidden);
  if (centroids) {
    centroid_logits(s.h, cs, s.logits);
  } else {
    be.linear(s.h, weights_.embed_tokens, s.logits);
  }
  be.argmax_rows(s.logits, s.tokens);
  return {.logits = s.logits, .tokens = s.tokens, .next_hidden = s.next_hidden};
}

// Centroid head (§10.3 step 5): score the centroids, keep the top-k clusters,
// score only their tokens, and fill every other logit with (min score − 1).
//
// Every stage is a backend op (nothing is read back, so the step can be
// recorded): top_k_rows picks the clusters in torch.topk order, gather_rows
// expands them into candidate ids through the token ordering, each row's
// candidates are embedded and scored, and fill_scatter_rows spreads the scores.
void AssistantModel::centroid_logits(const Tensor& h, const CentroidScratch& s,
                                     const Tensor& logits) {
  Backend& be = *backend_;
  const int64_t B = h.dim(0), Ha = h.dim(1);
  const int64_t V = config_.text.vocab_size;
  const int64_t G = config_.num_centroids, K = config_.centroid_intermediate_top_k;
  const int64_t per = V / G, n_cand = K * per;

  be.linear(h, weights_.centroids, s.scores);
  be.top_k_rows(s.scores, s.top);
  be.gather_rows(ordering_device_, s.top.reshape({B * K}), s.candidates.reshape({B * K, per}));
  for (int64_t b = 0; b < B; ++b) {
    be.embedding(weights_.embed_tokens, s.candidates.row(b), 1.0f, s.candidate_rows);
    be.linear(h.row(b).reshape({1, Ha}), s.candidate_rows,
              s.candidate_scores.row(b).reshape({1, n_cand}));
  }
  be.fill_scatter_rows(s.candidate_scores, s.candidates, logits);
}

}  // namespace specula::assistant
