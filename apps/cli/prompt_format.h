// SPDX-License-Identifier: Apache-2.0
// How `specula bench`, `calibrate` and `ab` turn a prompt set's entries
// (prompt_set.h) into prompt text, per --prompt-format:
// - text: the first turn as it is (tokenized with BOS, as prompt_set's
//   prompt_ids and `generate --prompt` do);
// - chat: the first turn as a user message in the Gemma 4 chat format with the
//   generation prompt (rendered by the caller: render_chat needs the model);
// - code-block: the first fenced ``` code block of the first turn, without its
//   fence lines, as a completion prompt (tokenized with BOS). DeepSpec's
//   HumanEval set wraps each task as "...:\n```python\n{prompt}\n```", and the
//   block gives back {prompt} byte for byte.
// An {"ids": [...]} entry has no text to format: text uses its ids as they
// are; chat and code-block refuse it.
#pragma once

#include <string>
#include <string_view>

namespace specula::cli {

struct PromptEntry;  // prompt_set.h

enum class PromptFormat { kText, kChat, kCodeBlock };

inline constexpr char kPromptFormats[] = "text, chat or code-block";
// --prompt-format's help, the same in every command that reads a prompt set.
inline constexpr char kPromptFormatHelp[] =
    "A .jsonl prompt set's first turn as: text (plain, with BOS), chat (a user message in the "
    "Gemma 4 chat format), or code-block (its first ``` code block, fence lines left out, as a "
    "completion prompt: HumanEval)";

// "text", "chat" or "code-block"; an Error names --prompt-format and the text otherwise.
PromptFormat parse_prompt_format(const std::string& name);

// The first fenced code block of a Markdown text. An opening fence is a line
// whose first non-blank characters are ``` (an info string such as `python`
// may follow); the block closes at the next line that is ``` alone (blanks
// around it allowed). `code` is the text between the opening fence's line
// break and the line break before the closing fence (so "```py\nx\n```"
// gives "x", and an empty block gives ""). `open_line` is the opening fence's
// line within the text, 1-based.
struct CodeBlock {
  enum class Status {
    kFound,
    kNone,      // no opening fence
    kUnclosed,  // an opening fence without a closing one
  };
  Status status = Status::kNone;
  std::string code;
  int open_line = 0;
};
CodeBlock first_code_block(std::string_view text);

// The text to tokenize for a text entry under `format` (chat: the user
// message, still to be rendered). Throws an Error naming `path`, the entry's
// line and the format for an ids entry under chat or code-block, and for a
// first turn without a (closed, non-empty) code block under code-block.
std::string prompt_text(const PromptEntry& entry, PromptFormat format, const std::string& path);

}  // namespace specula::cli
