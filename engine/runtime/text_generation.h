// SPDX-License-Identifier: Apache-2.0
// Text in, text out: one request decoded (with or without a drafter) and
// detokenized as it streams, with stop strings applied to the text. Shared by
// the CLI verbs and, later, the server.
#pragma once

#include <functional>
#include <string>
#include <string_view>
#include <vector>

#include "engine/speculative/decoder.h"
#include "engine/tokenizer/tokenizer.h"

namespace specula {

struct TextGenerationResult {
  std::string text;             // everything emitted (stop string excluded)
  std::vector<int32_t> tokens;  // generated token ids
  std::string finish_reason;    // "length", "stop" or "cancelled"
  speculative::DecodeStats stats;
};

// Streams text as soon as it is valid UTF-8 and cannot be part of a stop
// string. `on_text` may return false to cancel. params.stop (strings) and
// params.stop_token_ids (e.g. EOS) end generation; neither is emitted as text.
TextGenerationResult generate_text(gemma4::Gemma4Model& target, Drafter* drafter,
                                   const Tokenizer& tokenizer, std::vector<int32_t> prompt_ids,
                                   const SamplingParams& params,
                                   const speculative::DraftSchedule& schedule,
                                   const std::function<bool(std::string_view)>& on_text = {});

}  // namespace specula
