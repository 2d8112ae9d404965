// SPDX-License-Identifier: Apache-2.0
#include "engine/draft/donor_attention.h"

#include <algorithm>

namespace specula {

TargetCacheDonors::TargetCacheDonors(Backend& backend, const gemma4::Gemma4Config& target)
    : backend_(backend), sliding_donor_(target.sliding_donor), full_donor_(target.full_donor) {}

void TargetCacheDonors::bind(std::span<SequenceKv* const> rows, const Tensor& newest_keys) {
  rows_.assign(rows.begin(), rows.end());
  const int64_t B = static_cast<int64_t>(rows_.size());
  if (!newest_keys.empty()) {
    SPECULA_CHECK(newest_keys.dtype() == DType::kI32 && newest_keys.shape() == Shape({B}),
                  "donor attention: newest_keys {} must be i32[{}]", newest_keys.describe(), B);
    newest_keys_ = newest_keys;
    return;
  }
  host_keys_.resize(rows_.size());
  for (size_t b = 0; b < rows_.size(); ++b) {
    host_keys_[b] = static_cast<int32_t>(rows_[b]->length() - 1);
  }
  if (own_keys_.size() < host_keys_.size() * sizeof(int32_t)) {
    own_keys_ = DeviceBuffer(backend_, host_keys_.size() * sizeof(int32_t));
  }
  newest_keys_ = own_keys_.view(DType::kI32, {B});
  backend_.upload_async(host_keys_.data(), newest_keys_);
}

void TargetCacheDonors::attend(gemma4::LayerType type, const Tensor& q, int recent, float scale,
                               const Tensor& out) {
  const int donor = type == gemma4::LayerType::kSliding ? sliding_donor_ : full_donor_;
  if (donor < 0) fail("the target has no donor layer of the type this drafter layer attends to");
  SPECULA_CHECK_EQ(q.dim(0), static_cast<int64_t>(rows_.size()), "donor attention rows");
  const int64_t n_heads = q.dim(1), D = q.dim(2);
  // Every row's attention in one call (a backend may serve them with one launch).
  entries_.clear();
  for (size_t b = 0; b < rows_.size(); ++b) {
    SequenceKv& kv = *rows_[b];
    const int64_t length = kv.length();
    SPECULA_CHECK(length > 0, "row {}: the drafter needs a prefilled target cache", b);
    const int64_t from = recent > 0 ? std::max<int64_t>(0, length - recent) : 0;
    Tensor k, v;
    int64_t ring_keys = -1;
    if (kv.is_ring(donor)) {
      // Read the ring in place (same results as the keys gathered in order).
      SPECULA_CHECK(from >= kv.ring_oldest(donor), "row {}: ring of layer {} lost position {}", b,
                    donor, from);
      k = kv.ring_storage_k(donor);
      v = kv.ring_storage_v(donor);
      ring_keys = length - from;
    } else {
      k = kv.full_keys(donor, length).slice_rows(from, length);
      v = kv.full_values(donor, length).slice_rows(from, length);
    }
    AttentionParams& p = entries_.emplace_back();
    p.q =
        q.slice_rows(static_cast<int64_t>(b), static_cast<int64_t>(b) + 1).reshape({1, n_heads, D});
    p.k = k;
    p.v = v;
    p.out = out.slice_rows(static_cast<int64_t>(b), static_cast<int64_t>(b) + 1)
                .reshape({1, n_heads, D});
    // Every key in [from, length) and nothing else, written as causal
    // attention of a query at the newest key with a window of `recent` (the
    // same keys, so the same results), so that the launch can take its key
    // range from the device position (positions_bound: recordable).
    p.q_positions = newest_keys_.slice_rows(static_cast<int64_t>(b), static_cast<int64_t>(b) + 1);
    p.k_pos0 = from;
    p.ring_keys = ring_keys;
    p.causal = true;
    p.window = recent;
    p.positions_bound = positions_bound_for(length);
    p.scale = scale;
  }
  backend_.attention_batch(entries_);
}

}  // namespace specula
