// SPDX-License-Identifier: Apache-2.0
#include "engine/runtime/generate.h"

#include <algorithm>
#include <chrono>

namespace specula {
namespace {

using Clock = std::chrono::steady_clock;

double seconds_since(Clock::time_point t0) {
  return std::chrono::duration<double>(Clock::now() - t0).count();
}

}  // namespace

double GenerateStats::prefill_tokens_per_second() const {
  return prefill_seconds > 0 ? static_cast<double>(prompt_tokens) / prefill_seconds : 0.0;
}

double GenerateStats::decode_tokens_per_second() const {
  return decode_seconds > 0 && generated_tokens > 1 ? static_cast<double>(generated_tokens - 1) / decode_seconds
                                                    : 0.0;
}

GenerateResult generate_greedy(gemma4::Gemma4Model& model, std::span<const int32_t> prompt,
                               const GenerateOptions& options) {
  if (prompt.empty()) fail("the prompt is empty: generation needs at least one token");
  if (options.max_tokens < 0) fail("max_tokens must be >= 0, got {}", options.max_tokens);
  if (static_cast<int64_t>(prompt.size()) + options.max_tokens > model.max_context()) {
    fail("prompt of {} tokens plus max_tokens {} exceeds the context size of {} tokens", prompt.size(),
         options.max_tokens, model.max_context());
  }
  GenerateResult result;
  result.finish_reason = "length";
  result.stats.prompt_tokens = static_cast<int64_t>(prompt.size());
  result.tokens.reserve(static_cast<size_t>(options.max_tokens));
  if (options.max_tokens == 0) return result;

  SequenceKv kv = model.new_sequence();
  Backend& be = model.backend();
  HostTensor next(DType::kI32, {1});
  auto emit = [&](int32_t token) {
    result.tokens.push_back(token);
    ++result.stats.generated_tokens;
    if (std::find(options.stop_token_ids.begin(), options.stop_token_ids.end(), token) !=
        options.stop_token_ids.end()) {
      result.finish_reason = "stop";
      return false;
    }
    if (options.on_token && !options.on_token(token)) {
      result.finish_reason = "callback";
      return false;
    }
    return static_cast<int>(result.tokens.size()) < options.max_tokens;
  };

  auto t0 = Clock::now();
  gemma4::ForwardRow row{.kv = &kv, .tokens = prompt, .all_logits = false};
  const gemma4::ForwardOutput* out = &model.forward(std::span(&row, 1));
  be.argmax_rows(out->logits, next);
  ++result.stats.target_forwards;
  result.stats.prefill_seconds = seconds_since(t0);
  bool more = emit(next.data<int32_t>()[0]);

  auto t1 = Clock::now();
  while (more) {
    const int32_t token = next.data<int32_t>()[0];
    gemma4::ForwardRow step{.kv = &kv, .tokens = std::span(&token, 1), .all_logits = false};
    out = &model.forward(std::span(&step, 1));
    be.argmax_rows(out->logits, next);
    ++result.stats.target_forwards;
    more = emit(next.data<int32_t>()[0]);
  }
  result.stats.decode_seconds = seconds_since(t1);
  return result;
}

}  // namespace specula
