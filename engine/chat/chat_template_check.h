// SPDX-License-Identifier: Apache-2.0
// Recognising a checkpoint's chat template. render_chat() is a native port of
// one template revision; a checkpoint may ship that revision, an older official
// one, or a template of its own (a fine-tune's). check_chat_template() tells
// them apart by the SHA-256 of the normalised template text, so the CLI can
// say plainly when the prompt it renders may differ from the checkpoint's.
// Only digests are stored here, not template text.
#pragma once

#include <optional>
#include <span>
#include <string>
#include <string_view>

#include "engine/chat/chat_format.h"

namespace specula {

struct KnownChatTemplate {
  std::string_view name;    // e.g. "gemma-4 31B/26B-A4B/12B-it, revision of 2026-07-14"
  std::string_view sha256;  // of normalize_chat_template(text), lower-case hex
  ChatTemplateFamily family;
  bool current;  // the revision render_chat() reproduces
};

// The official Gemma 4 templates we know (sources: tools/golden/make_chat_golden.py).
std::span<const KnownChatTemplate> known_chat_templates();

// The text the digest is taken over: CRLF/CR become LF, trailing spaces and
// tabs are removed from every line, trailing empty lines are dropped (copies
// of the same template differ in exactly these ways).
std::string normalize_chat_template(std::string_view text);

// Large vs edge flavour guessed from the text itself: the large-model template
// contains the empty thought-channel literal of its generation prompt.
ChatTemplateFamily guess_chat_template_family(std::string_view text);

struct ChatTemplateCheck {
  enum class Status {
    kCurrent,        // the revision render_chat() reproduces
    kOlderOfficial,  // an earlier official revision: text-only prompts differ slightly
    kUnknown,        // not an official Gemma 4 template
    kMissing,        // the checkpoint has no template
  };
  Status status = Status::kMissing;
  std::string sha256;                                      // empty when kMissing
  const KnownChatTemplate* match = nullptr;                // set for kCurrent / kOlderOfficial
  ChatTemplateFamily family = ChatTemplateFamily::kLarge;  // from the match, else guessed
  std::string message;                                     // one sentence for the user
};

ChatTemplateCheck check_chat_template(std::string_view template_text);

// The checkpoint's template text: <dir>/chat_template.jinja if present, else
// the "chat_template" field of <dir>/tokenizer_config.json (a string, or a list
// of {"name", "template"} entries of which "default" is used). nullopt when the
// checkpoint has neither. Throws Error naming the file when it exists but
// cannot be read or parsed.
std::optional<std::string> read_checkpoint_chat_template(const std::string& checkpoint_dir);
// The "chat_template" of tokenizer_config.json `text`, as above (nullopt when
// absent or null, or when the text is not a JSON object); `origin` names the
// file in errors.
std::optional<std::string> chat_template_from_tokenizer_config(const std::string& text,
                                                               const std::string& origin);

// read_checkpoint_chat_template + check_chat_template (kMissing when absent).
ChatTemplateCheck check_checkpoint_chat_template(const std::string& checkpoint_dir);

}  // namespace specula
