// SPDX-License-Identifier: Apache-2.0
// SequenceKv: the key/value cache of one sequence, for every cache-owning layer.
//
// Full-attention layers keep every position in a linear buffer of
// `max_context` rows. Sliding layers keep a ring of `window + max_rollback`
// rows, so that rolling back up to `max_rollback - 1` freshly written
// positions (rejected draft tokens) stays correct even after the ring wrapped:
// the window + 1 newest positions (what the next target query and an
// assistant drafter read) are still retained.
//
// Transactions: a forward writes the new positions [length, length + n) of each
// layer (write_full / write_ring), and `commit(n)` makes them part of the
// sequence. `truncate(len)` rolls back; writes past `length()` are invisible.
#pragma once

#include <cstdint>
#include <vector>

#include "engine/backend/backends.h"
#include "engine/core/buffer.h"
#include "engine/memory/memory_resource.h"

namespace specula {

struct KvLayerSpec {
  bool owns_cache = false;  // KV-shared layers own none
  int n_kv_heads = 0;
  int head_dim = 0;
  int window = 0;  // 0 = full attention (linear buffer), else ring of window + rollback
};

struct KvCacheSpec {
  std::vector<KvLayerSpec> layers;  // one entry per model layer
  int64_t max_context = 0;          // positions a sequence may reach
  int max_rollback = 16;            // ring slack for speculative rollback
  // Element type of the stored keys and values: f32, or bf16 (half the bytes;
  // rows written in f32 are rounded to nearest even on the way in, and
  // attention widens them back to f32 exactly), or f8e4m3 (a quarter of the
  // bytes plus one f32 scale per (token, kv head) vector of head_dim values,
  // quantized by the rules of kv_e4m3_quantize_row in engine/core/dtype.h;
  // attention dequantizes to f32). Every view below has it, fp8 views with
  // their scales (Tensor::scales, [rows · KV]) attached.
  DType dtype = DType::kF32;
  // Where the cache lives: copies go through `backend` (null: the CPU backend)
  // and memory comes from `memory` (null: the backend itself), typically the
  // model's CachingPool so finished sequences' buffers are reused. Not owned.
  Backend* backend = nullptr;
  MemoryResource* memory = nullptr;
};

// Bytes one cached (token, kv head) vector of head_dim values takes at `dtype`:
// head_dim elements, plus its f32 scale for f8e4m3.
int64_t kv_head_row_bytes(DType dtype, int64_t head_dim);

// Bytes one sequence's cache takes: K and V of every cache-owning layer at
// spec.dtype, scales included (sliding layers: their ring of window +
// max_rollback rows).
int64_t kv_bytes_per_sequence(const KvCacheSpec& spec);

class SequenceKv {
 public:
  explicit SequenceKv(const KvCacheSpec& spec);
  SequenceKv(SequenceKv&&) noexcept = default;
  SequenceKv& operator=(SequenceKv&&) noexcept = default;

  int64_t length() const { return length_; }
  int64_t max_context() const { return spec_.max_context; }
  const KvCacheSpec& spec() const { return spec_; }
  bool is_ring(int layer) const { return spec_.layers[static_cast<size_t>(layer)].window > 0; }

  // Full layers: views of rows [0, end) of the linear buffers, [end, kv, D] of
  // spec().dtype (as every storage view below).
  Tensor full_keys(int layer, int64_t end) const;
  Tensor full_values(int layer, int64_t end) const;
  // Writes positions [pos, pos + n) of a full layer. k, v f32 [n, kv, D] (or of
  // the cache's dtype), converted to the cache's dtype (Backend::convert).
  void write_full(int layer, int64_t pos, const Tensor& k, const Tensor& v);

  // Ring layers: copies positions [from, to) (which must be retained) into
  // k_out, v_out [to - from, kv, D] (f32 or the cache's dtype) in temporal order.
  void read_ring(int layer, int64_t from, int64_t to, const Tensor& k_out,
                 const Tensor& v_out) const;
  // Writes positions [pos, pos + n) into the ring (only the last `capacity` of
  // them are kept).
  void write_ring(int layer, int64_t pos, const Tensor& k, const Tensor& v);
  // The whole ring of a sliding layer, f32 [capacity, kv, D]: position p is at
  // row p % capacity (for attention that reads the ring in place).
  Tensor ring_storage_k(int layer) const;
  Tensor ring_storage_v(int layer) const;
  // Where a backend's store_kv puts positions [pos, pos + n) of `layer` (row
  // p mod R of the returned storage, f32 [R, kv, D] each): records them as
  // written, exactly as write_full / write_ring would, and returns the whole
  // storage. n must be at most R. The caller queues the store itself (the rows
  // are then device-side work: a recorded step can replay it at new positions).
  struct Storage {
    Tensor k, v;
  };
  Storage store_target(int layer, int64_t pos, int64_t n);

  // Oldest position still stored in the ring of `layer`.
  int64_t ring_oldest(int layer) const;

  // Makes n more positions part of the sequence. Throws past max_context.
  void commit(int64_t n);
  // Rolls back to `new_length` (≤ length()). Throws, naming the layer and the
  // positions, if a sliding ring no longer holds the window that position needs.
  void truncate(int64_t new_length);
  // Checks that n new positions fit: throws naming the context size otherwise.
  void check_room(int64_t n) const;

 private:
  struct LayerStore {
    DeviceBuffer k_buf, v_buf;
    DeviceBuffer k_scale_buf, v_scale_buf;  // f8e4m3 only: f32 [capacity · kv]
    Tensor k;  // [capacity, kv, D] of spec_.dtype over k_buf (with its scales)
    Tensor v;
    int64_t capacity = 0;
    int64_t written_end = 0;    // one past the newest position written
    int64_t retained_from = 0;  // ring: oldest position still intact
  };
  const LayerStore& store(int layer) const;
  LayerStore& store(int layer);

  // Copies rows [from, from + n) of `src` into rows [to, to + n) of `dst`,
  // converting to dst's dtype (fp8 rows with their scales).
  void copy_rows(const Tensor& src, int64_t from, const Tensor& dst, int64_t to, int64_t n) const;

  KvCacheSpec spec_;
  Backend* backend_ = nullptr;
  std::vector<LayerStore> stores_;  // one per model layer (empty for shared layers)
  int64_t length_ = 0;
};

}  // namespace specula
