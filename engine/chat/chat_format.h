// SPDX-License-Identifier: Apache-2.0
// The Gemma 4 chat format, rendered natively (no Jinja engine). render_chat()
// reproduces, byte for byte, what Google's released `chat_template.jinja`
// (revision of 2026-07, the current one; see chat_template_check.h for the
// revisions we recognise) renders through transformers' apply_chat_template for
// text-only conversations. Goldens: tests/golden/chat/cases.jsonl, made by
// tools/golden/make_chat_golden.py.
//
// The format (template semantics, restated):
//   <bos>
//   [<|turn>system\n [<|think|>\n] <first system/developer message, trimmed> <turn|>\n]
//       (the system turn appears when thinking is on or the first message is a
//        system/developer message; a list-of-parts system message renders each
//        part's text trimmed and followed by one space)
//   for each remaining message:
//       <|turn>{role}\n  (assistant -> "model"; omitted when an assistant
//                         message directly follows another assistant message:
//                         the two share one model turn)
//       [<|channel>thought\n{reasoning}\n<channel|>]  (only for messages after
//                         the last user message)
//       content: user/system text is trimmed (Python str.strip); model text has
//                every <|channel>...<channel|> block removed, then is trimmed;
//                a list of text parts renders each part that way, concatenated
//       <turn|>\n        (omitted when an assistant message is followed by
//                         another assistant message)
//   add_generation_prompt: <|turn>model\n, plus <|channel>thought\n<channel|>
//       (an empty, closed thought channel) when thinking is off and the
//       checkpoint uses the large-model template (31B, 26B-A4B, 12B); the
//       E2B/E4B template emits no such block.
// Not supported (Error): tool roles, tool calls/responses, images, audio, video.
#pragma once

#include <nlohmann/json_fwd.hpp>

#include <string>
#include <string_view>
#include <vector>

namespace specula {

// One element of an OpenAI-style content array. Only type "text" renders;
// any other type makes render_chat throw.
struct ContentPart {
  std::string type = "text";
  std::string text;
};

struct ChatMessage {
  // "system", "developer", "user" or "assistant".
  std::string role;
  // The content as a plain string (has_parts == false) or as a list of parts
  // (has_parts == true); the two render differently (see above).
  std::string content;
  std::vector<ContentPart> parts;
  bool has_parts = false;
  // Thinking text of the message (OpenAI-style `reasoning` or
  // `reasoning_content`); rendered only after the last user message.
  std::string reasoning;

  static ChatMessage text(std::string role, std::string content) {
    ChatMessage m;
    m.role = std::move(role);
    m.content = std::move(content);
    return m;
  }
};

// Which flavour of the released template the checkpoint ships. They differ
// only in the generation prompt with thinking off (see above).
enum class ChatTemplateFamily {
  kLarge,  // gemma-4-31B-it, 26B-A4B-it, 12B-it
  kEdge,   // gemma-4-E2B-it, E4B-it
};

struct ChatOptions {
  bool add_generation_prompt = true;
  // The template's `enable_thinking` (default false, as in the template).
  bool enable_thinking = false;
  ChatTemplateFamily family = ChatTemplateFamily::kLarge;
  std::string bos_token = "<bos>";
};

// Renders the conversation as the prompt text (special tokens spelled out;
// the tokenizer maps them to ids). Throws Error naming the message (and part)
// for anything outside the text-only subset described above, and for an empty
// conversation (as transformers' apply_chat_template does).
std::string render_chat(const std::vector<ChatMessage>& messages, const ChatOptions& options);

// Parses an OpenAI-style `messages` array: objects with "role", "content"
// (string, null, or an array of {"type": "text", "text": ...}) and optional
// "reasoning" / "reasoning_content". Tool calls, tool responses and non-text
// parts are rejected with an Error naming the message index.
std::vector<ChatMessage> chat_messages_from_json(const nlohmann::json& messages);

// Python's str.strip(): removes leading and trailing characters for which
// str.isspace() is true (ASCII whitespace, U+001C..U+001F, U+0085, U+00A0,
// U+1680, U+2000..U+200A, U+2028, U+2029, U+202F, U+205F, U+3000) from UTF-8
// text. Jinja's `trim` filter is this function.
std::string_view python_strip(std::string_view text);

// The template's strip_thinking macro: drops every "<|channel>..." up to the
// next "<channel|>" (or to the end when none follows), then python_strip.
std::string strip_thinking(std::string_view text);

}  // namespace specula
