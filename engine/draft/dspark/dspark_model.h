// SPDX-License-Identifier: Apache-2.0
// DSparkModel: the DSpark block drafter's forward (docs/dspark.md) over
// Backend ops only, in both layouts, so it runs unchanged on every device.
//
// Three parts, all batched over rows:
// - commit_context(): the context projection of newly committed target
//   positions (their taps), and each draft layer's keys and values of them,
//   appended to each sequence's context-KV cache (a SequenceKv of full layers);
// - run_block(): one bidirectional backbone pass over B rows' blocks of γ
//   positions (products over all B·γ rows; attention per row over its cached
//   context and its own block, whose keys are written past the cache's length
//   and never committed), keeping base logits U [B·γ, V] and the confidence
//   head's hidden part on the device;
// - head_step(): proposal logits U_k + W1[prev]·W2ᵀ for a subset of the rows,
//   and their confidence logits.
//
// Weights, caches and scratch live on the target's Backend; steady-state calls
// allocate nothing (scratch grows only for more rows or tokens than before).
#pragma once

#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "engine/draft/dspark/dspark_config.h"
#include "engine/draft/dspark/dspark_weights.h"
#include "engine/io/safetensors.h"
#include "engine/kv/kv_cache.h"
#include "engine/memory/arena.h"
#include "engine/memory/memory_resource.h"
#include "engine/model/gemma4/gemma4.h"
#include "engine/ops/step_graphs.h"

namespace specula::dspark {

// Target positions [position, position + count) of the sequence whose context
// cache is `kv`, whose taps are rows [tap_row, tap_row + count) of a forward's taps.
struct ContextPiece {
  SequenceKv* kv = nullptr;
  int64_t position = 0;  // must equal kv->length()
  int count = 0;
  int64_t tap_row = 0;
};

class DSparkModel {
 public:
  // Loads a drafter folder (dspark.json → specula layout, else config.json of
  // Gemma4DSparkModel → DeepSpec layout) for `target`, refusing one made for
  // another target (naming both) and weights of the wrong names or shapes.
  // `backend` must be the target's. `scan_weights`: refuse NaN or infinite
  // weights, naming the tensor. Logs the layout and, for DeepSpec checkpoints
  // without embed_tokens / lm_head, that the target's are used.
  static std::unique_ptr<DSparkModel> load(const std::string& dir, gemma4::Gemma4Model& target,
                                           Backend& backend, bool scan_weights = true);
  // A drafter of `config` with seeded uniform weights of `dtype` (see
  // gemma4::random_weights; a quantized dtype quantizes the bf16 values'
  // matrices, see gemma4::quantize_weights); a DeepSpec-layout one gets its
  // own embed_tokens and lm_head. Checked against the target as load() checks.
  static std::unique_ptr<DSparkModel> random(const DSparkConfig& config,
                                             gemma4::Gemma4Model& target, Backend& backend,
                                             uint64_t seed, DType dtype = DType::kBF16);
  ~DSparkModel();

  // Writes the specula layout (dspark.json + model.safetensors, weights in
  // their dtype) into `dir` (created if needed). Throws for a DeepSpec-layout model.
  void save(const std::string& dir) const;

  const DSparkConfig& config() const { return config_; }
  Backend& backend() const { return *backend_; }
  gemma4::Gemma4Model& target() const { return *target_; }
  int block_size() const { return config_.block_size; }
  int64_t vocab_size() const { return config_.target.vocab_size; }
  // "specula layout (γ 5, d 1024, 5 layers, r 256, taps [..])" for load logs.
  std::string description() const;
  // Bytes of the drafter's own weights (the target's embedding or head, when
  // borrowed, not counted).
  int64_t weight_bytes() const { return weight_bytes_; }

  // A fresh, empty context-KV cache for one sequence: every draft layer, room
  // for the target's context plus one block. Memory from the drafter's pool.
  SequenceKv new_context() const;

  // Projects the pieces' taps (f32 [m, M, H] on the device, m = taps().size())
  // into context rows and appends each piece's keys and values to its cache,
  // committing them. Validates every piece first (position == kv->length(),
  // room, tap rows within M), changing no cache on error.
  void commit_context(std::span<const ContextPiece> pieces, const Tensor& taps);

  // The backbone over B = ctx.size() rows: row b's block sits at positions
  // ctx[b]->length() .. + γ − 1 with anchor token anchors[b] (i32 [B] on the
  // device). Keeps U f32 [B·γ, V] (row b·γ + k: block position k of row b) and
  // the confidence head's hidden term until the next run_block().
  void run_block(std::span<SequenceKv* const> ctx, const Tensor& anchors);
  // Base logits of the last run_block(), f32 [B·γ, V] on the device.
  Tensor base_logits() const { return U_; }
  // Block hiddens h of the last run_block(), f32 [B·γ, d] on the device.
  Tensor block_hidden() const { return h_; }

  // One head step for B_k rows of the last block: u_rows[i] = b·γ + k picks
  // row i's base logits; prev i32 [B_k] (device) is the token each row extends
  // (the anchor at k = 0, else its last draft). Returns logits f32 [B_k, V] =
  // U[u_rows] + W1[prev]·W2ᵀ (valid until the next head_step or run_block), and
  // writes the confidence logits w·[h ; W1[prev]] + b (no sigmoid) into
  // `confidence` (f32 [B_k] on the device; ignored when empty or when the
  // drafter has no confidence head). `slot` (0 .. γ−1) picks the upload slot of
  // u_rows, so that steps queued back to back do not overwrite each other's.
  Tensor head_step(int slot, std::span<const int32_t> u_rows, const Tensor& prev,
                   const Tensor& confidence);
  bool has_confidence_head() const { return !weights_.confidence_weight.empty(); }

  // Start of the block scratch (moves only when a block needs more than any before).
  const void* arena_base() const { return block_arena_.base(); }
  // Bytes held by the scratch arenas (commit, block, head steps): grows only
  // for a forward, a block or a step of more rows than any before, so that
  // steady-state rounds leave it unchanged (what the tests check on the CPU,
  // whose arenas are host memory the backend does not count).
  size_t scratch_bytes() const {
    return commit_arena_.capacity() + block_arena_.capacity() + step_arena_.capacity();
  }

 private:
  DSparkModel() = default;
  void init_after_weights(const std::string& origin);
  // Block backbone layers of each layout (run_block's middle part).
  void specula_layers(std::span<SequenceKv* const> ctx);
  void deepspec_layers(std::span<SequenceKv* const> ctx);
  // Every row's attention over its cache and its block, for layer l (q, k, v,
  // out: the block scratch's [T, heads or kv_heads, D] rows, G a row): stores
  // each row's block k, v at its positions (its storage from prepare_block),
  // then attends with every query at attn_pos (the block's last position);
  // one store_kv_batch and one attention_batch call for all rows.
  void attend_rows(int64_t rows, int layer, const Tensor& q, const Tensor& k, const Tensor& v,
                   const Tensor& out, float scale);
  // run_block in two halves: validation, scratch, uploads and the caches'
  // host bookkeeping (never recorded), then the device work (recordable).
  void prepare_block(std::span<SequenceKv* const> ctx, const Tensor& anchors);
  void run_block_device(std::span<SequenceKv* const> ctx, const Tensor& anchors);
  // A head step in two halves: validation, growth and uploads (never
  // recorded), then the device work (recordable; reads head_).
  void prepare_head_step(int slot, std::span<const int32_t> u_rows, const Tensor& prev,
                         const Tensor& confidence);
  Tensor run_head_step();
  struct BlockScratch;
  struct CommitScratch;
  // The staged head step: rows, where its inputs and outputs are.
  struct HeadPlan {
    int64_t rows = 0;
    bool one = false;  // batch 1: the base row is read in place
    int32_t u0 = 0;    // the first row's base row
    bool conf = false;
    Tensor prev, confidence, idx, logits, e;
  };

  DSparkConfig config_;
  gemma4::Gemma4Model* target_ = nullptr;
  Backend* backend_ = nullptr;
  std::unique_ptr<io::Checkpoint> checkpoint_;  // null for random()
  DSparkWeights weights_;
  DeviceBuffer weight_buffer_;
  int64_t weight_bytes_ = 0;
  std::vector<float> layer_scalars_;  // DeepSpec layout: host copies of layer_scalar
  float confidence_bias_ = 0;         // host copy of the confidence bias
  float embed_scale_ = 1;             // DeepSpec: √H rounded to the embedding's dtype
  std::unique_ptr<CachingPool> ctx_pool_;
  KvCacheSpec ctx_spec_;
  // Constant device tables: RoPE inv_freq (DeepSpec), block base rows X0 (specula).
  DeviceBuffer const_buffer_;
  Tensor inv_freq_;    // f32 [D/2]
  Tensor block_base_;  // specula: f32 [γ, d]: block_pos[0]; mask_embed[j−1] + block_pos[j]

  // Scratch: the context commit (grows with the largest commit), the block
  // (with the largest B; holds U and h between steps), and the head steps.
  Arena commit_arena_, block_arena_, step_arena_;
  std::unique_ptr<CommitScratch> commit_;
  std::unique_ptr<BlockScratch> block_;
  Tensor U_, h_, hconf_;  // views in block_arena_
  int64_t block_rows_ = 0;
  // Host-staged index uploads (reused).
  std::vector<int32_t> host_idx_;
  DeviceBuffer step_idx_;  // i32 [γ, step_idx_rows_]: each slot's u_rows
  int64_t step_idx_rows_ = 0;
  DeviceBuffer bias_rows_;  // f32 [bias_rows_n_]: the confidence bias, once per block position
  int64_t bias_rows_n_ = 0;
  HeadPlan head_;
  StepGraphCache block_graphs_;  // recorded blocks (CUDA), keyed as run_block() says
  std::vector<int64_t> block_key_;
  StepGraphCache head_graphs_;  // recorded head steps (CUDA), keyed as head_step() says
  std::vector<int64_t> head_key_;
  std::vector<StoreKvParams> store_batch_;  // attend_rows' calls (reused)
  std::vector<AttentionParams> attention_batch_;
};

}  // namespace specula::dspark
