// SPDX-License-Identifier: Apache-2.0
// Prompt sets for `specula calibrate`, `specula ab` and `specula bench` (see
// prompt_format.h for bench's --prompt-format): JSONL, one prompt a
// line, in DeepSpec's layout {"turns": ["first user turn", ...]} (the first
// turn is the prompt, tokenized as plain text with BOS, as `generate
// --prompt` does) or as token ids {"ids": [2, 17, ...]} (for checkpoints
// without a tokenizer, such as the test fixtures). Blank lines are skipped.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "engine/tokenizer/tokenizer.h"

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

// The token ids of every prompt: text lines through `tokenizer` (BOS added;
// must be non-null when needs_tokenizer()), ids lines as they are. An id
// outside [0, vocab) throws naming the file, line and id.
std::vector<std::vector<int32_t>> prompt_ids(const PromptSet& set, const Tokenizer* tokenizer,
                                             int64_t vocab);

}  // namespace specula::cli
