// SPDX-License-Identifier: Apache-2.0
// The OpenAI request bodies specula serves, parsed and validated:
// POST /v1/chat/completions and POST /v1/completions.
//
// parse_request never throws: a body that is not JSON, a field of the wrong
// type, a missing required field or an out-of-range value gives an ApiError
// (status 400, type "invalid_request_error", `param` naming the field, and a
// message naming the field and the value), as OpenAI answers. Unknown fields
// are ignored, as OpenAI and vLLM do. Fuzzed by tests/fuzz/openai_request_fuzz.cpp.
//
// Standard fields: model, messages (chat) / prompt (completions: a string, an
// array of token ids, or a batch of one of those; a batch of several prompts
// is refused), n, stream,
// stream_options.include_usage, stop (a string or up to 16 strings),
// max_tokens / max_completion_tokens, temperature, top_p, seed,
// presence_penalty, frequency_penalty, logprobs / top_logprobs (chat: bool +
// 0..20; completions: int 0..20).
// Extensions (vLLM's names): top_k, min_p, repetition_penalty, stop_token_ids,
// ignore_eos, chat_template_kwargs.enable_thinking, and
// speculative: {enabled: bool, draft_tokens: int >= 1}.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <variant>
#include <vector>

#include "engine/chat/chat_format.h"
#include "engine/sampling/sampling_params.h"

namespace specula::api {

// An OpenAI-style error: {"error": {"message", "type", "param", "code"}}.
struct ApiError {
  int status = 400;
  std::string message;
  std::string type = "invalid_request_error";
  std::string param;  // the offending field ("" -> null)
  std::string code;   // "" -> null
};
// The JSON body of an error.
std::string error_body(const ApiError& error);

enum class Endpoint { kChat, kCompletions };

struct RequestLimits {
  int max_n = 8;               // largest n accepted
  int max_logprobs = 20;       // largest top_logprobs
  int64_t max_tokens = 0;      // > 0: largest max_tokens accepted (the context bounds it anyway)
  int default_max_tokens = 0;  // 0: up to the context (the server fills it in)
  int max_stop = 16;
};

struct CompletionRequest {
  Endpoint endpoint = Endpoint::kChat;
  std::string model;  // "" when absent (the server's model is used)
  // kChat
  std::vector<ChatMessage> messages;
  bool enable_thinking = false;
  // kCompletions: text, or token ids when prompt_is_ids
  std::string prompt;
  std::vector<int32_t> prompt_ids;
  bool prompt_is_ids = false;

  int n = 1;
  bool stream = false;
  bool include_usage = false;  // stream_options.include_usage
  // Sampling: temperature (default 1.0, as OpenAI), top_p, top_k, min_p,
  // penalties, seed, stop strings and stop_token_ids. When the request sets
  // neither max_tokens nor max_completion_tokens, max_tokens is
  // limits.default_max_tokens: 0 by default (the server fills in its default;
  // everything else in params has passed SamplingParams::validate).
  SamplingParams params;
  bool has_seed = false;
  bool ignore_eos = false;
  // -1: no logprobs; 0: the chosen token's logprob; k: plus the top k.
  int logprobs = -1;
  // speculative.enabled (default true) and speculative.draft_tokens (-1: the
  // server's schedule).
  bool speculative = true;
  int draft_tokens = -1;
  std::string user;
};

// Parses and validates one request body for `endpoint`. Never throws: every
// rejection (including a body that is not JSON or holds invalid UTF-8) is an
// ApiError, status 400 (413 if parsing ran out of memory).
std::variant<CompletionRequest, ApiError> parse_request(std::string_view body, Endpoint endpoint,
                                                        const RequestLimits& limits);

}  // namespace specula::api
