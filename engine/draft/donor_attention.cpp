// SPDX-License-Identifier: Apache-2.0
#include "engine/draft/donor_attention.h"

#include <algorithm>

namespace specula {

TargetCacheDonors::TargetCacheDonors(Backend& backend, const gemma4::Gemma4Config& target)
    : backend_(backend),
      sliding_donor_(target.sliding_donor),
      full_donor_(target.full_donor),
      positions_(backend, sizeof(int32_t)) {
  const int32_t zero = 0;
  backend_.upload(&zero, positions_.view(DType::kI32, {1}));
  if (sliding_donor_ >= 0) {
    const gemma4::LayerSpec& spec = target.layers[static_cast<size_t>(sliding_donor_)];
    reserve_gather((int64_t{target.sliding_window} + 1) * spec.n_kv_heads * spec.head_dim);
  }
}

void TargetCacheDonors::reserve_gather(int64_t elements) {
  const size_t bytes = static_cast<size_t>(elements) * sizeof(float);
  if (gather_k_.size() >= bytes) return;
  gather_k_ = DeviceBuffer(backend_, bytes);
  gather_v_ = DeviceBuffer(backend_, bytes);
}

void TargetCacheDonors::bind(std::span<SequenceKv* const> rows) {
  rows_.assign(rows.begin(), rows.end());
}

void TargetCacheDonors::attend(gemma4::LayerType type, const Tensor& q, int recent, float scale,
                               const Tensor& out) {
  const int donor = type == gemma4::LayerType::kSliding ? sliding_donor_ : full_donor_;
  if (donor < 0) fail("the target has no donor layer of the type this drafter layer attends to");
  SPECULA_CHECK_EQ(q.dim(0), static_cast<int64_t>(rows_.size()), "donor attention rows");
  const int64_t n_heads = q.dim(1), D = q.dim(2);
  for (size_t b = 0; b < rows_.size(); ++b) {
    SequenceKv& kv = *rows_[b];
    const int64_t length = kv.length();
    SPECULA_CHECK(length > 0, "row {}: the drafter needs a prefilled target cache", b);
    const int64_t from = recent > 0 ? std::max<int64_t>(0, length - recent) : 0;
    Tensor k, v;
    if (kv.is_ring(donor)) {
      const KvLayerSpec& spec = kv.spec().layers[static_cast<size_t>(donor)];
      const int64_t rows = length - from;
      // Rows of one step reuse the same scratch: ops are queued in order, so row
      // b's attention has read it before row b + 1's gather overwrites it.
      reserve_gather(rows * spec.n_kv_heads * spec.head_dim);
      k = gather_k_.view(DType::kF32, {rows, spec.n_kv_heads, spec.head_dim});
      v = gather_v_.view(DType::kF32, {rows, spec.n_kv_heads, spec.head_dim});
      kv.read_ring(donor, from, length, k, v);
    } else {
      k = kv.full_keys(donor, length).slice_rows(from, length);
      v = kv.full_values(donor, length).slice_rows(from, length);
    }
    AttentionParams p;
    p.q =
        q.slice_rows(static_cast<int64_t>(b), static_cast<int64_t>(b) + 1).reshape({1, n_heads, D});
    p.k = k;
    p.v = v;
    p.out = out.slice_rows(static_cast<int64_t>(b), static_cast<int64_t>(b) + 1)
                .reshape({1, n_heads, D});
    p.q_positions = positions_.view(DType::kI32, {1});
    p.k_pos0 = from;
    p.causal = false;
    p.window = 0;
    p.scale = scale;
    backend_.attention(p);
  }
}

}  // namespace specula
