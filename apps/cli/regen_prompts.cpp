// SPDX-License-Identifier: Apache-2.0
#include "apps/cli/regen_prompts.h"

#include <fmt/format.h>

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <sstream>

#include "engine/core/error.h"

namespace specula::cli {
namespace {

namespace fs = std::filesystem;

bool blank(const std::string& line) {
  return line.find_first_not_of(" \t\r") == std::string::npos;
}

std::vector<std::string> read_lines(const std::string& path, const std::string& what) {
  std::ifstream in(path, std::ios::binary);
  if (!in) fail("{} {}: cannot open the file", what, path);
  std::vector<std::string> lines;
  std::string line;
  while (std::getline(in, line)) lines.push_back(line);
  if (in.bad()) fail("{} {}: read error", what, path);
  return lines;
}

RegenPrompt text_prompt(std::string origin, std::string text, int line) {
  RegenPrompt p{.origin = std::move(origin), .entry = {}};
  p.entry.text = std::move(text);
  p.entry.is_text = true;
  p.entry.line = line;
  return p;
}

void add_paragraphs(const std::string& path, RegenPromptSource& src) {
  const std::vector<std::string> lines = read_lines(path, "--prompt-file");
  std::string text;
  int first = 0;
  for (size_t i = 0; i <= lines.size(); ++i) {
    if (i < lines.size() && !blank(lines[i])) {
      if (text.empty()) first = static_cast<int>(i) + 1;
      text += (text.empty() ? "" : "\n") + lines[i];
      continue;
    }
    if (!text.empty())
      src.prompts.push_back(text_prompt(fmt::format("{}:{}", path, first), text, first));
    text.clear();
  }
}

// Regular files below `root` without a hidden component, sorted.
std::vector<fs::path> folder_files(const fs::path& root) {
  std::vector<fs::path> files;
  std::error_code ec;
  fs::recursive_directory_iterator it(root, fs::directory_options::skip_permission_denied, ec), end;
  if (ec) fail("--prompt-file {}: cannot list the folder: {}", root.string(), ec.message());
  for (; it != end; it.increment(ec)) {
    if (ec) fail("--prompt-file {}: cannot list the folder: {}", root.string(), ec.message());
    const std::string name = it->path().filename().string();
    if (!name.empty() && name[0] == '.') {
      if (it->is_directory()) it.disable_recursion_pending();
      continue;
    }
    if (it->is_regular_file()) files.push_back(it->path());
  }
  std::sort(files.begin(), files.end());
  return files;
}

void add_chunks(const fs::path& root, int chunk_lines, RegenPromptSource& src) {
  for (const fs::path& file : folder_files(root)) {
    const std::vector<std::string> lines = read_lines(file.string(), "--prompt-file");
    bool binary = false;
    for (const std::string& l : lines) binary = binary || l.find('\0') != std::string::npos;
    if (binary) continue;
    for (size_t at = 0; at < lines.size(); at += static_cast<size_t>(chunk_lines)) {
      const size_t end = std::min(lines.size(), at + static_cast<size_t>(chunk_lines));
      std::string text;
      bool any = false;
      for (size_t i = at; i < end; ++i) {
        text += lines[i] + "\n";
        any = any || !blank(lines[i]);
      }
      if (!any) continue;
      const int line = static_cast<int>(at) + 1;
      src.prompts.push_back(
          text_prompt(fmt::format("{}:{}", file.string(), line), std::move(text), line));
    }
  }
}

}  // namespace

bool RegenPromptSource::needs_tokenizer() const {
  for (const RegenPrompt& p : prompts)
    if (p.entry.is_text) return true;
  return false;
}

RegenPromptSource read_regen_prompts(const std::string& path, int chunk_lines) {
  RegenPromptSource src{.path = path, .kind = "", .prompts = {}};
  std::error_code ec;
  if (fs::is_directory(path, ec)) {
    if (chunk_lines < 1) fail("--chunk-lines: {} must be at least 1", chunk_lines);
    src.kind = "folder";
    add_chunks(path, chunk_lines, src);
    if (src.prompts.empty())
      fail("--prompt-file {}: the folder holds no non-blank text file", path);
  } else if (fs::path(path).extension() == ".jsonl") {
    src.kind = "jsonl";
    const PromptSet set = read_prompt_set(path);
    for (const PromptEntry& e : set.entries)
      src.prompts.push_back({.origin = fmt::format("{}:{}", path, e.line), .entry = e});
  } else {
    src.kind = "text";
    add_paragraphs(path, src);
    if (src.prompts.empty()) fail("--prompt-file {}: no prompts in the file (all blank)", path);
  }
  return src;
}

}  // namespace specula::cli
