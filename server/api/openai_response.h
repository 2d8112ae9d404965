// SPDX-License-Identifier: Apache-2.0
// JSON bodies of OpenAI responses: whole responses, streaming chunks (each a
// full server-sent event "data: {...}\n\n"), and the model list.
// Shapes follow OpenAI's API reference (chat.completion, chat.completion.chunk,
// text_completion); `usage.speculative` is specula's extension. No builder
// throws on text: invalid UTF-8 in any string is written as U+FFFD.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

namespace specula::api {

// One generated token's logprobs (the target's log-softmax, before sampling).
struct TokenLogprob {
  std::string token;              // its text (may be a partial UTF-8 sequence: emitted with U+FFFD)
  std::vector<uint8_t> bytes;     // its bytes
  float logprob = 0;              // -inf (a masked token) is emitted as -9999.0, as vLLM does
  std::vector<TokenLogprob> top;  // the top alternatives (their own `top` empty)
};

struct SpeculativeUsage {
  int64_t drafted = 0;
  int64_t accepted = 0;
  std::vector<int64_t> accepted_by_position;
  double tau = 0;  // tokens per verify round
};

struct Usage {
  int64_t prompt_tokens = 0;
  int64_t completion_tokens = 0;
  std::optional<SpeculativeUsage> speculative;  // present when speculation ran
};

struct Choice {
  int index = 0;
  std::string text;           // the message content (chat) or text (completions)
  std::string finish_reason;  // "stop", "length" ("" -> null, in chunks)
  std::optional<std::vector<TokenLogprob>> logprobs;
  // Completions' logprobs.text_offset: the byte offset of `text` in the whole
  // completion (a stream's deltas pass the bytes already sent; 0 otherwise).
  int64_t text_offset = 0;
};

// Whole responses. `id` like "chatcmpl-..." / "cmpl-...", `created` in Unix seconds.
std::string chat_completion_body(const std::string& id, int64_t created, const std::string& model,
                                 const std::vector<Choice>& choices, const Usage& usage);
std::string completion_body(const std::string& id, int64_t created, const std::string& model,
                            const std::vector<Choice>& choices, const Usage& usage);

// Streaming events, each "data: <json>\n\n".
// chat: the first event of a choice carries {"role":"assistant","content":""}.
std::string chat_role_event(const std::string& id, int64_t created, const std::string& model,
                            int index);
// A content delta (and/or its finish_reason when non-empty, and logprobs).
std::string chat_delta_event(const std::string& id, int64_t created, const std::string& model,
                             const Choice& delta);
std::string completion_delta_event(const std::string& id, int64_t created, const std::string& model,
                                   const Choice& delta);
// The usage event (choices: []), sent last when stream_options.include_usage.
std::string usage_event(const std::string& id, int64_t created, const std::string& model, bool chat,
                        const Usage& usage);
// An error in the middle of a stream: "data: {"error": ...}\n\n".
std::string error_event(const std::string& message, const std::string& type);
inline constexpr const char* kDoneEvent = "data: [DONE]\n\n";

// GET /v1/models.
std::string models_body(const std::vector<std::string>& model_ids, int64_t created);

}  // namespace specula::api
