// SPDX-License-Identifier: Apache-2.0
#include "engine/kv/kv_cache.h"

#include <algorithm>
#include <cstring>

namespace specula {

namespace {
int64_t capacity_of(const KvCacheSpec& spec, const KvLayerSpec& l) {
  return l.window > 0 ? std::min<int64_t>(l.window + spec.max_rollback, spec.max_context)
                      : spec.max_context;
}
}  // namespace

int64_t kv_head_row_bytes(DType dtype, int64_t head_dim) {
  const int64_t scale = dtype == DType::kF8E4M3 ? int64_t{sizeof(float)} : 0;
  return head_dim * static_cast<int64_t>(dtype_size(dtype)) + scale;
}

int64_t kv_bytes_per_sequence(const KvCacheSpec& spec) {
  int64_t bytes = 0;
  for (const KvLayerSpec& l : spec.layers) {
    if (!l.owns_cache) continue;
    bytes += 2 * capacity_of(spec, l) * l.n_kv_heads * kv_head_row_bytes(spec.dtype, l.head_dim);
  }
  return bytes;
}

SequenceKv::SequenceKv(const KvCacheSpec& spec) : spec_(spec) {
  SPECULA_CHECK(spec.max_context > 0, "max_context must be positive, got {}", spec.max_context);
  SPECULA_CHECK(spec.max_rollback >= 0, "max_rollback must be >= 0, got {}", spec.max_rollback);
  SPECULA_CHECK(
      spec.dtype == DType::kF32 || spec.dtype == DType::kBF16 || spec.dtype == DType::kF8E4M3,
      "KV cache dtype must be f32, bf16 or f8e4m3, got {}", dtype_name(spec.dtype));
  backend_ = spec.backend ? spec.backend : &backend_for(Device::cpu());
  MemoryResource& memory = spec.memory ? *spec.memory : *backend_;
  stores_.resize(spec.layers.size());
  for (size_t i = 0; i < spec.layers.size(); ++i) {
    const KvLayerSpec& l = spec.layers[i];
    if (!l.owns_cache) continue;
    LayerStore& s = stores_[i];
    s.capacity = capacity_of(spec, l);
    const Shape shape{s.capacity, l.n_kv_heads, l.head_dim};
    const size_t bytes = static_cast<size_t>(shape.numel()) * dtype_size(spec.dtype);
    s.k_buf = DeviceBuffer(memory, bytes);
    s.v_buf = DeviceBuffer(memory, bytes);
    s.k = s.k_buf.view(spec.dtype, shape);
    s.v = s.v_buf.view(spec.dtype, shape);
    if (spec.dtype == DType::kF8E4M3) {
      // One f32 scale per (row, kv head), carried by the views (Tensor::scales).
      const size_t scale_bytes = static_cast<size_t>(s.capacity * l.n_kv_heads) * sizeof(float);
      s.k_scale_buf = DeviceBuffer(memory, scale_bytes);
      s.v_scale_buf = DeviceBuffer(memory, scale_bytes);
      s.k = s.k.with_scales(static_cast<const float*>(s.k_scale_buf.data()));
      s.v = s.v.with_scales(static_cast<const float*>(s.v_scale_buf.data()));
    }
  }
}

const SequenceKv::LayerStore& SequenceKv::store(int layer) const {
  SPECULA_CHECK(layer >= 0 && static_cast<size_t>(layer) < stores_.size() &&
                    spec_.layers[static_cast<size_t>(layer)].owns_cache,
                "layer {} has no KV cache", layer);
  return stores_[static_cast<size_t>(layer)];
}
SequenceKv::LayerStore& SequenceKv::store(int layer) {
  return const_cast<LayerStore&>(static_cast<const SequenceKv*>(this)->store(layer));
}

Tensor SequenceKv::full_keys(int layer, int64_t end) const {
  const LayerStore& s = store(layer);
  SPECULA_CHECK(!is_ring(layer) && end <= s.capacity, "layer {}: full view to {} (capacity {})",
                layer, end, s.capacity);
  return s.k.slice_rows(0, end);
}

Tensor SequenceKv::full_values(int layer, int64_t end) const {
  const LayerStore& s = store(layer);
  SPECULA_CHECK(!is_ring(layer) && end <= s.capacity, "layer {}: full view to {} (capacity {})",
                layer, end, s.capacity);
  return s.v.slice_rows(0, end);
}

void SequenceKv::write_full(int layer, int64_t pos, const Tensor& k, const Tensor& v) {
  LayerStore& s = store(layer);
  const int64_t n = k.dim(0);
  SPECULA_CHECK(pos >= 0 && pos + n <= s.capacity,
                "layer {}: writing positions [{}, {}) past the context of {}", layer, pos, pos + n,
                s.capacity);
  copy_rows(k, 0, s.k, pos, n);
  copy_rows(v, 0, s.v, pos, n);
  s.written_end = std::max(s.written_end, pos + n);
}

Tensor SequenceKv::ring_storage_k(int layer) const {
  SPECULA_CHECK(is_ring(layer), "layer {} is not a sliding (ring) layer", layer);
  return store(layer).k;
}

Tensor SequenceKv::ring_storage_v(int layer) const {
  SPECULA_CHECK(is_ring(layer), "layer {} is not a sliding (ring) layer", layer);
  return store(layer).v;
}

int64_t SequenceKv::ring_oldest(int layer) const {
  return store(layer).retained_from;
}

void SequenceKv::read_ring(int layer, int64_t from, int64_t to, const Tensor& k_out,
                           const Tensor& v_out) const {
  const LayerStore& s = store(layer);
  SPECULA_CHECK(from >= ring_oldest(layer) && to <= s.written_end && from <= to,
                "layer {}: positions [{}, {}) are not retained (ring holds [{}, {}))", layer, from,
                to, ring_oldest(layer), s.written_end);
  // At most two contiguous runs of slots (before and after the wrap).
  for (int64_t p = from; p < to;) {
    const int64_t slot = p % s.capacity;
    const int64_t run = std::min(to - p, s.capacity - slot);
    copy_rows(s.k, slot, k_out, p - from, run);
    copy_rows(s.v, slot, v_out, p - from, run);
    p += run;
  }
}

void SequenceKv::write_ring(int layer, int64_t pos, const Tensor& k, const Tensor& v) {
  LayerStore& s = store(layer);
  const int64_t n = k.dim(0);
  SPECULA_CHECK(pos >= 0 && pos <= s.written_end,
                "layer {}: ring write at {} leaves a gap after {}", layer, pos, s.written_end);
  // Only the newest `capacity` positions survive; skip the rest. At most two
  // contiguous runs of slots.
  for (int64_t i = std::max<int64_t>(0, n - s.capacity); i < n;) {
    const int64_t slot = (pos + i) % s.capacity;
    const int64_t run = std::min(n - i, s.capacity - slot);
    copy_rows(k, i, s.k, slot, run);
    copy_rows(v, i, s.v, slot, run);
    i += run;
  }
  // Positions past pos + n are stale (rolled back); positions before pos survive
  // unless their slots were just reused.
  const int64_t kept_before = pos >= s.retained_from ? s.retained_from : pos;
  s.retained_from = std::max(kept_before, pos + n - s.capacity);
  s.written_end = pos + n;
}

SequenceKv::Storage SequenceKv::store_target(int layer, int64_t pos, int64_t n) {
  LayerStore& s = store(layer);
  SPECULA_CHECK(n >= 0 && n <= s.capacity, "layer {}: storing {} rows in a cache of {} rows", layer,
                n, s.capacity);
  if (!is_ring(layer)) {
    SPECULA_CHECK(pos >= 0 && pos + n <= s.capacity,
                  "layer {}: writing positions [{}, {}) past the context of {}", layer, pos,
                  pos + n, s.capacity);
    s.written_end = std::max(s.written_end, pos + n);
  } else {
    SPECULA_CHECK(pos >= 0 && pos <= s.written_end,
                  "layer {}: ring write at {} leaves a gap after {}", layer, pos, s.written_end);
    const int64_t kept_before = pos >= s.retained_from ? s.retained_from : pos;
    s.retained_from = std::max(kept_before, pos + n - s.capacity);
    s.written_end = pos + n;
  }
  return {s.k, s.v};
}

void SequenceKv::copy_rows(const Tensor& src, int64_t from, const Tensor& dst, int64_t to,
                           int64_t n) const {
  if (n <= 0) return;
  backend_->convert(src.slice_rows(from, from + n), dst.slice_rows(to, to + n));
}

void SequenceKv::check_room(int64_t n) const {
  if (length_ + n > spec_.max_context) {
    fail("sequence of {} tokens plus {} new ones exceeds the context size of {} tokens", length_, n,
         spec_.max_context);
  }
}

void SequenceKv::commit(int64_t n) {
  check_room(n);
  length_ += n;
}

void SequenceKv::truncate(int64_t new_length) {
  SPECULA_CHECK(new_length >= 0 && new_length <= length_,
                "cannot truncate a sequence of {} tokens to {}", length_, new_length);
  for (size_t i = 0; i < spec_.layers.size(); ++i) {
    const KvLayerSpec& l = spec_.layers[i];
    if (!l.owns_cache || l.window == 0) continue;
    // The target's next query needs keys from new_length - window + 1; an
    // assistant drafter reads the newest window + 1 entries. Keep both intact.
    const int64_t needed_from = std::max<int64_t>(0, new_length - l.window - 1);
    if (needed_from < ring_oldest(static_cast<int>(i))) {
      fail(
          "cannot roll back to {} tokens: sliding layer {} only retains positions from {} (window "
          "{}, "
          "rollback slack {})",
          new_length, i, ring_oldest(static_cast<int>(i)), l.window, spec_.max_rollback);
    }
  }
  length_ = new_length;
}

}  // namespace specula
