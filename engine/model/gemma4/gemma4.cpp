// SPDX-License-Identifier: Apache-2.0
#include "engine/model/gemma4/gemma4.h"

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <string>

namespace specula::gemma4 {
namespace {

// Rounds a scale the way HF does before multiplying a table of `dtype`:
// torch.tensor(scale).to(weight.dtype).
float round_to_dtype(float v, DType dtype) {
  switch (dtype) {
    case DType::kBF16:
      return bf16_to_f32(f32_to_bf16(v));
    case DType::kF16:
      return f16_to_f32(f32_to_f16(v));
    default:
      return v;
  }
}

// Whether every weight a product reads is bf16 (the rule of
// Gemma4Model::fast_prefill()); absent tensors (shared layers' k/v, no PLE, no
// experts) do not count.
bool products_are_bf16(const Gemma4Weights& w) {
  auto bf16 = [](const Tensor& t) { return t.empty() || t.dtype() == DType::kBF16; };
  if (!bf16(w.embed_tokens) || !bf16(w.per_layer_model_projection)) return false;
  for (const Gemma4LayerWeights& l : w.layers) {
    for (const Tensor* t : {&l.q_proj, &l.k_proj, &l.v_proj, &l.o_proj, &l.gate_proj, &l.up_proj,
                            &l.down_proj, &l.per_layer_input_gate, &l.per_layer_projection,
                            &l.router_proj, &l.experts_gate_up, &l.experts_down}) {
      if (!bf16(*t)) return false;
    }
  }
  return true;
}

}  // namespace

HostTensor rope_inv_freq(const RopeConfig& rope, int head_dim) {
  SPECULA_CHECK(head_dim > 0 && head_dim % 2 == 0,
                "RoPE head_dim must be even and positive, got {}", head_dim);
  const int half = head_dim / 2;
  int rotated = half;
  if (rope.kind == RopeConfig::Kind::kProportional) {
    // HF: int(partial_rotary_factor * head_dim // 2); exponents still use the full head_dim.
    rotated = static_cast<int>(std::floor(rope.partial_rotary_factor * head_dim / 2.0));
    rotated = std::clamp(rotated, 0, half);
  }
  HostTensor t(DType::kF32, {half});
  float* f = t.data<float>();
  const float theta = static_cast<float>(rope.theta);
  const float factor = static_cast<float>(rope.factor);
  for (int j = 0; j < half; ++j) {
    const float exponent = static_cast<float>(2 * j) / static_cast<float>(head_dim);
    float inv = j < rotated ? 1.0f / std::pow(theta, exponent) : 0.0f;
    if (rope.kind == RopeConfig::Kind::kProportional) inv /= factor;
    f[j] = inv;
  }
  return t;
}

// Per-forward scratch, carved from the arena (views only).
struct Gemma4Model::Scratch {
  Tensor inputs;       // i32 [2·M]: ids then positions, uploaded together
  Tensor ids;          // i32 [M] (first half of inputs)
  Tensor positions;    // i32 [M] (second half of inputs)
  Tensor h;            // f32 [M, H] residual stream
  Tensor xn;           // f32 [M, H] normed input of a block
  Tensor o;            // f32 [M, H] block output
  Tensor q;            // f32 [M, Nh·Dmax]
  Tensor attn;         // f32 [M, Nh·Dmax]
  Tensor k;            // f32 [M, kvmax·Dmax]
  Tensor v;            // f32 [M, kvmax·Dmax]
  Tensor gate;         // f32 [M, Imax]
  Tensor up;           // f32 [M, Imax]
  Tensor ple;          // f32 [L, M, P] per-layer inputs, layer-major
  Tensor ple_ctx;      // f32 [M, L·P]
  Tensor ple_tok;      // f32 [M, L·P]
  Tensor ple_gate;     // f32 [M, P]
  Tensor moe_logits;   // f32 [M, E]
  Tensor moe_ids;      // i32 [M, k]
  Tensor moe_weights;  // f32 [M, k]
  Tensor moe_x;        // f32 [M, H]
  Tensor moe_out;      // f32 [M, H]
  Tensor out_hidden;   // f32 [n_out, H]
  Tensor logits;       // f32 [n_out, V]
};

// Per-row bookkeeping of one forward.
struct Gemma4Model::RowPlan {
  int64_t begin = 0;  // first token in the flattened batch
  int64_t n = 0;      // tokens of this row
  int64_t pos0 = 0;   // cache length before this forward
  // Per layer: the K/V attention reads (views) and the position of their row 0.
  std::vector<Tensor> attn_k, attn_v;
  std::vector<int64_t> attn_pos0;
  std::vector<int64_t> attn_ring_keys;  // >= 0: attn_k/v are the ring itself (AttentionParams)
  // Sliding layers of a long chunk (more new rows than the ring's rollback
  // slack) attend to a gathered block: window + new rows (arena views), one
  // block for the sliding donor (KV-shared layers read it later in the
  // forward) and one reused by every other sliding layer.
  bool gather = false;
  Tensor donor_gather_k, donor_gather_v, gather_k, gather_v;
  // Rows that are not gathered: each cache-owning layer's storage, which the
  // layer's attention_inputs / store_kv writes the new rows into (bookkept
  // before the layers run, so a replayed graph needs no per-layer host work),
  // and the positions_bound of their attention (a power of two from 64 up).
  std::vector<Tensor> store_k, store_v;
  int64_t positions_bound = 0;
};

Gemma4Model::~Gemma4Model() = default;

std::unique_ptr<Gemma4Model> Gemma4Model::load(const std::string& path,
                                               const LoadOptions& options) {
  std::unique_ptr<Gemma4Model> m(new Gemma4Model());
  m->path_ = path;
  m->config_ = load_gemma4_config(path);
  const Gemma4Config& c = m->config_;
  if (c.first_shared_layer == 0) {
    fail(
        "{}: every layer is KV-shared (num_kv_shared_layers {} == num_hidden_layers): a target "
        "model needs "
        "layers that compute K/V (is this an assistant drafter?)",
        path, c.num_kv_shared_layers);
  }
  if (!c.tie_word_embeddings) {
    fail(
        "{}: tie_word_embeddings is false; Gemma 4 ties lm_head to embed_tokens and specula "
        "supports only that",
        path);
  }
  m->checkpoint_ = std::make_unique<io::Checkpoint>(path);
  io::WeightTable table;
  declare_gemma4_weights(c, &m->weights_, &table);
  table.bind(*m->checkpoint_);
  m->backend_ = &backend_for(options.device);
  m->weight_buffer_ =
      place_weights(table, *m->backend_, options.scan_weights ? m->checkpoint_.get() : nullptr);
  m->init_after_weights(options);
  return m;
}

std::unique_ptr<Gemma4Model> Gemma4Model::random(const Gemma4Config& config,
                                                 const LoadOptions& options, uint64_t seed,
                                                 DType dtype) {
  std::unique_ptr<Gemma4Model> m(new Gemma4Model());
  m->path_ = fmt::format("random:{}", seed);
  m->config_ = config;
  SPECULA_CHECK(config.first_shared_layer > 0 && config.tie_word_embeddings,
                "random model: the config must have cache-owning layers and tied embeddings");
  io::WeightTable table;
  declare_gemma4_weights(config, &m->weights_, &table);
  m->backend_ = &backend_for(options.device);
  m->weight_buffer_ = random_weights(table, *m->backend_, seed, dtype);
  m->init_after_weights(options);
  return m;
}

void Gemma4Model::init_after_weights(const LoadOptions& options) {
  const Gemma4Config& c = config_;
  Backend& be = *backend_;
  fast_prefill_ = products_are_bf16(weights_);
  for (int i = 0; i < c.num_hidden_layers; ++i) {
    layer_scalars_.push_back(
        read_scalar(be, weights_.layers[static_cast<size_t>(i)].layer_scalar,
                    fmt::format("{}layers.{}.layer_scalar", c.weight_prefix, i)));
  }
  HostTensor sliding = rope_inv_freq(c.rope_sliding, c.head_dim);
  HostTensor full = rope_inv_freq(c.rope_full, c.global_head_dim);
  inv_freq_buffer_ = DeviceBuffer(be, sliding.view().nbytes() + full.view().nbytes() + 256);
  inv_freq_sliding_ = inv_freq_buffer_.view(DType::kF32, sliding.shape());
  inv_freq_full_ = Tensor(
      static_cast<char*>(inv_freq_buffer_.data()) + (sliding.view().nbytes() + 255) / 256 * 256,
      DType::kF32, full.shape(), be.device());
  be.upload(sliding.view().data(), inv_freq_sliding_);
  be.upload(full.view().data(), inv_freq_full_);
  embed_scale_ =
      round_to_dtype(std::sqrt(static_cast<float>(c.hidden_size)), weights_.embed_tokens.dtype());
  if (c.has_ple()) {
    ple_embed_scale_ = round_to_dtype(std::sqrt(static_cast<float>(c.hidden_size_per_layer_input)),
                                      weights_.embed_tokens_per_layer.dtype());
  }

  kv_pool_ = std::make_unique<CachingPool>(be);
  kv_spec_.max_context = std::min<int64_t>(options.max_context, c.max_position_embeddings);
  kv_spec_.max_rollback = options.max_rollback;
  kv_spec_.backend = &be;
  kv_spec_.memory = kv_pool_.get();
  // Unset (--kv-dtype auto): bf16 for a checkpoint whose product weights are all
  // bf16 (the rule of fast_prefill()), f32 otherwise, so the f32 golden fixtures
  // keep their exact f32 forward. Every CUDA attention path reads bf16 caches.
  kv_spec_.dtype = options.kv_dtype.value_or(fast_prefill_ ? DType::kBF16 : DType::kF32);
  if (kv_spec_.dtype != DType::kF32 && kv_spec_.dtype != DType::kBF16 &&
      kv_spec_.dtype != DType::kF8E4M3) {
    fail("{}: KV cache dtype {} is not supported (f32, bf16 or f8e4m3)", path_,
         dtype_name(kv_spec_.dtype));
  }
  for (const LayerSpec& l : c.layers) {
    KvLayerSpec s;
    s.owns_cache = !l.kv_shared;
    s.n_kv_heads = l.n_kv_heads;
    s.head_dim = l.head_dim;
    s.window = l.type == LayerType::kSliding ? c.sliding_window : 0;
    kv_spec_.layers.push_back(s);
  }
  int64_t max_width = std::max<int64_t>(
      c.hidden_size, int64_t{c.num_attention_heads} * std::max(c.head_dim, c.global_head_dim));
  for (const LayerSpec& l : c.layers) max_width = std::max<int64_t>(max_width, l.intermediate_size);
  be.reserve_scratch(kv_spec_.max_context, max_width);
  scratch_ = std::make_unique<Scratch>();
  graphs_enabled_ = true;
}

void Gemma4Model::set_graphs_enabled(bool on) {
  graphs_enabled_ = on;
  if (!on) graphs_.clear();
}

int64_t Gemma4Model::weight_bytes() const {
  return static_cast<int64_t>(weight_buffer_.size());
}

int64_t Gemma4Model::weight_bytes_read(int64_t tokens) const {
  const Gemma4Config& c = config_;
  int64_t bytes = static_cast<int64_t>(weights_.embed_tokens.nbytes() + weights_.norm.nbytes() +
                                       weights_.per_layer_model_projection.nbytes() +
                                       weights_.per_layer_projection_norm.nbytes());
  if (c.has_ple()) {
    bytes += static_cast<int64_t>(weights_.embed_tokens_per_layer.nbytes() /
                                  static_cast<size_t>(c.vocab_size_per_layer_input)) *
             std::min<int64_t>(tokens, c.vocab_size_per_layer_input);
  }
  const double expert_fraction =
      c.enable_moe_block && c.num_experts > 0
          ? std::min<double>(c.num_experts, static_cast<double>(tokens) * c.top_k_experts) /
                c.num_experts
          : 1.0;
  for (const Gemma4LayerWeights& w : weights_.layers) {
    for (const Tensor* t : {&w.input_layernorm,
                            &w.post_attention_layernorm,
                            &w.pre_feedforward_layernorm,
                            &w.post_feedforward_layernorm,
                            &w.q_proj,
                            &w.q_norm,
                            &w.k_proj,
                            &w.k_norm,
                            &w.v_proj,
                            &w.o_proj,
                            &w.gate_proj,
                            &w.up_proj,
                            &w.down_proj,
                            &w.per_layer_input_gate,
                            &w.per_layer_projection,
                            &w.post_per_layer_input_norm,
                            &w.router_proj,
                            &w.router_scale,
                            &w.router_per_expert_scale,
                            &w.pre_feedforward_layernorm_2,
                            &w.post_feedforward_layernorm_1,
                            &w.post_feedforward_layernorm_2}) {
      bytes += static_cast<int64_t>(t->nbytes());
    }
    bytes += static_cast<int64_t>(
        static_cast<double>(w.experts_gate_up.nbytes() + w.experts_down.nbytes()) *
        expert_fraction);
  }
  return bytes;
}

void Gemma4Model::embed_scaled(const Tensor& ids, const Tensor& out) {
  backend_->embedding(weights_.embed_tokens, ids, embed_scale_, out);
}

void Gemma4Model::embed_raw(const Tensor& ids, const Tensor& out) {
  backend_->embedding(weights_.embed_tokens, ids, 1.0f, out);
}

void Gemma4Model::logits_from_hidden(const Tensor& hidden, const Tensor& out) {
  // The same two ops as the decode path of run_step (not linear_prefill), so a
  // row's logits match a decode step's bit for bit.
  backend_->linear(hidden, weights_.embed_tokens, out);
  if (config_.final_logit_softcapping)
    backend_->softcap(out, static_cast<float>(*config_.final_logit_softcapping), out);
}

const ForwardOutput& Gemma4Model::forward(std::span<const ForwardRow> rows,
                                          const ForwardOptions& options) {
  stage(rows, options);
  if (!staged_recordable_) {
    run_staged();
  } else {
    graph_key_.clear();
    append_staged_key(graph_key_);
    graphs_.run(*backend_, graph_key_, [&] {
      run_staged();
      return Tensor();
    });
  }
  return finish_staged();
}

const ForwardOutput& Gemma4Model::stage(std::span<const ForwardRow> rows,
                                        const ForwardOptions& options) {
  const Gemma4Config& c = config_;
  Backend& be = *backend_;
  SPECULA_CHECK(!rows.empty(), "forward needs at least one row");
  const int L = c.num_hidden_layers;
  const int64_t H = c.hidden_size;
  const int64_t P = c.hidden_size_per_layer_input;

  // Validate everything before touching any cache.
  int64_t M = 0, n_out = 0;
  for (size_t r = 0; r < rows.size(); ++r) {
    const ForwardRow& row = rows[r];
    if (row.kv == nullptr) fail("forward row {} has no KV cache", r);
    if (row.tokens.empty()) fail("forward row {} has no tokens", r);
    row.kv->check_room(static_cast<int64_t>(row.tokens.size()));
    // Host ids are checked here; device ids (token_ids) come from an argmax.
    for (int32_t id : options.token_ids.empty() ? row.tokens : std::span<const int32_t>()) {
      if (id < 0 || id >= c.vocab_size || (c.has_ple() && id >= c.vocab_size_per_layer_input)) {
        fail("token id {} in row {} is outside the vocabulary of {} tokens", id, r, c.vocab_size);
      }
    }
    M += static_cast<int64_t>(row.tokens.size());
    n_out += row.all_logits ? static_cast<int64_t>(row.tokens.size()) : 1;
  }
  if (!options.tap_layers.empty()) {
    const Tensor& t = options.tap_out;
    const auto n = static_cast<int64_t>(options.tap_layers.size());
    if (t.dtype() != DType::kF32 || t.shape() != Shape{n, M, H} || t.device() != be.device()) {
      fail("forward: tap_out {} must be f32 [{}, {}, {}] on {} (taps x tokens x hidden)",
           t.describe(), n, M, H, be.device().str());
    }
    for (int layer : options.tap_layers) {
      if (layer < 0 || layer > L) fail("forward: tap layer {} is outside [0, {}]", layer, L);
    }
  }
  if (!options.token_ids.empty()) {
    const Tensor& ids = options.token_ids;
    if (ids.dtype() != DType::kI32 || ids.shape() != Shape{M} || ids.device() != be.device()) {
      fail("forward: token_ids {} must be i32 [{}] on {} (one id per token of the rows)",
           ids.describe(), M, be.device().str());
    }
  }

  plans_.resize(rows.size());
  for (size_t r = 0, begin = 0; r < rows.size(); ++r) {
    RowPlan& p = plans_[r];
    p.begin = static_cast<int64_t>(begin);
    p.n = static_cast<int64_t>(rows[r].tokens.size());
    p.pos0 = rows[r].kv->length();
    p.attn_k.assign(static_cast<size_t>(L), Tensor());
    p.attn_v.assign(static_cast<size_t>(L), Tensor());
    p.attn_pos0.assign(static_cast<size_t>(L), 0);
    p.attn_ring_keys.assign(static_cast<size_t>(L), -1);
    // Short chunks (decode, verify windows) read the ring in place: after
    // writing n rows it still holds the window of the oldest query when
    // n <= max_rollback + 1.
    p.gather = p.n > kv_spec_.max_rollback + 1;
    p.positions_bound = p.gather ? 0 : positions_bound_for(p.pos0 + p.n);
    begin += rows[r].tokens.size();
  }

  // Size the arena from a dry run of the same allocation sequence; it only
  // grows when a step is larger than any before (never in steady-state decode).
  auto carve = [&](Arena& a) {
    Scratch& s = *scratch_;
    int max_d = std::max(c.head_dim, c.global_head_dim);
    int max_kv = 0, max_i = 0;
    for (const LayerSpec& l : c.layers) {
      max_kv = std::max(max_kv, l.n_kv_heads);
      max_i = std::max(max_i, l.intermediate_size);
    }
    s.inputs = a.alloc(DType::kI32, {2 * M});
    s.h = a.alloc(DType::kF32, {M, H});
    s.xn = a.alloc(DType::kF32, {M, H});
    s.o = a.alloc(DType::kF32, {M, H});
    s.q = a.alloc(DType::kF32, {M, int64_t{c.num_attention_heads} * max_d});
    s.attn = a.alloc(DType::kF32, {M, int64_t{c.num_attention_heads} * max_d});
    s.k = a.alloc(DType::kF32, {M, int64_t{max_kv} * max_d});
    s.v = a.alloc(DType::kF32, {M, int64_t{max_kv} * max_d});
    s.gate = a.alloc(DType::kF32, {M, max_i});
    s.up = a.alloc(DType::kF32, {M, max_i});
    if (P > 0) {
      s.ple = a.alloc(DType::kF32, {L, M, P});
      s.ple_ctx = a.alloc(DType::kF32, {M, L * P});
      s.ple_tok = a.alloc(DType::kF32, {M, L * P});
      s.ple_gate = a.alloc(DType::kF32, {M, P});
    }
    if (c.enable_moe_block) {
      s.moe_logits = a.alloc(DType::kF32, {M, c.num_experts});
      s.moe_ids = a.alloc(DType::kI32, {M, c.top_k_experts});
      s.moe_weights = a.alloc(DType::kF32, {M, c.top_k_experts});
      s.moe_x = a.alloc(DType::kF32, {M, H});
      s.moe_out = a.alloc(DType::kF32, {M, H});
    }
    s.out_hidden = a.alloc(DType::kF32, {n_out, H});
    if (options.compute_logits) s.logits = a.alloc(DType::kF32, {n_out, c.vocab_size});
    for (RowPlan& p : plans_) {
      if (!p.gather) continue;
      const int64_t from = std::max<int64_t>(0, p.pos0 - c.sliding_window + 1);
      const int64_t rows_needed = p.pos0 - from + p.n;
      int64_t width = 0;     // kv heads × head dim, widest sliding layer
      int64_t kv_heads = 0;  // most kv heads of a sliding layer (fp8: scales a row)
      for (const LayerSpec& ls : c.layers) {
        if (!ls.kv_shared && ls.type == LayerType::kSliding) {
          width = std::max<int64_t>(width, int64_t{ls.n_kv_heads} * ls.head_dim);
          kv_heads = std::max<int64_t>(kv_heads, ls.n_kv_heads);
        }
      }
      // In the cache's dtype: the gathered window and the new rows (rounded as
      // the cache rounds them) are what a decode step would read in place.
      // fp8 blocks carry one scale per (row, kv head), as the cache does.
      const DType kv_dtype = kv_spec_.dtype;
      auto block = [&]() {
        Tensor t = a.alloc(kv_dtype, {rows_needed * width});
        if (kv_dtype != DType::kF8E4M3) return t;
        const Tensor scales = a.alloc(DType::kF32, {rows_needed * kv_heads});
        return t.with_scales(scales.data_as<const float>());
      };
      p.gather_k = block();
      p.gather_v = block();
      if (c.sliding_donor >= 0 && c.first_shared_layer < L) {
        p.donor_gather_k = block();
        p.donor_gather_v = block();
      }
    }
  };
  Arena measure = Arena::measuring();
  carve(measure);
  if (measure.used() > arena_.capacity()) {
    arena_ = Arena(measure.used() + measure.used() / 4, backend_);
  }
  arena_.reset();
  carve(arena_);
  Scratch& s = *scratch_;
  s.ids = s.inputs.slice_rows(0, M);
  s.positions = s.inputs.slice_rows(M, 2 * M);

  host_inputs_.resize(static_cast<size_t>(2 * M));
  for (size_t r = 0; r < rows.size(); ++r) {
    const RowPlan& p = plans_[r];
    for (int64_t i = 0; i < p.n; ++i) {
      host_inputs_[static_cast<size_t>(p.begin + i)] = rows[r].tokens[static_cast<size_t>(i)];
      host_inputs_[static_cast<size_t>(M + p.begin + i)] = static_cast<int32_t>(p.pos0 + i);
    }
  }
  // One transfer per forward, queued without waiting for the device.
  be.upload_async(host_inputs_.data(), s.inputs);

  // Cache bookkeeping of the rows that are not gathered: where each layer's
  // new rows go (the device ops that write them are part of the step).
  for (size_t r = 0; r < rows.size(); ++r) {
    RowPlan& p = plans_[r];
    p.store_k.assign(static_cast<size_t>(L), Tensor());
    p.store_v.assign(static_cast<size_t>(L), Tensor());
    if (p.gather) continue;
    for (int l = 0; l < L; ++l) {
      if (c.layers[static_cast<size_t>(l)].kv_shared) continue;
      SequenceKv::Storage st = rows[r].kv->store_target(l, p.pos0, p.n);
      p.store_k[static_cast<size_t>(l)] = st.k;
      p.store_v[static_cast<size_t>(l)] = st.v;
    }
  }

  output_.row_out_begin.assign(rows.size() + 1, 0);
  for (size_t r = 0; r < rows.size(); ++r) {
    output_.row_out_begin[r + 1] =
        output_.row_out_begin[r] + (rows[r].all_logits ? plans_[r].n : 1);
  }
  output_.hidden = s.out_hidden;
  output_.logits = options.compute_logits ? s.logits : Tensor();

  // Decode steps and verify windows can run as recorded graphs where the
  // backend has them (forward() records them the second time a step shape is
  // seen; the first sighting runs directly, which also sizes every scratch
  // buffer the recording must not grow).
  staged_rows_ = rows;
  staged_options_ = options;
  // The fast prefill path only for bf16 checkpoints (see fast_prefill()).
  staged_options_.prefill = options.prefill && fast_prefill_;
  staged_recordable_ =
      be.supports_graphs() && graphs_enabled_ && !options.prefill &&
      !options.capture_layer_hidden && !options.capture_donor_kv &&
      std::none_of(plans_.begin(), plans_.end(), [](const RowPlan& p) { return p.gather; });
  staged_ = true;
  return output_;
}

void Gemma4Model::append_staged_key(std::vector<int64_t>& key) const {
  SPECULA_CHECK(staged_ && staged_recordable_, "append_staged_key: no recordable forward staged");
  const int64_t M = scratch_->h.dim(0);
  key.push_back(M);
  key.push_back(staged_options_.compute_logits);
  key.push_back(reinterpret_cast<intptr_t>(arena_.base()));
  key.push_back(reinterpret_cast<intptr_t>(staged_options_.token_ids.data()));
  key.push_back(reinterpret_cast<intptr_t>(staged_options_.tap_out.data()));
  for (int layer : staged_options_.tap_layers) key.push_back(layer);
  key.push_back(static_cast<int64_t>(staged_options_.tap_layers.size()));
  for (size_t r = 0; r < staged_rows_.size(); ++r) {
    const RowPlan& p = plans_[r];
    key.push_back(p.n);
    key.push_back(staged_rows_[r].all_logits);
    key.push_back(p.positions_bound);
    // Keys and values: separate buffers, which a pool may hand out in any pairing.
    for (const Tensor& t : p.store_k) key.push_back(reinterpret_cast<intptr_t>(t.data()));
    for (const Tensor& t : p.store_v) key.push_back(reinterpret_cast<intptr_t>(t.data()));
  }
}

void Gemma4Model::run_staged() {
  SPECULA_CHECK(staged_, "run_staged: no forward staged");
  if (!staged_options_.token_ids.empty()) backend_->copy(staged_options_.token_ids, scratch_->ids);
  run_step(staged_rows_, staged_options_);
}

const ForwardOutput& Gemma4Model::finish_staged() {
  SPECULA_CHECK(staged_, "finish_staged: no forward staged");
  staged_ = false;
  const std::span<const ForwardRow> rows = staged_rows_;
  if (staged_options_.capture_layer_hidden) {
    Backend& be = *backend_;
    Scratch& s = *scratch_;
    output_.layer_hidden.emplace_back(DType::kF32, Shape{s.h.dim(0), config_.hidden_size});
    be.rms_norm(s.h, weights_.norm, static_cast<float>(config_.rms_norm_eps), s.xn);
    be.download(s.xn, output_.layer_hidden.back().view().data());
  }
  for (size_t r = 0; r < rows.size(); ++r) rows[r].kv->commit(plans_[r].n);
  return output_;
}

// The device work of one forward (everything after the upload): embedding,
// the layers, the final norm and the head. Recordable when no row is gathered
// and nothing is captured to the host.
void Gemma4Model::run_step(std::span<const ForwardRow> rows, const ForwardOptions& options) {
  const Gemma4Config& c = config_;
  Backend& be = *backend_;
  Scratch& s = *scratch_;
  const int L = c.num_hidden_layers;
  const int64_t H = c.hidden_size;
  const int64_t P = c.hidden_size_per_layer_input;
  const int64_t M = s.h.dim(0);

  // Embedding (×√H cast to the table dtype) and per-layer inputs (§3.1-3.2).
  be.embedding(weights_.embed_tokens, s.ids, embed_scale_, s.h);
  if (P > 0) {
    be.embedding(weights_.embed_tokens_per_layer, s.ids, ple_embed_scale_, s.ple_tok);
    product(s.h, weights_.per_layer_model_projection, s.ple_ctx, options);
    be.scale(s.ple_ctx, 1.0f / std::sqrt(static_cast<float>(H)), s.ple_ctx);
    Tensor ctx_rows = s.ple_ctx.reshape({M * L, P});
    be.rms_norm(ctx_rows, weights_.per_layer_projection_norm, static_cast<float>(c.rms_norm_eps),
                ctx_rows);
    be.add(s.ple_ctx, s.ple_tok, s.ple_ctx);
    be.scale(s.ple_ctx, static_cast<float>(1.0 / std::sqrt(2.0)), s.ple_ctx);
    // [M, L, P] -> [L, M, P] so that each layer reads one contiguous [M, P] block.
    be.transpose01(s.ple_ctx.reshape({M, L, P}), s.ple);
  }

  output_.layer_hidden.clear();
  if (options.capture_layer_hidden) {
    output_.layer_hidden.reserve(static_cast<size_t>(L + 1));
    output_.layer_hidden.emplace_back(DType::kF32, Shape{M, H});
    be.download(s.h, output_.layer_hidden.back().view().data());
  }

  // Device taps of hidden_states[index] (the residual stream s.h; index L is
  // taken after the loop, normed).
  auto tap = [&](int index) {
    for (size_t k = 0; k < options.tap_layers.size(); ++k) {
      if (options.tap_layers[k] != index) continue;
      const Tensor dst =
          options.tap_out.reshape({static_cast<int64_t>(options.tap_layers.size()) * M, H})
              .slice_rows(static_cast<int64_t>(k) * M, static_cast<int64_t>(k + 1) * M);
      if (index < L) {
        be.copy(s.h, dst);
      } else {
        be.rms_norm(s.h, weights_.norm, static_cast<float>(c.rms_norm_eps), dst);
      }
    }
  };
  tap(0);
  bool xn_ready = false;  // s.xn already holds the next layer's normed input
  for (int l = 0; l < L; ++l) {
    // Capturing the hidden states needs s.h after every layer: no fusion across layers.
    xn_ready = run_layer(l, rows, plans_, options, xn_ready, !options.capture_layer_hidden);
    if (options.capture_layer_hidden && l + 1 < L) {
      output_.layer_hidden.emplace_back(DType::kF32, Shape{M, H});
      be.download(s.h, output_.layer_hidden.back().view().data());
    }
    if (l + 1 < L) tap(l + 1);
  }
  tap(L);

  // Donor K/V of row 0, for `score` and drafters.
  output_.sliding_donor.reset();
  output_.full_donor.reset();
  if (options.capture_donor_kv) {
    auto keep = [&](int donor, std::optional<ForwardOutput::DonorKv>* dst) {
      if (donor < 0) return;
      const RowPlan& p = plans_[0];
      const size_t di = static_cast<size_t>(donor);
      ForwardOutput::DonorKv d;
      d.pos0 = p.attn_pos0[di];
      Tensor k = p.attn_k[di], v = p.attn_v[di];
      // Ring layers and bf16 caches: unrolled or widened into temporary f32
      // buffers (not a hot path).
      DeviceBuffer k_buf, v_buf;
      const bool ring = p.attn_ring_keys[di] >= 0;
      if (ring || k.dtype() != DType::kF32) {
        const Shape shape{ring ? p.attn_ring_keys[di] : k.dim(0), k.dim(1), k.dim(2)};
        const size_t bytes = static_cast<size_t>(shape.numel()) * sizeof(float) + 1;
        k_buf = DeviceBuffer(be, bytes);
        v_buf = DeviceBuffer(be, bytes);
        const Tensor k32 = k_buf.view(DType::kF32, shape);
        const Tensor v32 = v_buf.view(DType::kF32, shape);
        if (ring) {
          rows[0].kv->read_ring(donor, d.pos0, d.pos0 + shape[0], k32, v32);
        } else {
          be.convert(k, k32);
          be.convert(v, v32);
        }
        k = k32;
        v = v32;
      }
      d.k = HostTensor(DType::kF32, k.shape());
      d.v = HostTensor(DType::kF32, v.shape());
      be.download(k, d.k.view().data());
      be.download(v, d.v.view().data());
      *dst = std::move(d);
    };
    keep(c.sliding_donor, &output_.sliding_donor);
    keep(c.full_donor, &output_.full_donor);
  }

  // Final norm and head on the requested positions (§3.6).
  for (size_t r = 0; r < rows.size(); ++r) {
    const RowPlan& p = plans_[r];
    const int64_t out = output_.row_out_begin[r];
    const int64_t first = rows[r].all_logits ? 0 : p.n - 1;
    be.copy(s.h.slice_rows(p.begin + first, p.begin + p.n),
            s.out_hidden.slice_rows(out, out + p.n - first));
  }
  be.rms_norm(s.out_hidden, weights_.norm, static_cast<float>(c.rms_norm_eps), s.out_hidden);
  if (options.compute_logits) {
    product(s.out_hidden, weights_.embed_tokens, s.logits, options);
    if (c.final_logit_softcapping)
      be.softcap(s.logits, static_cast<float>(*c.final_logit_softcapping), s.logits);
  }
}

void Gemma4Model::product(const Tensor& x, const Tensor& w, const Tensor& y,
                          const ForwardOptions& options) {
  if (options.prefill) {
    backend_->linear_prefill(x, w, y);
  } else {
    backend_->linear(x, w, y);
  }
}

bool Gemma4Model::run_layer(int l, std::span<const ForwardRow> rows, std::span<RowPlan> plans,
                            const ForwardOptions& options, bool xn_ready, bool fuse_next_norm) {
  const Gemma4Config& c = config_;
  Backend& be = *backend_;
  Scratch& s = *scratch_;
  const LayerSpec& spec = c.layers[static_cast<size_t>(l)];
  const Gemma4LayerWeights& w = weights_.layers[static_cast<size_t>(l)];
  const float eps = static_cast<float>(c.rms_norm_eps);
  const int64_t M = s.h.dim(0);
  const int64_t H = c.hidden_size;
  const int64_t D = spec.head_dim;
  const int64_t Nh = c.num_attention_heads;
  const int64_t KV = spec.n_kv_heads;
  const bool sliding = spec.type == LayerType::kSliding;
  const Tensor& inv_freq = sliding ? inv_freq_sliding_ : inv_freq_full_;
  const size_t li = static_cast<size_t>(l);

  // 1. Attention block (§4 step 1, §4.2): projections, then q/k norms, RoPE and
  // the cache store in one attention_inputs call.
  if (!xn_ready) be.rms_norm(s.h, w.input_layernorm, eps, s.xn);
  Tensor q = Tensor(s.q.data(), DType::kF32, {M, Nh * D}, s.q.device());
  AttentionInputsParams in;
  in.q = q.reshape({M, Nh, D});
  in.q_norm = w.q_norm;
  in.positions = s.positions;
  in.inv_freq = inv_freq;
  in.eps = eps;
  Tensor k, v;
  if (!spec.kv_shared) {
    k = Tensor(s.k.data(), DType::kF32, {M, KV * D}, s.k.device());
    v = Tensor(s.v.data(), DType::kF32, {M, KV * D}, s.v.device());
    // V derives from the raw K projection when attention_k_eq_v.
    if (spec.k_eq_v) {
      products(s.xn, {{w.q_proj, q}, {w.k_proj, k}}, options);
    } else {
      products(s.xn, {{w.q_proj, q}, {w.k_proj, k}, {w.v_proj, v}}, options);
    }
    in.k = k.reshape({M, KV, D});
    in.k_norm = w.k_norm;
    in.v = v.reshape({M, KV, D});
    in.v_from_k = spec.k_eq_v;
    // One row that is not gathered: the cache store is part of the same call.
    if (rows.size() == 1 && !plans[0].gather) {
      in.cache_k = plans[0].store_k[li];
      in.cache_v = plans[0].store_v[li];
    }
  } else {
    product(s.xn, w.q_proj, q, options);
  }
  // One row read in place (decode steps, verify windows, a short chunk):
  // attention_with_inputs finishes the inputs and attends in one op, which lets
  // a backend load the old keys while the products run. The cache it reads is
  // the one the row's new keys go to (or, KV-shared, the donor's).
  const bool fused_inputs =
      rows.size() == 1 && !plans[0].gather && (spec.kv_shared || !in.cache_k.empty());
  if (!fused_inputs) be.attention_inputs(in);

  if (!spec.kv_shared) {
    // The rows read in place store their new keys together (one call), after
    // the gathered rows' ring copies: each row writes only its own caches.
    store_batch_.clear();
    for (size_t r = 0; r < rows.size(); ++r) {
      RowPlan& p = plans[r];
      SequenceKv& kv = *rows[r].kv;
      Tensor k_new = k.slice_rows(p.begin, p.begin + p.n).reshape({p.n, KV, D});
      Tensor v_new = v.slice_rows(p.begin, p.begin + p.n).reshape({p.n, KV, D});
      if (!p.gather) {
        if (in.cache_k.empty()) {
          store_batch_.push_back({.k = k_new,
                                  .v = v_new,
                                  .positions = s.positions.slice_rows(p.begin, p.begin + p.n),
                                  .cache_k = p.store_k[li],
                                  .cache_v = p.store_v[li]});
        }
        if (sliding) {
          // Attend to the ring in place: after writing n rows it still holds
          // the window of the oldest query (n <= max_rollback + 1).
          const int64_t from = std::max<int64_t>(0, p.pos0 - c.sliding_window + 1);
          p.attn_pos0[li] = from;
          p.attn_k[li] = p.store_k[li];
          p.attn_v[li] = p.store_v[li];
          p.attn_ring_keys[li] = p.pos0 - from + p.n;
        } else {
          p.attn_k[li] = p.store_k[li].slice_rows(0, p.pos0 + p.n);
          p.attn_v[li] = p.store_v[li].slice_rows(0, p.pos0 + p.n);
          p.attn_pos0[li] = 0;
        }
      } else if (sliding) {
        // Window rows from the ring, then the new rows, in one contiguous block.
        const int64_t from = std::max<int64_t>(0, p.pos0 - c.sliding_window + 1);
        const int64_t old = p.pos0 - from;
        p.attn_pos0[li] = from;
        const bool donor = l == c.sliding_donor && c.first_shared_layer < c.num_hidden_layers;
        const Shape shape{old + p.n, KV, D};
        // The flat block viewed as [rows, KV, D]; an fp8 block's scales (one
        // per (row, kv head), from its start) come along.
        auto view = [&](const Tensor& flat) {
          Tensor t = flat.slice_rows(0, shape.numel()).reshape(shape);
          return flat.scale_data() ? t.with_scales(flat.scale_data()) : t;
        };
        Tensor gk = view(donor ? p.donor_gather_k : p.gather_k);
        Tensor gv = view(donor ? p.donor_gather_v : p.gather_v);
        if (old > 0) kv.read_ring(l, from, p.pos0, gk.slice_rows(0, old), gv.slice_rows(0, old));
        be.convert(k_new, gk.slice_rows(old, old + p.n));
        be.convert(v_new, gv.slice_rows(old, old + p.n));
        kv.write_ring(l, p.pos0, k_new, v_new);
        p.attn_k[li] = gk;
        p.attn_v[li] = gv;
      } else {
        kv.write_full(l, p.pos0, k_new, v_new);
        p.attn_k[li] = kv.full_keys(l, p.pos0 + p.n);
        p.attn_v[li] = kv.full_values(l, p.pos0 + p.n);
        p.attn_pos0[li] = 0;
      }
    }
    if (!store_batch_.empty()) be.store_kv_batch(store_batch_);
  } else {
    const size_t donor = static_cast<size_t>(spec.kv_donor);
    for (RowPlan& p : plans) {
      p.attn_k[li] = p.attn_k[donor];
      p.attn_v[li] = p.attn_v[donor];
      p.attn_pos0[li] = p.attn_pos0[donor];
      p.attn_ring_keys[li] = p.attn_ring_keys[donor];
    }
  }

  Tensor attn = Tensor(s.attn.data(), DType::kF32, {M, Nh * D}, s.attn.device());
  // Every row's attention in one call (a backend may attend to all of them in
  // one launch); a lone row read in place finishes its inputs in the same op.
  attention_batch_.clear();
  for (const RowPlan& p : plans) {
    AttentionParams& ap = attention_batch_.emplace_back();
    ap.q = q.slice_rows(p.begin, p.begin + p.n).reshape({p.n, Nh, D});
    ap.k = p.attn_k[li];
    ap.v = p.attn_v[li];
    ap.out = attn.slice_rows(p.begin, p.begin + p.n).reshape({p.n, Nh, D});
    ap.q_positions = s.positions.slice_rows(p.begin, p.begin + p.n);
    ap.k_pos0 = p.attn_pos0[li];
    ap.ring_keys = p.attn_ring_keys[li];
    // Long chunks are prefill: tensor-core attention there (not batch invariant,
    // and nothing compares a prefill chunk with decode steps bit for bit), but
    // TF32 products only for bf16 checkpoints (see fast_prefill()).
    ap.allow_fast_prefill = p.gather && fast_prefill_;
    // Short chunks read the cache in place: a launch that fits every step
    // below the bound (recordable), with the same results.
    ap.positions_bound = p.positions_bound;
    ap.causal = true;
    ap.window = sliding ? c.sliding_window : 0;
    ap.scale = 1.0f;  // Gemma 4 normalises q and k instead of scaling (§2.5)
    // o_proj may start during the combine only for a lone decode row: measured
    // on an H200 (31B shapes), that took batch-1 steps from 18.7 to 18.3 ms,
    // but with several rows or queries (batched rows, verify windows) the
    // early chain of launches it starts made steps 25-60% slower.
    ap.product_follows = plans.size() == 1 && p.n == 1;
  }
  if (fused_inputs) {
    be.attention_with_inputs(in, attention_batch_.front());
  } else {
    be.attention_batch(attention_batch_);
  }
  product(attn, w.o_proj, s.o, options);
  // Residual update, then the feed-forward input norm of the new residual.
  be.rms_norm_add_norm(s.o, w.post_attention_layernorm, eps, s.h, 1.0f, w.pre_feedforward_layernorm,
                       s.xn);

  // 2-4. Feed-forward: dense MLP, plus the routed experts on MoE layers (§4, §6).
  const int64_t I = spec.intermediate_size;
  Tensor gate = Tensor(s.gate.data(), DType::kF32, {M, I}, s.gate.device());
  Tensor up = Tensor(s.up.data(), DType::kF32, {M, I}, s.up.device());
  if (options.prefill) {
    product(s.xn, w.gate_proj, gate, options);
    product(s.xn, w.up_proj, up, options);
    be.gelu_mul(gate, up, gate);
  } else {
    be.linear_gelu_mul(s.xn, w.gate_proj, w.up_proj, gate, up);
  }
  product(gate, w.down_proj, s.o, options);
  if (c.enable_moe_block) {
    be.rms_norm(s.o, w.post_feedforward_layernorm_1, eps, s.o);
    // Router reads the un-normed residual: norm without scale, × router.scale, × H^-½.
    be.rms_norm(s.h, w.router_scale, eps, s.moe_x);
    be.scale(s.moe_x, 1.0f / std::sqrt(static_cast<float>(H)), s.moe_x);
    product(s.moe_x, w.router_proj, s.moe_logits, options);
    be.moe_route({.logits = s.moe_logits,
                  .per_expert_scale = w.router_per_expert_scale,
                  .expert_ids = s.moe_ids,
                  .expert_weights = s.moe_weights});
    be.rms_norm(s.h, w.pre_feedforward_layernorm_2, eps, s.moe_x);
    be.moe_experts({.x = s.moe_x,
                    .expert_ids = s.moe_ids,
                    .expert_weights = s.moe_weights,
                    .gate_up = w.experts_gate_up,
                    .down = w.experts_down,
                    .out = s.moe_out,
                    .prefill = options.prefill});
    be.rms_norm(s.moe_out, w.post_feedforward_layernorm_2, eps, s.moe_out);
    be.add(s.o, s.moe_out, s.o);
  }
  // The layer's last residual update also takes the next layer's input norm.
  const bool fuse = fuse_next_norm && l + 1 < c.num_hidden_layers;
  auto last_update = [&](const Tensor& x, const Tensor& norm_w, float post_scale) {
    if (fuse) {
      be.rms_norm_add_norm(x, norm_w, eps, s.h, post_scale, weights_.layers[li + 1].input_layernorm,
                           s.xn);
    } else {
      be.rms_norm_add(x, norm_w, eps, s.h, post_scale);
    }
  };
  // 6. layer_scalar scales the whole residual stream, folded into the last
  // residual update of the layer.
  const float layer_scalar = layer_scalars_[li];
  if (!c.has_ple()) {
    last_update(s.o, w.post_feedforward_layernorm, layer_scalar);
    return fuse;
  }
  be.rms_norm_add(s.o, w.post_feedforward_layernorm, eps, s.h, 1.0f);

  // 5. Per-layer input (§4 step 5).
  product(s.h, w.per_layer_input_gate, s.ple_gate, options);
  be.gelu(s.ple_gate, s.ple_gate);
  be.mul(s.ple_gate, s.ple.row(l), s.ple_gate);
  product(s.ple_gate, w.per_layer_projection, s.o, options);
  last_update(s.o, w.post_per_layer_input_norm, layer_scalar);
  return fuse;
}

void Gemma4Model::products(const Tensor& x, std::initializer_list<LinearOut> outs,
                           const ForwardOptions& options) {
  if (options.prefill) {
    for (const LinearOut& o : outs) backend_->linear_prefill(x, o.w, o.y);
  } else {
    backend_->linear_multi(x, std::span<const LinearOut>(outs.begin(), outs.size()));
  }
}

}  // namespace specula::gemma4
