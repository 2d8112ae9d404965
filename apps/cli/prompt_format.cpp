// SPDX-License-Identifier: Apache-2.0
#include "apps/cli/prompt_format.h"

#include <fmt/format.h>

#include "apps/cli/prompt_set.h"
#include "engine/core/error.h"

namespace specula::cli {
namespace {

std::string_view trim_blanks(std::string_view s) {
  const size_t b = s.find_first_not_of(" \t\r\n");
  if (b == std::string_view::npos) return {};
  const size_t e = s.find_last_not_of(" \t\r\n");
  return s.substr(b, e - b + 1);
}

}  // namespace

PromptFormat parse_prompt_format(const std::string& name) {
  if (name == "text") return PromptFormat::kText;
  if (name == "chat") return PromptFormat::kChat;
  if (name == "code-block") return PromptFormat::kCodeBlock;
  fail("--prompt-format: '{}' is not a prompt format (expected {})", name, kPromptFormats);
}

CodeBlock first_code_block(std::string_view text) {
  CodeBlock block;
  size_t code_begin = std::string_view::npos;  // set once the opening fence is seen
  int line_no = 0;
  for (size_t start = 0; start <= text.size();) {
    const size_t nl = text.find('\n', start);
    const size_t end = nl == std::string_view::npos ? text.size() : nl;
    const std::string_view line = text.substr(start, end - start);
    ++line_no;
    if (code_begin == std::string_view::npos) {
      if (trim_blanks(line).starts_with("```")) {
        block.open_line = line_no;
        block.status = CodeBlock::Status::kUnclosed;
        if (nl == std::string_view::npos) return block;  // the fence is the last line
        code_begin = nl + 1;
      }
    } else if (trim_blanks(line) == "```") {
      // The code ends at the line break before this fence (none for an empty block).
      size_t code_end = start > code_begin ? start - 1 : code_begin;
      if (code_end > code_begin && text[code_end - 1] == '\r') --code_end;  // CRLF text
      block.code = std::string(text.substr(code_begin, code_end - code_begin));
      block.status = CodeBlock::Status::kFound;
      return block;
    }
    if (nl == std::string_view::npos) break;
    start = nl + 1;
  }
  return block;
}

std::string prompt_text(const PromptEntry& entry, PromptFormat format, const std::string& path) {
  const char* name = format == PromptFormat::kChat ? "chat" : "code-block";
  if (!entry.is_text) {
    if (format == PromptFormat::kText) return {};
    fail(
        "--prompt-file {}:{}: an {{\"ids\": [...]}} prompt has no text to format as {} "
        "(--prompt-format {}); give {{\"turns\": [...]}} or --prompt-format text",
        path, entry.line, name, name);
  }
  if (format != PromptFormat::kCodeBlock) return entry.text;
  const CodeBlock block = first_code_block(entry.text);
  switch (block.status) {
    case CodeBlock::Status::kNone:
      fail(
          "--prompt-file {}:{}: --prompt-format code-block: the first turn has no fenced ``` "
          "code block",
          path, entry.line);
    case CodeBlock::Status::kUnclosed:
      fail(
          "--prompt-file {}:{}: --prompt-format code-block: the code block opened on line {} of "
          "the first turn has no closing ``` fence",
          path, entry.line, block.open_line);
    case CodeBlock::Status::kFound:
      break;
  }
  if (trim_blanks(block.code).empty()) {
    fail(
        "--prompt-file {}:{}: --prompt-format code-block: the first code block (line {} of the "
        "first turn) is empty",
        path, entry.line, block.open_line);
  }
  return block.code;
}

}  // namespace specula::cli
