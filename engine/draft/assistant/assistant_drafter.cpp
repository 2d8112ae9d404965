// SPDX-License-Identifier: Apache-2.0
#include "engine/draft/assistant/assistant_drafter.h"

#include <cstring>

namespace specula::assistant {

AssistantDraftSource::AssistantDraftSource(gemma4::Gemma4Model& target, AssistantDrafter& drafter)
    : target_(target), drafter_(drafter), donors_(target.backend(), target.config()) {}

Tensor AssistantDraftSource::step(int step_index, std::span<const DraftRow> rows) {
  const int64_t B = static_cast<int64_t>(rows.size());
  const int64_t Hb = drafter_.config().backbone_hidden_size;
  if (ids_.view().empty() || ids_.numel() < B) {
    ids_ = HostTensor(DType::kI32, {B});
    positions_ = HostTensor(DType::kI32, {B});
    embeds_ = HostTensor(DType::kF32, {B, Hb});
    hidden_in_ = HostTensor(DType::kF32, {B, Hb});
  }
  Tensor ids = ids_.view().slice_rows(0, B);
  Tensor positions = positions_.view().slice_rows(0, B);
  Tensor embeds = embeds_.view().slice_rows(0, B);
  Tensor hidden = hidden_in_.view().slice_rows(0, B);
  kvs_.clear();
  for (int64_t b = 0; b < B; ++b) {
    const DraftRow& r = rows[static_cast<size_t>(b)];
    ids.data_as<int32_t>()[b] = r.token;
    positions.data_as<int32_t>()[b] = r.position;
    kvs_.push_back(r.target_kv);
    HostTensor& h = hidden_[r.request];
    if (h.numel() != Hb) h = HostTensor(DType::kF32, {Hb});
    if (step_index == 0) {
      SPECULA_CHECK(r.target_hidden != nullptr,
                    "draft step 0 of request {} needs the target hidden", r.request);
      std::memcpy(h.data<float>(), r.target_hidden, static_cast<size_t>(Hb) * sizeof(float));
    }
    std::memcpy(hidden.data_as<float>() + b * Hb, h.data<float>(),
                static_cast<size_t>(Hb) * sizeof(float));
  }
  target_.embed_scaled(ids, embeds);
  donors_.bind(kvs_);
  DraftStepOutputs out =
      drafter_.step({.token_embeds = embeds, .hidden = hidden, .positions = positions}, donors_);
  for (int64_t b = 0; b < B; ++b) {
    std::memcpy(hidden_[rows[static_cast<size_t>(b)].request].data<float>(),
                out.next_hidden.data_as<const float>() + b * Hb,
                static_cast<size_t>(Hb) * sizeof(float));
  }
  return out.logits;
}

}  // namespace specula::assistant
