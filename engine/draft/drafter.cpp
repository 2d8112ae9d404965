// SPDX-License-Identifier: Apache-2.0
#include "engine/draft/drafter.h"

#include <algorithm>

#include "engine/core/error.h"

namespace specula {

Tensor Drafter::step_on_device(int step_index, std::span<const DraftRow> /*rows*/,
                               const DraftDeviceInputs& /*inputs*/) {
  fail(
      "draft step {}: this drafter takes no device-resident inputs (takes_device_inputs() is "
      "false)",
      step_index);
}

int Drafter::propose(const DraftRow& /*row*/, std::span<int32_t> /*out*/) {
  fail("this drafter proposes no token ids (proposes_tokens() is false)");
}

void Drafter::draft_lengths(std::span<const DraftRow> /*rows*/, std::span<const int> drafted,
                            std::span<int> keep) {
  std::copy(drafted.begin(), drafted.end(), keep.begin());
}

void Drafter::draft_confidences(std::span<const DraftRow> /*rows*/,
                                std::span<const int> /*drafted*/, int /*stride*/,
                                std::span<double> /*conf*/) {
  fail("this drafter gives no draft confidences (has_confidences() is false)");
}

}  // namespace specula
