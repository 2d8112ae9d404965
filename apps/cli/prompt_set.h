// SPDX-License-Identifier: Apache-2.0
// Prompt sets for `specula calibrate`, `specula ab` and `specula bench` (see
// prompt_format.h for their --prompt-format; `regen` reads them too): JSONL,
// one prompt a line, in DeepSpec's layout {"turns": ["first user turn", ...]} (the first
// turn is the prompt, tokenized as plain text with BOS, as `generate
// --prompt` does) or as token ids {"ids": [2, 17, ...]} (for checkpoints
// without a tokenizer, such as the test fixtures). Blank lines are skipped.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "apps/cli/prompt_format.h"
#include "engine/tokenizer/tokenizer.h"

namespace specula {
struct ChatOptions;  // engine/chat/chat_format.h
}

namespace specula::cli {

struct PromptEntry {
  std::string text;          // "turns"[0]; empty for an ids line
  std::vector<int32_t> ids;  // "ids"; empty for a text line
  bool is_text = false;
  int line = 0;  // in the file, 1-based (for errors)
};

struct PromptSet {
  std::string path;
  std::vector<PromptEntry> entries;  // in file order, never empty
  bool needs_tokenizer() const;
};

// Parses `path` (`flag` names the option in errors). Throws an Error naming
// the file, line and what was expected for a malformed line, and for a file
// without prompts.
PromptSet read_prompt_set(const std::string& path, const std::string& flag = "--prompt-file");

// A prompt set as bench, calibrate and ab use it: --prompt-file read, its
// first --num-prompts entries kept, each formatted per --prompt-format.
struct FormattedPromptSet {
  PromptSet set;  // path, and the kept entries in file order
  PromptFormat format = PromptFormat::kText;
  std::string format_name;         // as given to --prompt-format, for messages
  std::vector<std::string> texts;  // per entry: prompt_text() (empty for ids)
};

// Reads `path` (errors name --prompt-file), keeps its first `num_prompts`
// entries (nullopt: all) and formats each, before any model loads, so that a
// malformed line, an unknown format, an ids line under chat or code-block, a
// missing code block or a --num-prompts outside [1, prompts in the file] fails
// at once, naming the file (and line).
FormattedPromptSet read_formatted_prompt_set(const std::string& path,
                                             const std::string& format_name,
                                             std::optional<int> num_prompts);

// The token ids of every kept prompt: text and code-block texts through
// `tokenizer` with BOS; chat texts rendered as a user message with `chat`
// (must be non-null under chat; the rendering starts with the BOS text) and
// tokenized as they are; ids lines as they are. `tokenizer` must be non-null
// when set.needs_tokenizer(). An id outside [0, vocab) throws naming the file,
// line and id.
std::vector<std::vector<int32_t>> tokenize_prompt_set(const FormattedPromptSet& prompts,
                                                      const Tokenizer* tokenizer, int64_t vocab,
                                                      const ChatOptions* chat);

// Checks that each prompt plus `new_tokens` fits in `context` tokens; else an
// Error names the file, line, format, lengths and `new_tokens_flag`.
void check_prompts_fit(const FormattedPromptSet& prompts,
                       const std::vector<std::vector<int32_t>>& ids, int64_t new_tokens,
                       const std::string& new_tokens_flag, int64_t context);

}  // namespace specula::cli
