// SPDX-License-Identifier: Apache-2.0
#include "engine/runtime/text_generation.h"

#include <algorithm>

#include "engine/sampling/stop_matcher.h"

namespace specula {

TextGenerationResult generate_text(gemma4::Gemma4Model& target, Drafter* drafter,
                                   const Tokenizer& tokenizer, std::vector<int32_t> prompt_ids,
                                   const SamplingParams& params,
                                   const speculative::DraftSchedule& schedule,
                                   const std::function<bool(std::string_view)>& on_text) {
  speculative::DecodeRequest request{.prompt = std::move(prompt_ids), .params = params};
  StreamingDecoder detok(tokenizer, /*skip_special_tokens=*/true);
  StopMatcher stops(params.stop);
  TextGenerationResult result;
  bool stopped_by_string = false;
  auto show = [&](const std::string& text) {
    if (text.empty()) return true;
    result.text += text;
    return on_text ? on_text(text) : true;
  };
  auto on_tokens = [&](int, std::span<const int32_t> fresh) {
    for (int32_t id : fresh) {
      // Stop tokens end generation without appearing in the text.
      if (std::find(params.stop_token_ids.begin(), params.stop_token_ids.end(), id) !=
          params.stop_token_ids.end()) {
        continue;
      }
      StopMatcher::Step step = stops.feed(detok.feed(id));
      if (!show(step.emit)) return false;
      if (step.stopped) {
        stopped_by_string = true;
        return false;
      }
    }
    return true;
  };
  std::vector<speculative::DecodeResult> out =
      speculative::decode(target, drafter, std::span(&request, 1), schedule, on_tokens);
  speculative::DecodeResult& r = out.front();
  if (!stopped_by_string) show(stops.feed(detok.flush()).emit + stops.flush());
  result.tokens = std::move(r.tokens);
  result.stats = r.stats;
  result.finish_reason = stopped_by_string ? "stop" : r.finish_reason;
  return result;
}

}  // namespace specula
