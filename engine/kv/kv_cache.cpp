// SPDX-License-Identifier: Apache-2.0
#include "engine/kv/kv_cache.h"

#include <algorithm>
#include <cstring>

namespace specula {

SequenceKv::SequenceKv(const KvCacheSpec& spec) : spec_(spec) {
  SPECULA_CHECK(spec.max_context > 0, "max_context must be positive, got {}", spec.max_context);
  SPECULA_CHECK(spec.max_rollback >= 0, "max_rollback must be >= 0, got {}", spec.max_rollback);
  stores_.resize(spec.layers.size());
  for (size_t i = 0; i < spec.layers.size(); ++i) {
    const KvLayerSpec& l = spec.layers[i];
    if (!l.owns_cache) continue;
    LayerStore& s = stores_[i];
    s.capacity = l.window > 0 ? std::min<int64_t>(l.window + spec.max_rollback, spec.max_context)
                              : spec.max_context;
    s.k = HostTensor(DType::kF32, {s.capacity, l.n_kv_heads, l.head_dim});
    s.v = HostTensor(DType::kF32, {s.capacity, l.n_kv_heads, l.head_dim});
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
  return s.k.view().slice_rows(0, end);
}

Tensor SequenceKv::full_values(int layer, int64_t end) const {
  const LayerStore& s = store(layer);
  SPECULA_CHECK(!is_ring(layer) && end <= s.capacity, "layer {}: full view to {} (capacity {})",
                layer, end, s.capacity);
  return s.v.view().slice_rows(0, end);
}

void SequenceKv::write_full(int layer, int64_t pos, const Tensor& k, const Tensor& v) {
  LayerStore& s = store(layer);
  const int64_t n = k.dim(0);
  SPECULA_CHECK(pos >= 0 && pos + n <= s.capacity,
                "layer {}: writing positions [{}, {}) past the context of {}", layer, pos, pos + n,
                s.capacity);
  std::memcpy(s.k.view().slice_rows(pos, pos + n).data(), k.data(), k.nbytes());
  std::memcpy(s.v.view().slice_rows(pos, pos + n).data(), v.data(), v.nbytes());
  s.written_end = std::max(s.written_end, pos + n);
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
  const size_t row_bytes = s.k.view().nbytes() / static_cast<size_t>(s.capacity);
  for (int64_t p = from; p < to; ++p) {
    const int64_t slot = p % s.capacity;
    std::memcpy(static_cast<char*>(k_out.data()) + static_cast<size_t>(p - from) * row_bytes,
                static_cast<const char*>(s.k.view().data()) + static_cast<size_t>(slot) * row_bytes,
                row_bytes);
    std::memcpy(static_cast<char*>(v_out.data()) + static_cast<size_t>(p - from) * row_bytes,
                static_cast<const char*>(s.v.view().data()) + static_cast<size_t>(slot) * row_bytes,
                row_bytes);
  }
}

void SequenceKv::write_ring(int layer, int64_t pos, const Tensor& k, const Tensor& v) {
  LayerStore& s = store(layer);
  const int64_t n = k.dim(0);
  SPECULA_CHECK(pos >= 0 && pos <= s.written_end,
                "layer {}: ring write at {} leaves a gap after {}", layer, pos, s.written_end);
  const size_t row_bytes = s.k.view().nbytes() / static_cast<size_t>(s.capacity);
  // Only the newest `capacity` positions survive; skip the rest.
  for (int64_t i = std::max<int64_t>(0, n - s.capacity); i < n; ++i) {
    const int64_t slot = (pos + i) % s.capacity;
    std::memcpy(static_cast<char*>(s.k.view().data()) + static_cast<size_t>(slot) * row_bytes,
                static_cast<const char*>(k.data()) + static_cast<size_t>(i) * row_bytes, row_bytes);
    std::memcpy(static_cast<char*>(s.v.view().data()) + static_cast<size_t>(slot) * row_bytes,
                static_cast<const char*>(v.data()) + static_cast<size_t>(i) * row_bytes, row_bytes);
  }
  // Positions past pos + n are stale (rolled back); positions before pos survive
  // unless their slots were just reused.
  const int64_t kept_before = pos >= s.retained_from ? s.retained_from : pos;
  s.retained_from = std::max(kept_before, pos + n - s.capacity);
  s.written_end = pos + n;
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
