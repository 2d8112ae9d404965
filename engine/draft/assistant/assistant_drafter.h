// SPDX-License-Identifier: Apache-2.0
// AssistantDrafter: the Drafter interface over a Gemma 4 assistant and its
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

class AssistantDrafter : public Drafter {
 public:
  // Both models must outlive this object and run on the same Backend.
  AssistantDrafter(gemma4::Gemma4Model& target, AssistantModel& drafter);
  int64_t vocab_size() const override { return drafter_.config().text.vocab_size; }
  // Returns f32 [rows.size(), V] logits on the models' device.
  Tensor step(int step_index, std::span<const DraftRow> rows) override;
  bool takes_device_inputs() const override { return true; }
  Tensor step_on_device(int step_index, std::span<const DraftRow> rows,
                        const DraftDeviceInputs& inputs) override;
 private:
  // A step in two halves: stage() plans and uploads (host), run_staged_step()
  // queues the device work (recorded by shape); append_step_key() appends what
  // that device work depends on besides device memory.
  void append_step_key(int step_index, std::vector<int64_t>& key) const;
  Tensor run_staged_step(int step_index);
  // What a staged step's device half needs: its rows, their chain rows and
  // caches (bound to its own donors), and the device inputs to copy in.
  struct StepPlan {
    StepPlan(Backend& be, const gemma4::Gemma4Config& target) : donors(be, target) {}
    int64_t B = 0;
    int slot = 0;                // input slot of its ids and positions
    std::vector<int64_t> slots;  // chain row of each row
    std::vector<SequenceKv*> kvs;
    TargetCacheDonors donors;
    Tensor device_tokens, device_hidden;  // DraftDeviceInputs (empty on the host path)
    std::vector<int32_t> host_ids;        // [3, B] ids, positions, newest keys as uploaded
  };
  // One input slot of the inputs buffer (ids and positions of B rows) and the
  // shared per-step scratch.
  struct InputViews {
    Tensor ids_positions;  // i32 [3, B]: ids, positions, each row's newest target key
    Tensor embeds;         // f32 [B, Hb] token embeddings
    Tensor gathered;       // f32 [B, Hb] chain rows gathered for a step of fewer rows
  };
  InputViews input_views(int slot, int64_t B) const;
  void check_device_inputs(int step_index, std::span<const DraftRow> rows,
                           const DraftDeviceInputs& inputs) const;
  // Both step()s: stage, then run the device half (recorded by shape).
  Tensor draft_step(int step_index, std::span<const DraftRow> rows,
                    const DraftDeviceInputs* device);
  // The host half of a step: plan, upload ids and positions into input slot
  // `slot` (a step run at once takes slot 0; steps staged ahead of a recorded
  // round take one each), and on the host path step 0's hiddens; bind the
  // donors.
  void stage(int step_index, std::span<const DraftRow> rows, const DraftDeviceInputs* device,
             int slot);

  gemma4::Gemma4Model& target_;
  AssistantModel& drafter_;
  Backend& backend_;
  // Chained hidden of the rows of the round's step 0, in their order: row j of
  // chain_ (f32 [B0, Hb] on the device) belongs to request chain_requests_[j].
  // Later steps take a subset of those rows, in the same order.
  DeviceBuffer chain_;
  std::vector<int> chain_requests_;
  std::vector<StepPlan> plans_;  // by step index; [0, staged_steps_) belong to this round
  int staged_steps_ = 0;
  // Device inputs: input_steps_ slots of i32 [3, input_rows_], then f32
  // [input_rows_, Hb] token embeddings and gathered hiddens; grown, never shrunk.
  DeviceBuffer inputs_;
  int64_t input_rows_ = 0;
  int64_t input_steps_ = 0;
  std::vector<float> host_hidden_;  // [B, Hb] step-0 target hiddens, staged for one upload
  // Recorded steps by shape (rows, chain slots, positions bounds, caches and
  // buffers), each returning its logits view.
  StepGraphCache graphs_;
  std::vector<int64_t> graph_key_;
};

}  // namespace specula::assistant
