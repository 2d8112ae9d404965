// SPDX-License-Identifier: Apache-2.0
// The prompt sources of `specula regen`, chosen by what --prompt-file names:
// - a `.jsonl` file: prompt_set.h's JSONL ({"turns": [...]}, the first turn
//   as plain text with BOS, or {"ids": [...]}), one prompt a line;
// - a folder: every regular file below it (hidden names skipped, files
//   holding a NUL byte skipped as binary), in sorted path order, cut into
//   chunks of `chunk_lines` lines; each chunk that is not blank is a prompt;
// - any other file: plain text, one prompt per paragraph (runs of non-blank
//   lines separated by blank lines), without the trailing newline.
// Text prompts are tokenized as `generate --prompt` does (BOS, no chat
// template), like the JSONL turns. The order is deterministic: a prompt's
// index (the ledger's key) depends only on the source's contents.
#pragma once

#include <string>
#include <vector>

#include "apps/cli/prompt_set.h"

namespace specula::cli {

struct RegenPrompt {
  std::string origin;  // "FILE:LINE" of its first line, for errors
  PromptEntry entry;
};

struct RegenPromptSource {
  std::string path;
  std::string kind;                  // "jsonl", "text" or "folder"
  std::vector<RegenPrompt> prompts;  // never empty
  bool needs_tokenizer() const;
};

// Throws an Error naming the path (and the file and line) for an unreadable
// source, a malformed JSONL line, or a source without prompts.
RegenPromptSource read_regen_prompts(const std::string& path, int chunk_lines);

}  // namespace specula::cli
