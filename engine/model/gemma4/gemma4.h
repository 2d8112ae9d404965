// SPDX-License-Identifier: Apache-2.0
// Gemma4Model: the Gemma 4 text decoder (gemma4-architecture.md §2-§7) over a
// Backend, with batched rows at independent positions.
//
// One forward takes any number of rows; row r appends its tokens to its own
// SequenceKv at positions [kv.length(), kv.length() + n_r). All rows' tokens are
// flattened for the matrix products; attention runs per row. The caches are
// committed only when the whole forward succeeded.
#pragma once

#include <initializer_list>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "engine/backend/backends.h"
#include "engine/io/safetensors.h"
#include "engine/kv/kv_cache.h"
#include "engine/memory/arena.h"
#include "engine/model/gemma4/config.h"
#include "engine/model/gemma4/weights.h"
#include "engine/ops/step_graphs.h"

namespace specula::gemma4 {

struct ForwardRow {
  SequenceKv* kv = nullptr;         // this row's cache; not owned
  std::span<const int32_t> tokens;  // at least one token
  bool all_logits = false;          // outputs for every token, else only the last
};

struct ForwardOptions {
  bool compute_logits = true;
  // Keep hidden_states[0..L] (HF output_hidden_states semantics, [L] = post-norm)
  // for every token of every row.
  bool capture_layer_hidden = false;
  // Keep the donor K/V of row 0 as used by this forward (positions visible to its
  // last token), per layer type.
  bool capture_donor_kv = false;
  // Every row is a prompt prefill: products may take the backend's faster,
  // not batch-invariant path (Backend::linear_prefill, and MoeExpertsParams::
  // prefill). Results then differ slightly from decoding the same tokens one
  // step at a time, so set it only where every run of a request prefills the
  // same way (the decoder's prefill). Only checkpoints whose products are bf16
  // take it (Gemma4Model::fast_prefill()): the fast path rounds activations
  // (and f32 weights) to bf16, ~1e-3 relative, which is below the noise of a
  // bf16 checkpoint but far above an f32 one's; a prefill forward of an f32 or
  // f16 checkpoint is the exact forward, as without the flag.
  bool prefill = false;
  // When set (i32 [M] on the model's device, M = all rows' tokens), the token
  // ids are read from it, row after row, and ForwardRow::tokens only gives each
  // row's length (its values are not read): a speculative round passes drafts
  // the host has not read back. The ids are trusted to be in the vocabulary
  // (they come from an argmax over it).
  Tensor token_ids;
  // Device taps, for drafters that read the target's hidden states: for every
  // token of the forward, the hidden state at each index in tap_layers (as
  // transformers' hidden_states: 0 = the scaled embeddings, l in [1, L) =
  // after layer l, L = num_hidden_layers = after the final norm), written to
  // tap_out, f32 [tap_layers.size(), M, H] on the model's device (M = all rows'
  // tokens, in row order). Device copies only: a recorded step records them.
  // No tap asked: the forward is unchanged, bit for bit.
  std::span<const int> tap_layers;
  Tensor tap_out;
};

// Results of one forward. Views (on the model's device) point into its scratch and stay valid
// until the next forward on the same model.
struct ForwardOutput {
  Tensor logits;  // f32 [n_out, V] after soft-capping (empty unless compute_logits)
  Tensor hidden;  // f32 [n_out, H] post-final-norm hidden of the same positions
  std::vector<int64_t> row_out_begin;  // row r's outputs are [row_out_begin[r], row_out_begin[r+1])
  std::vector<HostTensor> layer_hidden;  // L+1 tensors f32 [M, H] when captured
  // Donor K/V of row 0 (f32 [T, kv, D]) and the absolute position of their first row.
  struct DonorKv {
    HostTensor k, v;
    int64_t pos0 = 0;
  };
  std::optional<DonorKv> sliding_donor, full_donor;
};

struct LoadOptions {
  Device device = Device::cpu();
  int64_t max_context = 4096;  // default context per sequence (clamped to max_position_embeddings)
  int max_rollback = 16;       // sliding-ring slack for speculative rollback
  // Refuse weights holding NaN or infinity at load, naming the tensor (one read
  // of every weight, as it is uploaded; see place_weights). Off skips the read.
  bool scan_weights = true;
  // Element type of the KV cache (KvCacheSpec::dtype): f32, bf16 or f8e4m3
  // (one f32 scale per (token, kv head); never the default). Unset: bf16
  // for a checkpoint whose product weights are all bf16, f32 otherwise (the f32
  // golden fixtures keep exact parity with transformers).
  std::optional<DType> kv_dtype;
  // No option chooses the prefill path: it follows the checkpoint's dtype. A
  // checkpoint whose product weights are all bf16 prefills through the
  // backend's fast path (ForwardOptions::prefill); any other (the f32 golden
  // fixtures) computes every forward exactly, so that its greedy generation
  // equals its plain forward's (and transformers') on every backend.
};

class Gemma4Model {
 public:
  // Loads config.json and the safetensors checkpoint of `path`; every tensor
  // name, shape and dtype is checked (errors name the file and tensor).
  static std::unique_ptr<Gemma4Model> load(const std::string& path,
                                           const LoadOptions& options = {});
  // A model of `config` (finalized) whose weights are seeded uniform values of
  // `dtype` (see random_weights), on options.device: for benchmarks of released
  // shapes without a checkpoint. path() is "random:<seed>".
  static std::unique_ptr<Gemma4Model> random(const Gemma4Config& config, const LoadOptions& options,
                                             uint64_t seed, DType dtype = DType::kBF16);

  ~Gemma4Model();
  Gemma4Model(const Gemma4Model&) = delete;
  Gemma4Model& operator=(const Gemma4Model&) = delete;

  const Gemma4Config& config() const { return config_; }
  const std::string& path() const { return path_; }
  Backend& backend() const { return *backend_; }
  int64_t max_context() const { return kv_spec_.max_context; }
  // Whether prefill forwards (ForwardOptions::prefill) and long gathered
  // chunks may take the backend's fast, bf16/TF32 paths: true when every
  // product weight (embeddings/head, projections, experts) is bf16.
  bool fast_prefill() const { return fast_prefill_; }

  // Bytes of weights one forward of `tokens` flattened tokens reads: every
  // weight except the per-layer-embedding table (only `tokens` rows of it are
  // gathered); for MoE layers, experts count as min(E, tokens·k)/E of their size
  // (an upper bound on the distinct experts routed to).
  int64_t weight_bytes_read(int64_t tokens) const;
  // Bytes of all weights held on the device.
  int64_t weight_bytes() const;

  // A fresh, empty cache for one sequence.
  SequenceKv new_sequence() const { return SequenceKv(kv_spec_); }
  const KvCacheSpec& kv_spec() const { return kv_spec_; }

  // Runs the decoder over `rows` and commits every row's tokens to its cache.
  // Throws (leaving every cache length unchanged) on bad input: an id outside
  // the vocabulary, a row that would exceed its context.
  const ForwardOutput& forward(std::span<const ForwardRow> rows,
                               const ForwardOptions& options = {});

  // The target's scaled input embedding (×√H cast to the table dtype), as the
  // assistant drafter consumes it. ids i32 [N] → out f32 [N, H].
  void embed_scaled(const Tensor& ids, const Tensor& out);
  // The target's unscaled embedding rows (the table as stored, widened to f32),
  // as the DSpark drafter's token projection consumes them. ids i32 [N] (on the
  // model's device) → out f32 [N, H].
  void embed_raw(const Tensor& ids, const Tensor& out);
  // The target's head on hidden states, exactly as forward() computes its
  // logits: the tied embedding product, then final_logit_softcapping when set.
  // hidden f32 [N, H] → out f32 [N, V] (on the model's device; no aliasing).
  void logits_from_hidden(const Tensor& hidden, const Tensor& out);

  // Recorded steps (CUDA graphs) for decode steps and verify windows: on by
  // default where the backend supports them (the CLI's --no-graphs turns them
  // off). Results are identical either way.
  void set_graphs_enabled(bool on);
  bool graphs_enabled() const { return graphs_enabled_; }
  // Forwards that ran as a replayed graph so far (for tests and benchmarks).
  int64_t graph_replays() const { return graphs_.replays(); }

 private:
  // forward() in three parts (recorded as one step when recordable). stage()
  // is the host half: it validates (throwing, with every cache
  // unchanged, on bad input), plans, queues the inputs' upload and returns
  // the output's views and row offsets, which hold no values yet. rows (and
  // options.token_ids) must stay valid until finish_staged(). run_staged()
  // queues the device half directly (never recorded by the model itself);
  // finish_staged() commits every row's cache and returns the same output.
  // Between stage() and finish_staged() no other forward may run on this model.
  const ForwardOutput& stage(std::span<const ForwardRow> rows, const ForwardOptions& options = {});
  // Whether the staged device half may be recorded (graphs on, no prefill, no
  // host captures, no gathered rows), and, if so, what it depends on besides
  // device memory (shapes, buffers, caches, positions bounds), appended to key.
  bool staged_recordable() const { return staged_recordable_; }
  void append_staged_key(std::vector<int64_t>& key) const;
  void run_staged();
  const ForwardOutput& finish_staged();

  Gemma4Model() = default;
  // Shared by load() and random(): host copies of scalars, RoPE tables, the KV
  // cache spec and the backend's scratch.
  void init_after_weights(const LoadOptions& options);
  struct RowPlan;
  // The device work of a forward after its inputs are uploaded (recordable for
  // decode steps and verify windows).
  void run_step(std::span<const ForwardRow> rows, const ForwardOptions& options);
  // One decoder layer. xn_ready: s.xn already holds this layer's normed input.
  // fuse_next_norm: end with the next layer's input norm in s.xn (returns
  // whether it did).
  bool run_layer(int layer, std::span<const ForwardRow> rows, std::span<RowPlan> plans,
                 const ForwardOptions& options, bool xn_ready, bool fuse_next_norm);
  // linear() or, for prefill forwards, linear_prefill().
  void product(const Tensor& x, const Tensor& w, const Tensor& y, const ForwardOptions& options);
  // Products of one x: linear_multi, or linear_prefill each for prefill forwards.
  void products(const Tensor& x, std::initializer_list<LinearOut> outs,
                const ForwardOptions& options);

  std::string path_;
  Gemma4Config config_;
  std::unique_ptr<io::Checkpoint> checkpoint_;
  Gemma4Weights weights_;
  DeviceBuffer weight_buffer_;            // device copies of the weights (empty on the CPU)
  std::unique_ptr<CachingPool> kv_pool_;  // KV-cache memory, reused across sequences
  std::vector<float> layer_scalars_;      // host copies of layers.*.layer_scalar
  Backend* backend_ = nullptr;
  KvCacheSpec kv_spec_;
  DeviceBuffer inv_freq_buffer_;
  Tensor inv_freq_sliding_;  // f32 [Ds/2] on the device
  Tensor inv_freq_full_;     // f32 [Df/2] on the device
  float embed_scale_ = 1.0f;
  float ple_embed_scale_ = 1.0f;
  Arena arena_;
  ForwardOutput output_;
  // Per-forward scratch views (arena-owned).
  struct Scratch;
  std::unique_ptr<Scratch> scratch_;
  std::vector<RowPlan> plans_;  // reused across forwards
  // One layer's cache stores and attention calls of several rows, made as one
  // store_kv_batch / attention_batch call; reused (cleared per layer).
  std::vector<StoreKvParams> store_batch_;
  std::vector<AttentionParams> attention_batch_;
  std::vector<int32_t> host_inputs_;  // ids then positions, staged for the upload; reused
  // Recorded steps by shape (rows, their lengths, positions bounds, caches, arena).
  StepGraphCache graphs_;
  std::vector<int64_t> graph_key_;
  bool graphs_enabled_ = true;
  bool fast_prefill_ = false;  // see fast_prefill()
  // The forward between stage() and finish_staged().
  std::span<const ForwardRow> staged_rows_;
  ForwardOptions staged_options_;
  bool staged_ = false;
  bool staged_recordable_ = false;
};

// Builds the inverse frequencies of one layer type (gemma4-architecture.md §2.4):
// default RoPE over head_dim, or proportional RoPE with zero frequencies past the
// rotated fraction. Returns f32 [head_dim / 2].
HostTensor rope_inv_freq(const RopeConfig& rope, int head_dim);

}  // namespace specula::gemma4
