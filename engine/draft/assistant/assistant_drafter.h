// SPDX-License-Identifier: Apache-2.0
// AssistantDraftSource: the Drafter interface over a Gemma 4 assistant and its
// target. It keeps each row's chained hidden state between the steps of a round.
#pragma once

#include <memory>
#include <unordered_map>
#include <vector>

#include "engine/draft/assistant/assistant.h"
#include "engine/draft/drafter.h"
#include "engine/model/gemma4/gemma4.h"

namespace specula::assistant {

class AssistantDraftSource : public Drafter {
 public:
  // Both models must outlive this object.
  AssistantDraftSource(gemma4::Gemma4Model& target, AssistantDrafter& drafter);
  int64_t vocab_size() const override { return drafter_.config().text.vocab_size; }
  Tensor step(int step_index, std::span<const DraftRow> rows) override;

 private:
  gemma4::Gemma4Model& target_;
  AssistantDrafter& drafter_;
  TargetCacheDonors donors_;
  std::unordered_map<int, HostTensor> hidden_;  // request -> f32 [Hb] chained hidden
  HostTensor ids_, positions_, embeds_, hidden_in_;
  std::vector<SequenceKv*> kvs_;
};

}  // namespace specula::assistant
