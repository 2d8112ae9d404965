// SPDX-License-Identifier: Apache-2.0
#include "engine/chat/chat_template_check.h"

#include <fmt/format.h>

#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>

#include "engine/chat/sha256.h"
#include "engine/core/error.h"

namespace specula {
namespace {

// Digests of normalize_chat_template() of each official revision, computed
// from verbatim public copies (provenance in tools/golden/make_chat_golden.py).
constexpr KnownChatTemplate kKnown[] = {
    {"gemma-4 31B/26B-A4B/12B-it, revision of 2026-07-14",
     "2af48814bacaf2a35a2d57aa19eee6c42ed530011977e8f414cf1d467da446c2", ChatTemplateFamily::kLarge,
     true},
    {"gemma-4 E2B/E4B-it, revision of 2026-07-14",
     "523fc86ed4db0357763963f4b0fdbce319903f1f68b2d03f593bef7a56836533", ChatTemplateFamily::kEdge,
     true},
    {"gemma-4 31B/26B-A4B/12B-it, revision of 2026-04-29",
     "94899c0f917d93f6fe81c95744d1e8ddab2d21d39228d2e4aec1fb2a25bff413", ChatTemplateFamily::kLarge,
     false},
    {"gemma-4 E2B/E4B-it, revision of 2026-04-29",
     "33204f1acb5bd0002713e16a593847f24ceeafe711ed88bda2a352dc996a3373", ChatTemplateFamily::kEdge,
     false},
    {"gemma-4 31B/26B-A4B/12B-it, revision of 2026-04-09",
     "1d35a24a2a63cc600c0cab43628a6df4cd3318e959b03307cf5f9f7e29ecf783", ChatTemplateFamily::kLarge,
     false},
    {"gemma-4 E2B/E4B-it, revision of 2026-04-13",
     "781d10940fbc44be40064b5d43a056fc486c84ceaa55538226368b57314132bf", ChatTemplateFamily::kEdge,
     false},
    {"gemma-4 31B/26B-A4B/12B-it, release of 2026-04-02",
     "58c66fdee4afa29786fa0925a4c3659c8ebc28a2db93da6ae479d7d5886ce48f", ChatTemplateFamily::kLarge,
     false},
};

std::string read_file(const std::filesystem::path& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) fail("cannot open {} for reading", path.string());
  std::ostringstream text;
  text << in.rdbuf();
  if (in.bad()) fail("error while reading {}", path.string());
  return text.str();
}

}  // namespace

std::span<const KnownChatTemplate> known_chat_templates() {
  return kKnown;
}

std::string normalize_chat_template(std::string_view text) {
  std::string out;
  out.reserve(text.size());
  size_t pos = 0;
  while (pos <= text.size()) {
    size_t eol = text.find_first_of("\r\n", pos);
    if (eol == std::string_view::npos) eol = text.size();
    std::string_view line = text.substr(pos, eol - pos);
    while (!line.empty() && (line.back() == ' ' || line.back() == '\t')) line.remove_suffix(1);
    out.append(line);
    if (eol == text.size()) break;
    out += '\n';
    pos = eol + ((text[eol] == '\r' && eol + 1 < text.size() && text[eol + 1] == '\n') ? 2 : 1);
  }
  while (!out.empty() && out.back() == '\n') out.pop_back();
  return out;
}

ChatTemplateFamily guess_chat_template_family(std::string_view text) {
  return text.find("'<|channel>thought\\n<channel|>'") != std::string_view::npos
             ? ChatTemplateFamily::kLarge
             : ChatTemplateFamily::kEdge;
}

ChatTemplateCheck check_chat_template(std::string_view template_text) {
  ChatTemplateCheck check;
  check.sha256 = sha256_hex(normalize_chat_template(template_text));
  for (const KnownChatTemplate& known : kKnown) {
    if (known.sha256 != check.sha256) continue;
    check.match = &known;
    check.family = known.family;
    if (known.current) {
      check.status = ChatTemplateCheck::Status::kCurrent;
      check.message = fmt::format("chat template: the official {} (rendered natively)", known.name);
    } else {
      check.status = ChatTemplateCheck::Status::kOlderOfficial;
      check.message = fmt::format(
          "chat template: the official {}, an older revision; prompts are rendered as the "
          "2026-07-14 revision does, which can differ (thinking-token newline, consecutive "
          "assistant messages, list-of-parts system messages)",
          known.name);
    }
    return check;
  }
  check.status = ChatTemplateCheck::Status::kUnknown;
  check.family = guess_chat_template_family(template_text);
  check.message = fmt::format(
      "chat template: not an official Gemma 4 template (sha256 {} of the normalised text); "
      "prompts are rendered in the official Gemma 4 format ({} flavour), which may not be what "
      "this checkpoint expects",
      check.sha256, check.family == ChatTemplateFamily::kLarge ? "31B/26B" : "E2B/E4B");
  return check;
}

std::optional<std::string> read_checkpoint_chat_template(const std::string& checkpoint_dir) {
  const std::filesystem::path dir(checkpoint_dir);
  const auto jinja = dir / "chat_template.jinja";
  if (std::filesystem::exists(jinja)) return read_file(jinja);
  const auto config_path = dir / "tokenizer_config.json";
  if (!std::filesystem::exists(config_path)) return std::nullopt;
  return chat_template_from_tokenizer_config(read_file(config_path), config_path.string());
}

std::optional<std::string> chat_template_from_tokenizer_config(const std::string& text,
                                                               const std::string& origin) {
  nlohmann::json config;
  try {
    config = nlohmann::json::parse(text);
  } catch (const nlohmann::json::exception& e) {
    fail("{} is not valid JSON: {}", origin, e.what());
  }
  if (!config.is_object()) return std::nullopt;
  auto it = config.find("chat_template");
  if (it == config.end() || it->is_null()) return std::nullopt;
  if (it->is_string()) return it->get<std::string>();
  if (it->is_array()) {
    for (const auto& entry : *it) {
      if (!entry.is_object()) continue;
      const auto name = entry.find("name");
      const auto tmpl = entry.find("template");
      if (name != entry.end() && name->is_string() && *name == "default" && tmpl != entry.end() &&
          tmpl->is_string()) {
        return tmpl->get<std::string>();
      }
    }
    fail("{}: \"chat_template\" is a list without a \"default\" entry", origin);
  }
  fail("{}: \"chat_template\" must be a string or a list of named templates, got {}", origin,
       it->type_name());
}

ChatTemplateCheck check_checkpoint_chat_template(const std::string& checkpoint_dir) {
  const auto text = read_checkpoint_chat_template(checkpoint_dir);
  if (!text) {
    ChatTemplateCheck check;
    check.message = fmt::format(
        "chat template: {} has neither chat_template.jinja nor a chat_template in "
        "tokenizer_config.json; prompts are rendered in the official Gemma 4 format",
        checkpoint_dir);
    return check;
  }
  return check_chat_template(*text);
}

}  // namespace specula
