// SPDX-License-Identifier: Apache-2.0
// AssistantDraftSource: the Drafter interface over a Gemma 4 assistant and its
// target. It keeps each row's chained hidden state between the steps of a round,
// on the models' device.
#pragma once

#include <memory>
#include <vector>

#include "engine/draft/assistant/assistant.h"
#include "engine/draft/drafter.h"
#include "engine/memory/memory_resource.h"
#include "engine/model/gemma4/gemma4.h"
#include "engine/ops/step_graphs.h"

namespace specula::assistant {

class AssistantDraftSource : public Drafter {
 public:
  // Both models must outlive this object and run on the same Backend.
  AssistantDraftSource(gemma4::Gemma4Model& target, AssistantDrafter& drafter);
  int64_t vocab_size() const override { return drafter_.config().text.vocab_size; }
  // Returns f32 [rows.size(), V] logits on the models' device.
  Tensor step(int step_index, std::span<const DraftRow> rows) override;
  bool takes_device_inputs() const override { return true; }
  Tensor step_on_device(int step_index, std::span<const DraftRow> rows,
                        const DraftDeviceInputs& inputs) override;

 private:
  // Both step()s: tokens and step-0 hiddens from `device` when given, else from `rows`.
  Tensor draft_step(int step_index, std::span<const DraftRow> rows,
                    const DraftDeviceInputs* device);
  // The device work of a step after its uploads (recordable with the dense head).
  Tensor run_step(const Tensor& ids_positions, const Tensor& embeds, const Tensor& hidden,
                  int64_t B);

  gemma4::Gemma4Model& target_;
  AssistantDrafter& drafter_;
  Backend& backend_;
  TargetCacheDonors donors_;
  // Chained hidden of the rows of the round's step 0, in their order: row j of
  // chain_ (f32 [B0, Hb] on the device) belongs to request chain_requests_[j].
  // Later steps take a subset of those rows, in the same order.
  DeviceBuffer chain_;
  std::vector<int> chain_requests_;
  std::vector<int64_t> slots_;  // chain row of each row of the current step
  // Per-step device inputs, grown to the largest step: i32 [3, B] (ids,
  // positions, newest target keys: one upload), f32 [B, Hb] token embeddings
  // and gathered hidden.
  DeviceBuffer inputs_;
  int64_t input_rows_ = 0;
  std::vector<int32_t> host_ids_;   // [3, B] staging for the ids/positions upload
  std::vector<float> host_hidden_;  // [B, Hb] step-0 target hiddens, staged for one upload
  std::vector<SequenceKv*> kvs_;
  // Recorded steps by shape (rows, chain slots, positions bounds, caches and
  // buffers), each returning its logits view.
  StepGraphCache graphs_;
  std::vector<int64_t> graph_key_;
};

}  // namespace specula::assistant
