// SPDX-License-Identifier: Apache-2.0
#include "engine/draft/dspark/dspark_model.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>

#include <nlohmann/json.hpp>

#include "engine/io/json_util.h"
#include "engine/io/quantize.h"
#include "engine/model/gemma4/weights.h"

namespace specula::dspark {
namespace {

// Rounds a scale as HF does before multiplying a table of `dtype`.
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

// Grows `arena` to what `carve` needs (measured by a dry run), then carves.
template <typename F>
void carve_into(Arena& arena, Backend& be, F&& carve) {
  Arena measure = Arena::measuring();
  carve(measure);
  if (measure.used() > arena.capacity()) arena = Arena(measure.used() + measure.used() / 4, &be);
  arena.reset();
  carve(arena);
}

}  // namespace

// Views of the block scratch (T = B·γ rows).
struct DSparkModel::BlockScratch {
  Tensor inputs;     // i32 [3T]: positions, the gather index, attention positions
  Tensor positions;  // i32 [T]: t_b + j
  Tensor attn_pos;   // i32 [T]: t_b + γ − 1 (every query sees the context and the whole block)
  Tensor gidx;       // i32 [T]: specula: j; DeepSpec: j == 0 ? b : B
  Tensor ids_src;    // i32 [B + 1] (DeepSpec): anchors, then mask_token_id
  Tensor ids;        // i32 [T] (DeepSpec): the block's ids
  Tensor er, tp;     // specula: f32 [B, H] raw embeddings, [B, d] token projections
  Tensor x, xn, o;   // f32 [T, d]
  Tensor q, attn;    // f32 [T, Nh·D]
  Tensor k, v;       // f32 [T, KV·D]
  Tensor gate, up;   // f32 [T, F]
  Tensor h;          // f32 [T, d]
  Tensor hout;       // specula: f32 [T, H]
  Tensor U;          // f32 [T, V]
  Tensor hconf;      // f32 [T, 1]
  // Per row b and layer l (index b·L + l): the context cache's storage, where
  // the block's keys and values go at positions t_b .. t_b + γ − 1.
  std::vector<SequenceKv::Storage> store;
  std::vector<int64_t> bound;  // per row: positions_bound_for(t_b + γ)
  std::vector<int64_t> ends;   // per row: t_b + γ (the keys it attends to)
};

// Views of the context-commit scratch (N committed rows of a forward of M tokens).
struct DSparkModel::CommitScratch {
  Tensor indices;    // i32 [2N]: positions, then tap_rows (one upload)
  Tensor positions;  // i32 [N]: each committed row's position
  Tensor tap_rows;   // i32 [N]: each committed row's row of the forward's taps
  Tensor tt;         // f32 [M, m·H]: the taps concatenated on the feature axis
  Tensor cin;        // f32 [N, m·H]
  Tensor ctx, nc;    // f32 [N, d]
  Tensor k, v;       // f32 [N, KV·D]
};

DSparkModel::~DSparkModel() = default;

namespace {

// Bytes of the weights a table bound (optional ones absent count nothing).
int64_t bytes_of(const io::WeightTable& table) {
  int64_t n = 0;
  for (const io::WeightTable::Entry& e : table.entries()) {
    if (e.field != nullptr && !e.field->empty()) n += static_cast<int64_t>(e.field->nbytes());
    if (e.field != nullptr && e.field->scale_data() != nullptr)
      n += static_cast<int64_t>(e.field->scales().nbytes());
  }
  return n;
}

}  // namespace

std::unique_ptr<DSparkModel> DSparkModel::load(const std::string& dir, gemma4::Gemma4Model& target,
                                               Backend& backend, bool scan_weights) {
  std::unique_ptr<DSparkModel> m(new DSparkModel());
  m->config_ = load_dspark_config(dir);
  m->target_ = &target;
  m->backend_ = &backend;
  const DSparkConfig& c = m->config_;
  const std::string file =
      dir + "/" + (c.layout == DSparkLayout::kSpecula ? kSpeculaConfigFile : kDeepSpecConfigFile);
  if (&backend != &target.backend())
    fail("{}: the DSpark drafter must run on the target's backend", file);
  check_dspark_config(c, target.config(), file);
  m->checkpoint_ = std::make_unique<io::Checkpoint>(dir);
  io::WeightTable table;
  declare_dspark_weights(c, target.config().hidden_size, target.config().vocab_size, &m->weights_,
                         &table);
  table.bind(*m->checkpoint_);
  m->weight_buffer_ =
      gemma4::place_weights(table, backend, scan_weights ? m->checkpoint_.get() : nullptr);
  m->weight_bytes_ = bytes_of(table);
  m->init_after_weights(file);
  if (c.layout == DSparkLayout::kDeepSpec) {
    if (m->weights_.embed_tokens.empty())
      std::fprintf(stderr, "dspark: %s has no embed_tokens.weight: using the target's embedding\n",
                   dir.c_str());
    if (m->weights_.lm_head.empty())
      std::fprintf(stderr, "dspark: %s has no lm_head.weight: using the target's tied head\n",
                   dir.c_str());
  }
  return m;
}

std::unique_ptr<DSparkModel> DSparkModel::random(const DSparkConfig& config,
                                                 gemma4::Gemma4Model& target, Backend& backend,
                                                 uint64_t seed, DType dtype) {
  const std::string origin = fmt::format("random dspark drafter (seed {})", seed);
  std::unique_ptr<DSparkModel> m(new DSparkModel());
  m->config_ = config;
  m->target_ = &target;
  m->backend_ = &backend;
  if (&backend != &target.backend())
    fail("{}: the DSpark drafter must run on the target's backend", origin);
  check_dspark_config(m->config_, target.config(), origin);
  io::WeightTable table;
  declare_dspark_weights(m->config_, target.config().hidden_size, target.config().vocab_size,
                         &m->weights_, &table);
  if (is_quantized(dtype)) {
    // bf16 values first (the same as a bf16 drafter's), then their quantization.
    const DeviceBuffer values = gemma4::random_weights(table, backend, seed, DType::kBF16);
    m->weight_buffer_ = gemma4::quantize_weights(table, backend, dtype);
  } else {
    m->weight_buffer_ = gemma4::random_weights(table, backend, seed, dtype);
  }
  m->weight_bytes_ = bytes_of(table);
  m->init_after_weights(origin);
  return m;
}

std::string DSparkModel::description() const {
  const DSparkConfig& c = config_;
  std::string taps;
  for (size_t i = 0; i < c.taps.size(); ++i) taps += (i ? ", " : "") + std::to_string(c.taps[i]);
  return fmt::format(
      "{} layout DSpark drafter (γ {}, width {}, {} layers, {} heads, r {}, {}confidence head, "
      "taps [{}])",
      c.layout == DSparkLayout::kSpecula ? "specula" : "DeepSpec", c.block_size, c.hidden_size,
      c.num_layers, c.num_heads, c.markov_rank, has_confidence_head() ? "" : "no ", taps);
}

void DSparkModel::init_after_weights(const std::string& origin) {
  Backend& be = *backend_;
  const DSparkConfig& c = config_;
  const gemma4::Gemma4Config& t = target_->config();
  if (c.layout == DSparkLayout::kDeepSpec) {
    for (int i = 0; i < c.num_layers; ++i) {
      layer_scalars_.push_back(
          gemma4::read_scalar(be, weights_.layers[static_cast<size_t>(i)].layer_scalar,
                              fmt::format("{}: layers.{}.layer_scalar", origin, i)));
    }
    if (!weights_.embed_tokens.empty()) {
      embed_scale_ = round_to_dtype(std::sqrt(static_cast<float>(c.hidden_size)),
                                    weights_.embed_tokens.dtype());
    }
  }
  if (has_confidence_head())
    confidence_bias_ =
        gemma4::read_scalar(be, weights_.confidence_bias, origin + ": confidence bias");

  // Constant tables in one buffer: RoPE (DeepSpec) or the block's base rows (specula).
  const int64_t G = c.block_size, d = c.hidden_size;
  if (c.layout == DSparkLayout::kDeepSpec) {
    const HostTensor inv = gemma4::rope_inv_freq(c.text.rope_full, c.head_dim);
    const_buffer_ = DeviceBuffer(be, inv.view().nbytes());
    inv_freq_ = const_buffer_.view(DType::kF32, inv.shape());
    be.upload(inv.view().data(), inv_freq_);
  } else {
    // block_base = [block_pos[0] ; mask_embed + block_pos[1:]], widened to f32.
    const_buffer_ = DeviceBuffer(be, static_cast<size_t>(2 * G * d) * sizeof(float));
    block_base_ = const_buffer_.view(DType::kF32, {G, d});
    const Tensor ids = Tensor(static_cast<char*>(const_buffer_.data()) + G * d * sizeof(float),
                              DType::kI32, {G}, be.device());
    std::vector<int32_t> iota(static_cast<size_t>(G));
    for (int64_t j = 0; j < G; ++j) iota[static_cast<size_t>(j)] = static_cast<int32_t>(j);
    be.upload(iota.data(), ids);
    be.embedding(weights_.block_pos, ids, 1.0f, block_base_);
    if (G > 1) {
      const Tensor rest = block_base_.slice_rows(1, G);
      // mask_embed rows via embedding of ids 0..G-2 into a scratch of its own.
      DeviceBuffer tmp(be, static_cast<size_t>((G - 1) * d) * sizeof(float));
      const Tensor me = tmp.view(DType::kF32, {G - 1, d});
      be.embedding(weights_.mask_embed, ids.slice_rows(0, G - 1), 1.0f, me);
      be.add(rest, me, rest);
      be.synchronize();
    }
  }

  // Context-KV caches: every draft layer full, room for the target's context plus a block.
  ctx_pool_ = std::make_unique<CachingPool>(be);
  ctx_spec_.max_context = target_->max_context() + G;
  ctx_spec_.max_rollback = 0;
  ctx_spec_.backend = &be;
  ctx_spec_.memory = ctx_pool_.get();
  for (int i = 0; i < c.num_layers; ++i) {
    ctx_spec_.layers.push_back(
        {.owns_cache = true, .n_kv_heads = c.num_kv_heads, .head_dim = c.head_dim, .window = 0});
  }
  const int64_t m = static_cast<int64_t>(c.taps.size());
  int64_t max_width =
      std::max<int64_t>({m * t.hidden_size, c.hidden_size, c.intermediate_size,
                         int64_t{c.num_heads} * c.head_dim, c.markov_rank, t.hidden_size});
  be.reserve_scratch(ctx_spec_.max_context, max_width);
  commit_ = std::make_unique<CommitScratch>();
  block_ = std::make_unique<BlockScratch>();
}

SequenceKv DSparkModel::new_context() const {
  return SequenceKv(ctx_spec_);
}

void DSparkModel::commit_context(std::span<const ContextPiece> pieces, const Tensor& taps) {
  Backend& be = *backend_;
  const DSparkConfig& c = config_;
  const int64_t H = target_->config().hidden_size;
  const int64_t m = static_cast<int64_t>(c.taps.size());
  if (pieces.empty()) return;
  if (taps.dtype() != DType::kF32 || taps.rank() != 3 || taps.dim(0) != m || taps.dim(2) != H ||
      taps.device() != be.device()) {
    fail("dspark context: taps {} must be f32 [{}, M, {}] on {}", taps.describe(), m, H,
         be.device().str());
  }
  const int64_t M = taps.dim(1);
  int64_t N = 0;
  for (const ContextPiece& p : pieces) {
    SPECULA_CHECK(p.kv != nullptr, "dspark context: a piece has no cache");
    if (p.position != p.kv->length()) {
      fail(
          "dspark context: committed position {} does not follow the context cache's {} "
          "positions",
          p.position, p.kv->length());
    }
    if (p.count < 1 || p.tap_row < 0 || p.tap_row + p.count > M)
      fail("dspark context: tap rows [{}, {}) outside the forward's {} tokens", p.tap_row,
           p.tap_row + p.count, M);
    p.kv->check_room(p.count + c.block_size);
    N += p.count;
  }
  const int64_t d = c.hidden_size, KVD = int64_t{c.num_kv_heads} * c.head_dim;
  const bool deepspec = c.layout == DSparkLayout::kDeepSpec;
  CommitScratch& s = *commit_;
  // Carved for the forward's M tokens (N <= M unless pieces overlap), then
  // viewed as N rows: a round commits anywhere from one row per sequence to
  // its whole window, and the scratch must not grow with what it accepted.
  const int64_t R = std::max(N, M);
  carve_into(commit_arena_, be, [&](Arena& a) {
    s.indices = a.alloc(DType::kI32, {2 * R}).slice_rows(0, 2 * N);
    s.positions = s.indices.slice_rows(0, N);
    s.tap_rows = s.indices.slice_rows(N, 2 * N);
    s.tt = a.alloc(DType::kF32, {M, m * H});
    s.cin = a.alloc(DType::kF32, {R, m * H}).slice_rows(0, N);
    s.ctx = a.alloc(DType::kF32, {R, d}).slice_rows(0, N);
    s.nc = a.alloc(DType::kF32, {R, d}).slice_rows(0, N);
    s.k = a.alloc(DType::kF32, {R, KVD}).slice_rows(0, N);
    s.v = a.alloc(DType::kF32, {R, KVD}).slice_rows(0, N);
  });
  // One upload: the committed rows' positions (RoPE, the cache stores), then
  // their rows of the taps.
  host_idx_.clear();
  for (const ContextPiece& p : pieces)
    for (int i = 0; i < p.count; ++i) host_idx_.push_back(static_cast<int32_t>(p.position + i));
  for (const ContextPiece& p : pieces)
    for (int i = 0; i < p.count; ++i) host_idx_.push_back(static_cast<int32_t>(p.tap_row + i));
  be.upload_async(host_idx_.data(), s.indices);
  // concat_taps: [m, M, H] -> [M, m, H], then every piece's rows in one gather.
  be.transpose01(taps, s.tt.reshape({M, m, H}));
  be.gather_rows(s.tt, s.tap_rows, s.cin);
  const float eps = static_cast<float>(c.rms_norm_eps);
  be.linear(s.cin, weights_.context_proj, s.ctx);
  be.rms_norm(s.ctx, weights_.context_norm, eps, s.ctx);
  const int64_t KV = c.num_kv_heads, D = c.head_dim;
  for (int l = 0; l < c.num_layers; ++l) {
    const DSparkLayerWeights& w = weights_.layers[static_cast<size_t>(l)];
    if (deepspec) {
      // k = rope(rms(k_proj(ctx)) · k_norm) at the context positions;
      // v = rms₀(v_proj(ctx)) (v_proj := k_proj when k_eq_v): attention_inputs'
      // k/v part in its op order.
      be.linear(s.ctx, w.k_proj, s.k);
      if (c.k_eq_v) {
        be.copy(s.k, s.v);
      } else {
        be.linear(s.ctx, w.v_proj, s.v);
      }
      const Tensor k3 = s.k.reshape({N, KV, D}), v3 = s.v.reshape({N, KV, D});
      be.rms_norm(k3, w.k_norm, eps, k3);
      be.rope(k3, s.positions, inv_freq_);
      be.rms_norm(v3, Tensor(), eps, v3);
    } else {
      be.rms_norm(s.ctx, w.attn_norm, eps, s.nc);
      const LinearOut outs[2] = {{w.k_proj, s.k}, {w.v_proj, s.v}};
      be.linear_multi(s.nc, outs);
    }
    // Every piece's rows into its cache at their device positions, one call.
    store_batch_.clear();
    int64_t at = 0;
    for (const ContextPiece& p : pieces) {
      const SequenceKv::Storage st = p.kv->store_target(l, p.position, p.count);
      store_batch_.push_back({.k = s.k.slice_rows(at, at + p.count).reshape({p.count, KV, D}),
                              .v = s.v.slice_rows(at, at + p.count).reshape({p.count, KV, D}),
                              .positions = s.positions.slice_rows(at, at + p.count),
                              .cache_k = st.k,
                              .cache_v = st.v});
      at += p.count;
    }
    be.store_kv_batch(store_batch_);
  }
  for (const ContextPiece& p : pieces) p.kv->commit(p.count);
}

void DSparkModel::attend_rows(int64_t rows, int layer, const Tensor& q, const Tensor& k,
                              const Tensor& v, const Tensor& out, float scale) {
  // A row's block keys go right after its context (never committed: the next
  // commit overwrites them), so the row attends to one contiguous [ctx; block].
  // Stored at device positions and attended with every query at the block's
  // last position (causal then hides nothing of [ctx; block]): the launches
  // read their key ranges from the device, so a recorded block serves every
  // round below the same positions bound. Each row reads only its own cache,
  // so all stores may precede all attention.
  const BlockScratch& s = *block_;
  const int64_t G = config_.block_size;
  store_batch_.clear();
  attention_batch_.clear();
  for (int64_t row = 0; row < rows; ++row) {
    const int64_t r0 = row * G, r1 = r0 + G;
    const SequenceKv::Storage& st = s.store[static_cast<size_t>(row * config_.num_layers + layer)];
    store_batch_.push_back({.k = k.slice_rows(r0, r1),
                            .v = v.slice_rows(r0, r1),
                            .positions = s.positions.slice_rows(r0, r1),
                            .cache_k = st.k,
                            .cache_v = st.v});
    const int64_t end = s.ends[static_cast<size_t>(row)];
    AttentionParams& ap = attention_batch_.emplace_back();
    ap.q = q.slice_rows(r0, r1);
    ap.k = st.k.slice_rows(0, end);
    ap.v = st.v.slice_rows(0, end);
    ap.out = out.slice_rows(r0, r1);
    ap.q_positions = s.attn_pos.slice_rows(r0, r1);
    ap.k_pos0 = 0;
    ap.causal = true;
    ap.window = 0;
    ap.scale = scale;
    ap.positions_bound = s.bound[static_cast<size_t>(row)];
  }
  backend_->store_kv_batch(store_batch_);
  backend_->attention_batch(attention_batch_);
}

void DSparkModel::run_block(std::span<SequenceKv* const> ctx, const Tensor& anchors) {
  prepare_block(ctx, anchors);
  Backend& be = *backend_;
  if (!be.supports_graphs() || !target_->graphs_enabled()) {
    run_block_device(ctx, anchors);
    return;
  }
  // Recorded like the target's steps: the key names every buffer the block's
  // launches touch (the context caches' storage per row and layer) and each
  // row's positions bound; positions themselves come from the device.
  const BlockScratch& s = *block_;
  block_key_.clear();
  block_key_.push_back(block_rows_);
  block_key_.push_back(reinterpret_cast<intptr_t>(anchors.data()));
  block_key_.push_back(reinterpret_cast<intptr_t>(block_arena_.base()));
  block_key_.push_back(reinterpret_cast<intptr_t>(bias_rows_.data()));
  for (const int64_t b : s.bound) block_key_.push_back(b);
  for (const SequenceKv::Storage& st : s.store) {
    block_key_.push_back(reinterpret_cast<intptr_t>(st.k.data()));
    block_key_.push_back(reinterpret_cast<intptr_t>(st.v.data()));
  }
  block_graphs_.run(be, block_key_, [&] {
    run_block_device(ctx, anchors);
    return U_;
  });
}

void DSparkModel::prepare_block(std::span<SequenceKv* const> ctx, const Tensor& anchors) {
  Backend& be = *backend_;
  const DSparkConfig& c = config_;
  const gemma4::Gemma4Config& tc = target_->config();
  const int64_t B = static_cast<int64_t>(ctx.size()), G = c.block_size, T = B * G;
  const int64_t H = tc.hidden_size, V = tc.vocab_size, d = c.hidden_size;
  const int64_t NhD = int64_t{c.num_heads} * c.head_dim, KVD = int64_t{c.num_kv_heads} * c.head_dim;
  const bool deepspec = c.layout == DSparkLayout::kDeepSpec;
  SPECULA_CHECK(B > 0, "dspark block: no rows");
  if (anchors.dtype() != DType::kI32 || anchors.shape() != Shape{B} ||
      anchors.device() != be.device()) {
    fail("dspark block: anchors {} must be i32 [{}] on {}", anchors.describe(), B,
         be.device().str());
  }
  for (SequenceKv* kv : ctx) {
    SPECULA_CHECK(kv != nullptr, "dspark block: a row has no context cache");
    kv->check_room(G);
  }
  BlockScratch& s = *block_;
  carve_into(block_arena_, be, [&](Arena& a) {
    s.inputs = a.alloc(DType::kI32, {3 * T});
    s.ids_src = a.alloc(DType::kI32, {B + 1});
    s.ids = a.alloc(DType::kI32, {T});
    s.er = a.alloc(DType::kF32, {B, H});
    s.tp = a.alloc(DType::kF32, {B, d});
    s.x = a.alloc(DType::kF32, {T, d});
    s.xn = a.alloc(DType::kF32, {T, d});
    s.o = a.alloc(DType::kF32, {T, d});
    s.q = a.alloc(DType::kF32, {T, NhD});
    s.attn = a.alloc(DType::kF32, {T, NhD});
    s.k = a.alloc(DType::kF32, {T, KVD});
    s.v = a.alloc(DType::kF32, {T, KVD});
    s.gate = a.alloc(DType::kF32, {T, c.intermediate_size});
    s.up = a.alloc(DType::kF32, {T, c.intermediate_size});
    s.h = a.alloc(DType::kF32, {T, d});
    s.hout = a.alloc(DType::kF32, {T, H});
    s.U = a.alloc(DType::kF32, {T, V});
    s.hconf = a.alloc(DType::kF32, {T, 1});
  });
  s.positions = s.inputs.slice_rows(0, T);
  s.gidx = s.inputs.slice_rows(T, 2 * T);
  s.attn_pos = s.inputs.slice_rows(2 * T, 3 * T);
  host_idx_.resize(static_cast<size_t>(3 * T + 1));
  s.store.clear();
  s.bound.clear();
  s.ends.clear();
  for (int64_t b = 0; b < B; ++b) {
    const int64_t t = ctx[b]->length();
    for (int64_t j = 0; j < G; ++j) {
      host_idx_[static_cast<size_t>(b * G + j)] = static_cast<int32_t>(t + j);
      host_idx_[static_cast<size_t>(T + b * G + j)] =
          static_cast<int32_t>(deepspec ? (j == 0 ? b : B) : j);
      host_idx_[static_cast<size_t>(2 * T + b * G + j)] = static_cast<int32_t>(t + G - 1);
    }
    // Host bookkeeping of the block's rows (the device stores them in the step).
    for (int l = 0; l < c.num_layers; ++l) s.store.push_back(ctx[b]->store_target(l, t, G));
    s.bound.push_back(positions_bound_for(t + G));
    s.ends.push_back(t + G);
  }
  host_idx_[static_cast<size_t>(3 * T)] = c.mask_token_id;
  if (has_confidence_head() && T > bias_rows_n_) {
    // Grown only for a block of more rows than any before (never in steady state).
    bias_rows_n_ = T;
    bias_rows_ = DeviceBuffer(be, static_cast<size_t>(T) * sizeof(float));
    const std::vector<float> host(static_cast<size_t>(T), confidence_bias_);
    be.upload(host.data(), bias_rows_.view(DType::kF32, {T, 1}));
  }
  be.upload_async(host_idx_.data(), s.inputs);
  if (deepspec) be.upload_async(host_idx_.data() + 3 * T, s.ids_src.slice_rows(B, B + 1));
  U_ = s.U;
  h_ = s.h;
  hconf_ = s.hconf;
  block_rows_ = B;
}

void DSparkModel::run_block_device(std::span<SequenceKv* const> ctx, const Tensor& anchors) {
  Backend& be = *backend_;
  const DSparkConfig& c = config_;
  const gemma4::Gemma4Config& tc = target_->config();
  const int64_t B = static_cast<int64_t>(ctx.size()), G = c.block_size, T = B * G;
  const int64_t d = c.hidden_size;
  const bool deepspec = c.layout == DSparkLayout::kDeepSpec;
  BlockScratch& s = *block_;

  if (deepspec) {
    // ids = [anchor, mask × (γ−1)] per row, gathered from [anchors ; mask].
    be.copy(anchors, s.ids_src.slice_rows(0, B));
    be.gather_rows(s.ids_src, s.gidx, s.ids);
    if (weights_.embed_tokens.empty()) {
      target_->embed_scaled(s.ids, s.x);
    } else {
      be.embedding(weights_.embed_tokens, s.ids, embed_scale_, s.x);
    }
    deepspec_layers(ctx);
  } else {
    // X_0 = token_proj(E_raw[anchor]) + block_pos[0]; X_j = mask_embed[j−1] + block_pos[j].
    target_->embed_raw(anchors, s.er);
    be.linear(s.er, weights_.token_proj, s.tp);
    be.gather_rows(block_base_, s.gidx, s.x);
    for (int64_t b = 0; b < B; ++b) {
      const Tensor x0 = s.x.slice_rows(b * G, b * G + 1);
      be.add(x0, s.tp.slice_rows(b, b + 1), x0);
    }
    specula_layers(ctx);
  }

  // Heads' inputs: h = rms(X; out_norm), U, and the confidence head's h term.
  const float eps = static_cast<float>(c.rms_norm_eps);
  be.rms_norm(s.x, weights_.out_norm, eps, s.h);
  if (deepspec) {
    if (weights_.lm_head.empty()) {
      target_->logits_from_hidden(s.h, s.U);
    } else {
      be.linear(s.h, weights_.lm_head, s.U);
      if (tc.final_logit_softcapping)
        be.softcap(s.U, static_cast<float>(*tc.final_logit_softcapping), s.U);
    }
  } else {
    be.linear(s.h, weights_.out_proj, s.hout);
    target_->logits_from_hidden(s.hout, s.U);
  }
  if (has_confidence_head()) {
    const Tensor w_h(weights_.confidence_weight.data(), weights_.confidence_weight.dtype(), {1, d},
                     be.device());
    // hconf = h·w_h + b: the bias is added here, once per block position, so
    // that each head step adds only its Markov term.
    be.linear_residual(s.h, w_h, bias_rows_.view(DType::kF32, {T, 1}), Tensor(), s.hconf);
  }
}

void DSparkModel::specula_layers(std::span<SequenceKv* const> ctx) {
  Backend& be = *backend_;
  const DSparkConfig& c = config_;
  BlockScratch& s = *block_;
  const int64_t n = c.num_heads, hd = c.head_dim;
  const float eps = static_cast<float>(c.rms_norm_eps);
  const float scale = 1.0f / std::sqrt(static_cast<float>(hd));
  for (int l = 0; l < c.num_layers; ++l) {
    const DSparkLayerWeights& w = weights_.layers[static_cast<size_t>(l)];
    be.rms_norm(s.x, w.attn_norm, eps, s.xn);
    const LinearOut outs[3] = {{w.q_proj, s.q}, {w.k_proj, s.k}, {w.v_proj, s.v}};
    be.linear_multi(s.xn, outs);
    const int64_t T = s.x.dim(0);
    attend_rows(static_cast<int64_t>(ctx.size()), l, s.q.reshape({T, n, hd}),
                s.k.reshape({T, n, hd}), s.v.reshape({T, n, hd}), s.attn.reshape({T, n, hd}),
                scale);
    be.linear(s.attn, w.o_proj, s.o);
    be.add(s.x, s.o, s.x);
    be.rms_norm(s.x, w.ffn_norm, eps, s.xn);
    be.linear_gelu_mul(s.xn, w.gate_proj, w.up_proj, s.gate, s.up);
    be.linear(s.gate, w.down_proj, s.o);
    be.add(s.x, s.o, s.x);
  }
}

void DSparkModel::deepspec_layers(std::span<SequenceKv* const> ctx) {
  Backend& be = *backend_;
  const DSparkConfig& c = config_;
  BlockScratch& s = *block_;
  const int64_t T = s.x.dim(0);
  const int64_t Nh = c.num_heads, KV = c.num_kv_heads, D = c.head_dim;
  const float eps = static_cast<float>(c.rms_norm_eps);
  for (int l = 0; l < c.num_layers; ++l) {
    const DSparkLayerWeights& w = weights_.layers[static_cast<size_t>(l)];
    be.rms_norm(s.x, w.input_layernorm, eps, s.xn);
    if (c.k_eq_v) {
      const LinearOut outs[2] = {{w.q_proj, s.q}, {w.k_proj, s.k}};
      be.linear_multi(s.xn, outs);
    } else {
      const LinearOut outs[3] = {{w.q_proj, s.q}, {w.k_proj, s.k}, {w.v_proj, s.v}};
      be.linear_multi(s.xn, outs);
    }
    AttentionInputsParams in;
    in.q = s.q.reshape({T, Nh, D});
    in.q_norm = w.q_norm;
    in.k = s.k.reshape({T, KV, D});
    in.k_norm = w.k_norm;
    in.v = s.v.reshape({T, KV, D});
    in.v_from_k = c.k_eq_v;
    in.positions = s.positions;
    in.inv_freq = inv_freq_;
    in.eps = eps;
    be.attention_inputs(in);
    attend_rows(static_cast<int64_t>(ctx.size()), l, s.q.reshape({T, Nh, D}),
                s.k.reshape({T, KV, D}), s.v.reshape({T, KV, D}), s.attn.reshape({T, Nh, D}), 1.0f);
    be.linear(s.attn, w.o_proj, s.o);
    be.rms_norm_add(s.o, w.post_attention_layernorm, eps, s.x, 1.0f);
    be.rms_norm(s.x, w.pre_feedforward_layernorm, eps, s.xn);
    be.linear_gelu_mul(s.xn, w.gate_proj, w.up_proj, s.gate, s.up);
    be.linear(s.gate, w.down_proj, s.o);
    be.rms_norm_add(s.o, w.post_feedforward_layernorm, eps, s.x,
                    layer_scalars_[static_cast<size_t>(l)]);
  }
}

Tensor DSparkModel::head_step(int slot, std::span<const int32_t> u_rows, const Tensor& prev,
                              const Tensor& confidence) {
  prepare_head_step(slot, u_rows, prev, confidence);
  Backend& be = *backend_;
  if (!be.supports_graphs() || !target_->graphs_enabled()) return run_head_step();
  // Recorded like the target's steps (run once, recorded the second time, then
  // replayed): a head step is a handful of small launches whose cost is
  // mostly launch overhead. The key names every buffer the launches touch.
  const HeadPlan& h = head_;
  head_key_.clear();
  for (const int64_t v :
       {int64_t{slot}, h.rows, h.one ? int64_t{h.u0} : int64_t{-1}, int64_t{h.conf}, block_rows_}) {
    head_key_.push_back(v);
  }
  for (const void* p : {h.prev.data(), h.confidence.data(), h.idx.data(), h.logits.data(),
                        U_.data(), hconf_.data()}) {
    head_key_.push_back(reinterpret_cast<intptr_t>(p));
  }
  return head_graphs_.run(be, head_key_, [&] { return run_head_step(); });
}

void DSparkModel::prepare_head_step(int slot, std::span<const int32_t> u_rows, const Tensor& prev,
                                    const Tensor& confidence) {
  Backend& be = *backend_;
  const DSparkConfig& c = config_;
  const int64_t Bk = static_cast<int64_t>(u_rows.size()), G = c.block_size;
  const int64_t V = target_->config().vocab_size, r = c.markov_rank;
  SPECULA_CHECK(!U_.empty(), "dspark head step before any block");
  SPECULA_CHECK(slot >= 0 && slot < G, "dspark head step: slot {} outside [0, {})", slot, G);
  SPECULA_CHECK(Bk > 0 && Bk <= block_rows_, "dspark head step: {} rows of a block of {}", Bk,
                block_rows_);
  for (int32_t u : u_rows) {
    SPECULA_CHECK(u >= 0 && u < block_rows_ * G, "dspark head step: base row {} outside [0, {})", u,
                  block_rows_ * G);
  }
  if (prev.dtype() != DType::kI32 || prev.shape() != Shape{Bk} || prev.device() != be.device()) {
    fail("dspark head step: prev tokens {} must be i32 [{}] on {}", prev.describe(), Bk,
         be.device().str());
  }
  HeadPlan& h = head_;
  h.rows = Bk;
  h.one = Bk == 1;
  h.u0 = u_rows[0];
  h.prev = prev;
  h.conf = has_confidence_head() && !confidence.empty();
  if (h.conf && (confidence.dtype() != DType::kF32 || confidence.numel() != Bk)) {
    fail("dspark head step: confidence {} must be f32 [{}]", confidence.describe(), Bk);
  }
  h.confidence = h.conf ? confidence.reshape({Bk, 1}) : Tensor();
  if (Bk > step_idx_rows_) {
    // Grown only for more rows than before (never in steady state); slots of
    // earlier steps of this round were consumed in queue order already.
    step_idx_rows_ = std::max<int64_t>(Bk, block_rows_);
    step_idx_ = DeviceBuffer(be, static_cast<size_t>(G * step_idx_rows_) * sizeof(int32_t));
  }
  h.idx = Tensor(static_cast<int32_t*>(step_idx_.data()) + slot * step_idx_rows_, DType::kI32, {Bk},
                 be.device());
  // One row (batch 1) reads its base row in place: no index upload, no gather.
  if (!h.one) be.upload_async(u_rows.data(), h.idx);
  carve_into(step_arena_, be, [&](Arena& a) {
    h.logits = a.alloc(DType::kF32, {Bk, V});
    if (r > 0) h.e = a.alloc(DType::kF32, {Bk, r});
  });
}

Tensor DSparkModel::run_head_step() {
  Backend& be = *backend_;
  const DSparkConfig& c = config_;
  const HeadPlan& h = head_;
  const int64_t r = c.markov_rank, d = c.hidden_size;
  // Batch 1 reads its base row in place (a one-row table); more rows pick theirs by index.
  const Tensor rows = h.one ? Tensor() : h.idx;
  const Tensor base = h.one ? U_.slice_rows(h.u0, h.u0 + 1) : U_;
  if (r > 0) {
    // logits = U_k + W1[prev]·W2ᵀ, one pass over W2 (linear_residual).
    be.embedding(weights_.markov_w1, h.prev, 1.0f, h.e);
    be.linear_residual(h.e, weights_.markov_w2, base, rows, h.logits);
  } else if (h.one) {
    be.copy(base, h.logits);
  } else {
    be.gather_rows(U_, h.idx, h.logits);
  }
  if (h.conf) {
    // confidence = (h·w_h + b) + W1[prev]·w_e; the first term is hconf_ (the block's).
    const Tensor conf_base = h.one ? hconf_.slice_rows(h.u0, h.u0 + 1) : hconf_;
    if (c.confidence_with_markov && r > 0) {
      const Tensor w_e(static_cast<char*>(weights_.confidence_weight.data()) +
                           static_cast<size_t>(d) * dtype_size(weights_.confidence_weight.dtype()),
                       weights_.confidence_weight.dtype(), {1, r}, be.device());
      be.linear_residual(h.e, w_e, conf_base, rows, h.confidence);
    } else if (h.one) {
      be.copy(conf_base, h.confidence);
    } else {
      be.gather_rows(hconf_, h.idx, h.confidence);
    }
  }
  return h.logits;
}

void DSparkModel::save(const std::string& dir) const {
  if (config_.layout != DSparkLayout::kSpecula)
    fail("{}: only the specula layout is saved (this drafter is DeepSpec-layout)", dir);
  std::filesystem::create_directories(dir);
  // A table over a copy of the weights: its fields hold the live tensors.
  DSparkWeights live_weights = weights_;
  io::WeightTable table;
  declare_dspark_weights(config_, target_->config().hidden_size, target_->config().vocab_size,
                         &live_weights, &table);
  std::vector<HostTensor> host;
  std::vector<io::NamedTensor> out;
  host.reserve(2 * table.entries().size());
  DType quantized = DType::kF32;
  for (const io::WeightTable::Entry& e : table.entries()) {
    const Tensor* live = e.field;
    SPECULA_CHECK(!live->empty(), "save: no weight for {}", e.name);
    host.emplace_back(live->dtype(), live->shape());
    backend_->download(*live, host.back().view().data());
    out.push_back({e.name, host.back().view()});
    if (live->scale_data() != nullptr) {
      // A quantized matrix keeps its layout: codes and "<name>.scale".
      quantized = live->dtype();
      host.emplace_back(DType::kF32, live->scales().shape());
      backend_->download(live->scales(), host.back().view().data());
      out.push_back({e.name + io::kScaleSuffix, host.back().view()});
    }
  }
  // Widest elements first, so every tensor of the file stays aligned (quantize.h).
  std::stable_sort(out.begin(), out.end(), [](const io::NamedTensor& a, const io::NamedTensor& b) {
    return dtype_size(a.tensor.dtype()) > dtype_size(b.tensor.dtype());
  });
  io::write_safetensors(dir + "/model.safetensors", out);
  nlohmann::json j = specula_dspark_json(config_);
  if (is_quantized(quantized)) j["weight_dtype"] = io::quantized_dtype_label(quantized);
  std::ofstream f(dir + "/" + kSpeculaConfigFile);
  f << j.dump(2) << "\n";
  if (!f) fail("{}: cannot write {}", dir, kSpeculaConfigFile);
}

}  // namespace specula::dspark
