// SPDX-License-Identifier: Apache-2.0
#include "engine/chat/chat_format.h"

#include <nlohmann/json.hpp>

#include "engine/core/error.h"

namespace specula {
namespace {

bool is_python_space(uint32_t c) {
  if (c <= 0x20) return c == 0x20 || (c >= 0x09 && c <= 0x0D) || (c >= 0x1C && c <= 0x1F);
  switch (c) {
    case 0x85:
    case 0xA0:
    case 0x1680:
    case 0x2028:
    case 0x2029:
    case 0x202F:
    case 0x205F:
    case 0x3000:
      return true;
    default:
      return c >= 0x2000 && c <= 0x200A;
  }
}

// Decodes the UTF-8 sequence of `len` bytes at p; returns 0xFFFFFFFF when it
// is malformed (such bytes are never whitespace).
uint32_t decode_utf8(const unsigned char* p, size_t len) {
  static constexpr uint32_t kBad = 0xFFFFFFFF;
  if (len == 1) return p[0] < 0x80 ? p[0] : kBad;
  uint32_t c;
  if (len == 2 && (p[0] & 0xE0) == 0xC0) {
    c = p[0] & 0x1F;
  } else if (len == 3 && (p[0] & 0xF0) == 0xE0) {
    c = p[0] & 0x0F;
  } else if (len == 4 && (p[0] & 0xF8) == 0xF0) {
    c = p[0] & 0x07;
  } else {
    return kBad;
  }
  for (size_t i = 1; i < len; ++i) {
    if ((p[i] & 0xC0) != 0x80) return kBad;
    c = (c << 6) | (p[i] & 0x3F);
  }
  return c;
}

size_t utf8_length(unsigned char lead) {
  if (lead < 0x80) return 1;
  if ((lead & 0xE0) == 0xC0) return 2;
  if ((lead & 0xF0) == 0xE0) return 3;
  if ((lead & 0xF8) == 0xF0) return 4;
  return 1;
}

constexpr std::string_view kChannelOpen = "<|channel>";
constexpr std::string_view kChannelClose = "<channel|>";

bool is_media_type(std::string_view type) {
  return type == "image" || type == "image_url" || type == "audio" || type == "input_audio" ||
         type == "video";
}

void check_message(const ChatMessage& m, size_t index) {
  if (m.role == "tool") {
    fail(
        "chat message {} has role \"tool\": tool results are not supported (this engine renders "
        "text-only conversations; tools and tool calls are not implemented)",
        index);
  }
  if (m.role != "system" && m.role != "developer" && m.role != "user" && m.role != "assistant") {
    fail(
        "chat message {} has role \"{}\"; expected \"system\", \"developer\", \"user\" or "
        "\"assistant\"",
        index, m.role);
  }
  if (!m.has_parts) return;
  for (size_t j = 0; j < m.parts.size(); ++j) {
    const std::string& type = m.parts[j].type;
    if (type == "text") continue;
    if (is_media_type(type)) {
      fail(
          "chat message {} content part {} has type \"{}\": images, audio and video are not "
          "supported (this engine renders text-only conversations)",
          index, j, type);
    }
    fail("chat message {} content part {} has type \"{}\"; only \"text\" parts are supported",
         index, j, type);
  }
}

// A message's content as the template renders it (model text loses its
// thinking blocks; everything else is trimmed).
void append_content(const ChatMessage& m, bool is_model, std::string* out) {
  auto render = [&](std::string_view text) {
    if (is_model) {
      out->append(strip_thinking(text));
    } else {
      out->append(python_strip(text));
    }
  };
  if (!m.has_parts) {
    render(m.content);
    return;
  }
  for (const ContentPart& part : m.parts) render(part.text);
}

const std::string* optional_string(const nlohmann::json& obj, const char* key, size_t index) {
  auto it = obj.find(key);
  if (it == obj.end() || it->is_null()) return nullptr;
  if (!it->is_string()) {
    fail("chat message {}: \"{}\" must be a string, got {}", index, key, it->type_name());
  }
  return it->get_ptr<const std::string*>();
}

bool present_and_nonempty(const nlohmann::json& obj, const char* key) {
  auto it = obj.find(key);
  if (it == obj.end() || it->is_null()) return false;
  return !(it->is_array() || it->is_object() || it->is_string()) || !it->empty();
}

}  // namespace

std::string_view python_strip(std::string_view text) {
  const auto* p = reinterpret_cast<const unsigned char*>(text.data());
  size_t begin = 0;
  size_t end = text.size();
  while (begin < end) {
    const size_t len = utf8_length(p[begin]);
    if (begin + len > end || !is_python_space(decode_utf8(p + begin, len))) break;
    begin += len;
  }
  while (end > begin) {
    // Step back over continuation bytes to the start of the last code point.
    size_t start = end - 1;
    while (start > begin && end - start < 4 && (p[start] & 0xC0) == 0x80) --start;
    if (!is_python_space(decode_utf8(p + start, end - start))) break;
    end = start;
  }
  return text.substr(begin, end - begin);
}

std::string strip_thinking(std::string_view text) {
  std::string kept;
  size_t pos = 0;
  while (true) {
    const size_t close = text.find(kChannelClose, pos);
    const std::string_view part =
        text.substr(pos, close == std::string_view::npos ? std::string_view::npos : close - pos);
    kept.append(part.substr(0, part.find(kChannelOpen)));
    if (close == std::string_view::npos) break;
    pos = close + kChannelClose.size();
  }
  return std::string(python_strip(kept));
}

std::string render_chat(const std::vector<ChatMessage>& messages, const ChatOptions& options) {
  // transformers refuses an empty conversation too (the template itself would
  // render just the BOS and the generation prompt).
  if (messages.empty()) fail("cannot render an empty chat conversation: give at least one message");
  for (size_t i = 0; i < messages.size(); ++i) check_message(messages[i], i);

  std::string out = options.bos_token;
  size_t first = 0;
  const bool system_first =
      !messages.empty() && (messages[0].role == "system" || messages[0].role == "developer");
  if (options.enable_thinking || system_first) {
    out += "<|turn>system\n";
    if (options.enable_thinking) out += "<|think|>\n";
    if (system_first) {
      const ChatMessage& sys = messages[0];
      if (sys.has_parts) {
        for (const ContentPart& part : sys.parts) {
          out.append(python_strip(part.text));
          out += ' ';
        }
      } else {
        out.append(python_strip(sys.content));
      }
      first = 1;
    }
    out += "<turn|>\n";
  }

  // Reasoning is replayed only for messages after the last user message.
  size_t after_last_user = first;
  for (size_t i = first; i < messages.size(); ++i) {
    if (messages[i].role == "user") after_last_user = i + 1;
  }

  for (size_t i = first; i < messages.size(); ++i) {
    const ChatMessage& m = messages[i];
    const bool is_model = m.role == "assistant";
    const bool continues_previous = is_model && i > first && messages[i - 1].role == "assistant";
    if (!continues_previous) {
      out += "<|turn>";
      out += is_model ? "model" : m.role;
      out += '\n';
    }
    if (!m.reasoning.empty() && i >= after_last_user) {
      out += "<|channel>thought\n";
      out += m.reasoning;
      out += "\n<channel|>";
    }
    append_content(m, is_model, &out);
    const bool continues_into_next =
        is_model && i + 1 < messages.size() && messages[i + 1].role == "assistant";
    if (!continues_into_next) out += "<turn|>\n";
  }

  if (options.add_generation_prompt) {
    out += "<|turn>model\n";
    if (!options.enable_thinking && options.family == ChatTemplateFamily::kLarge) {
      out += "<|channel>thought\n<channel|>";
    }
  }
  return out;
}

std::vector<ChatMessage> chat_messages_from_json(const nlohmann::json& messages) {
  if (!messages.is_array()) {
    fail("chat messages must be a JSON array of message objects, got {}", messages.type_name());
  }
  std::vector<ChatMessage> out;
  out.reserve(messages.size());
  for (size_t i = 0; i < messages.size(); ++i) {
    const nlohmann::json& jm = messages[i];
    if (!jm.is_object()) fail("chat message {} must be a JSON object, got {}", i, jm.type_name());
    ChatMessage m;
    const std::string* role = optional_string(jm, "role", i);
    if (role == nullptr) fail("chat message {} has no \"role\"", i);
    m.role = *role;
    for (const char* key : {"tool_calls", "tool_responses"}) {
      if (present_and_nonempty(jm, key)) {
        fail(
            "chat message {} has \"{}\": tool calls are not supported (this engine renders "
            "text-only conversations)",
            i, key);
      }
    }
    auto content = jm.find("content");
    if (content != jm.end() && !content->is_null()) {
      if (content->is_string()) {
        m.content = content->get<std::string>();
      } else if (content->is_array()) {
        m.has_parts = true;
        for (size_t j = 0; j < content->size(); ++j) {
          const nlohmann::json& jp = (*content)[j];
          if (!jp.is_object()) {
            fail("chat message {} content part {} must be an object, got {}", i, j, jp.type_name());
          }
          auto type = jp.find("type");
          if (type == jp.end() || !type->is_string()) {
            fail("chat message {} content part {} has no string \"type\"", i, j);
          }
          ContentPart part;
          part.type = type->get<std::string>();
          if (part.type == "text") {
            auto text = jp.find("text");
            if (text == jp.end() || !text->is_string()) {
              fail("chat message {} content part {} is of type \"text\" but has no string \"text\"",
                   i, j);
            }
            part.text = text->get<std::string>();
          }
          m.parts.push_back(std::move(part));
        }
      } else {
        fail("chat message {}: \"content\" must be a string, an array of parts or null, got {}", i,
             content->type_name());
      }
    }
    // The template uses `reasoning or reasoning_content`: an empty string falls through.
    const std::string* reasoning = optional_string(jm, "reasoning", i);
    const std::string* reasoning_content = optional_string(jm, "reasoning_content", i);
    if (reasoning != nullptr && !reasoning->empty()) {
      m.reasoning = *reasoning;
    } else if (reasoning_content != nullptr) {
      m.reasoning = *reasoning_content;
    }
    check_message(m, i);
    out.push_back(std::move(m));
  }
  return out;
}

}  // namespace specula
