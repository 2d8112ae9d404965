// SPDX-License-Identifier: Apache-2.0
// DonorAttention: how a drafter whose layers own no K/V (the Gemma 4 assistant)
// attends to the target's donor caches. The drafter's graph only hands over
// queries; the storage behind this interface owns validity, layout and
// encoding, so the same graph serves any cache implementation.
#pragma once

#include <span>
#include <vector>

#include "engine/kv/kv_cache.h"
#include "engine/memory/memory_resource.h"
#include "engine/model/gemma4/config.h"
#include "engine/ops/backend.h"

namespace specula {

class DonorAttention {
 public:
  virtual ~DonorAttention() = default;
  // One query per row: q f32 [B, n_heads, D] → out f32 [B, n_heads, D], row b
  // attending (bidirectionally) over row b's donor K/V of layer type `type`.
  // `recent` > 0 keeps only the most recent `recent` entries (sliding layers).
  virtual void attend(gemma4::LayerType type, const Tensor& q, int recent, float scale,
                      const Tensor& out) = 0;
};

// DonorAttention over the target's per-sequence caches: row b reads positions
// [0, kv_b.length()) of the target's last sliding and last full donor layers.
// Runs on `backend`'s device (the target's caches live there too).
class TargetCacheDonors : public DonorAttention {
 public:
  // Sliding donors are read in place from the target's ring (no gather, no
  // scratch): steady steps allocate nothing.
  TargetCacheDonors(Backend& backend, const gemma4::Gemma4Config& target);
  // Binds the rows of the next draft steps (pointers must stay valid while used).
  // newest_keys: i32 [B] on the device holding each row's kv.length() - 1 (the
  // position its donor query sits at, so that attention reads its key range
  // from the device and a recorded step serves later steps); empty: uploaded
  // here (one small synchronous upload).
  void bind(std::span<SequenceKv* const> rows, const Tensor& newest_keys = Tensor());
  void attend(gemma4::LayerType type, const Tensor& q, int recent, float scale,
              const Tensor& out) override;

 private:
  Backend& backend_;
  int sliding_donor_ = -1;
  int full_donor_ = -1;
  std::vector<SequenceKv*> rows_;
  DeviceBuffer own_keys_;  // i32 [B] newest key positions when bind() gets none
  Tensor newest_keys_;     // i32 [B] (bound)
  std::vector<int32_t> host_keys_;
  std::vector<AttentionParams> entries_;  // attend()'s calls, one a row (reused)
};

}  // namespace specula
