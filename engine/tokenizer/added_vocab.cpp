// SPDX-License-Identifier: Apache-2.0
#include "engine/tokenizer/added_vocab.h"

#include <algorithm>

#include "engine/tokenizer/unicode.h"

namespace specula::tokenizer {
namespace {

// Last code point of valid UTF-8 `text` (non-empty).
uint32_t last_code_point(std::string_view text) {
  size_t begin = text.size() - 1;
  while (begin > 0 && (static_cast<uint8_t>(text[begin]) & 0xC0) == 0x80) --begin;
  return next_code_point(text, begin);
}

bool is_word_char(uint32_t cp) {
  return cp == '_' || is_alphanumeric(cp);
}

// Byte offset where the run of trailing whitespace of `text` begins.
size_t trailing_space_start(std::string_view text) {
  size_t end = text.size();
  while (end > 0) {
    size_t begin = end - 1;
    while (begin > 0 && (static_cast<uint8_t>(text[begin]) & 0xC0) == 0x80) --begin;
    size_t p = begin;
    if (!is_whitespace(next_code_point(text, p))) break;
    end = begin;
  }
  return end;
}

// Byte length of the run of leading whitespace of `text`.
size_t leading_space_length(std::string_view text) {
  size_t pos = 0;
  while (pos < text.size()) {
    size_t next = pos;
    if (!is_whitespace(next_code_point(text, next))) break;
    pos = next;
  }
  return pos;
}

}  // namespace

void AddedVocabulary::Trie::add(std::string_view pattern, int32_t token_index) {
  if (terminal.empty()) terminal.push_back(-1);  // root
  uint32_t node = 0;
  for (char c : pattern) {
    const uint64_t key = (static_cast<uint64_t>(node) << 8) | static_cast<uint8_t>(c);
    auto it = edges.find(key);
    if (it == edges.end()) {
      const uint32_t child = static_cast<uint32_t>(terminal.size());
      terminal.push_back(-1);
      it = edges.emplace(key, child).first;
    }
    node = it->second;
  }
  first_byte[static_cast<uint8_t>(pattern[0])] = true;
  if (terminal[node] < 0) terminal[node] = token_index;  // first of duplicate patterns wins
}

size_t AddedVocabulary::Trie::longest_at(std::string_view text, size_t pos,
                                         int32_t* token_index) const {
  size_t best = 0;
  uint32_t node = 0;
  for (size_t i = pos; i < text.size(); ++i) {
    auto it = edges.find((static_cast<uint64_t>(node) << 8) | static_cast<uint8_t>(text[i]));
    if (it == edges.end()) break;
    node = it->second;
    if (terminal[node] >= 0) {
      best = i + 1 - pos;
      *token_index = terminal[node];
    }
  }
  return best;
}

void AddedVocabulary::build(const std::vector<AddedToken>& tokens, const BpeModel& model,
                            const std::function<std::string(std::string_view)>& normalize) {
  // tokenizers: special contents are registered first, then ids are resolved in order.
  for (const AddedToken& t : tokens) {
    if (t.special && !t.content.empty()) special_.emplace(t.content, true);
  }
  const int32_t model_size = static_cast<int32_t>(model.vocab_entries());
  for (const AddedToken& t : tokens) {
    if (t.content.empty() || content_to_id_.count(t.content) > 0) continue;
    int32_t id;
    if (auto known = model.token_to_id(t.content)) {
      id = *known;
    } else if (max_id_ < 0) {
      id = model_size;
    } else {
      id = (max_id_ >= model_size || model_size == 0) ? max_id_ + 1 : model_size;
    }
    AddedToken stored = t;
    stored.id = id;
    content_to_id_.emplace(stored.content, id);
    // A later token with the same id replaces the earlier one for id -> token.
    id_to_index_[id] = tokens_.size();
    max_id_ = std::max(max_id_, id);
    tokens_.push_back(std::move(stored));
  }
  // Trie order: special tokens first, then the others (as tokenizers chains them).
  for (int pass = 0; pass < 2; ++pass) {
    for (size_t i = 0; i < tokens_.size(); ++i) {
      const AddedToken& t = tokens_[i];
      if ((pass == 0) != is_special(t.content)) continue;
      if (t.normalized) {
        const std::string pattern = normalize ? normalize(t.content) : t.content;
        if (!pattern.empty()) normalized_trie_.add(pattern, static_cast<int32_t>(i));
      } else {
        raw_trie_.add(t.content, static_cast<int32_t>(i));
      }
    }
  }
}

void AddedVocabulary::split(std::string_view text, bool normalized,
                            std::vector<TextSpan>& out) const {
  const Trie& t = trie(normalized);
  size_t start_offset = 0;
  size_t pos = 0;
  while (pos < text.size() && !t.terminal.empty()) {
    if (!t.first_byte[static_cast<uint8_t>(text[pos])]) {
      ++pos;
      continue;
    }
    int32_t index = -1;
    const size_t len = t.longest_at(text, pos, &index);
    if (len == 0) {
      ++pos;
      continue;
    }
    size_t start = pos;
    size_t stop = pos + len;
    pos = stop;  // matching resumes after the raw match, whatever happens below
    const AddedToken& token = tokens_[static_cast<size_t>(index)];
    if (token.single_word) {
      const bool space_before = start == 0 || !is_word_char(last_code_point(text.substr(0, start)));
      size_t after = stop;
      const bool space_after = stop == text.size() || !is_word_char(next_code_point(text, after));
      if (!space_before || !space_after) continue;
    }
    if (token.lstrip) start = std::max(trailing_space_start(text.substr(0, start)), start_offset);
    if (token.rstrip) stop += leading_space_length(text.substr(stop));
    if (start_offset < start) out.push_back(TextSpan{start_offset, start, -1});
    out.push_back(TextSpan{start, stop, token.id});
    start_offset = stop;
  }
  if (start_offset < text.size()) out.push_back(TextSpan{start_offset, text.size(), -1});
}

std::optional<int32_t> AddedVocabulary::token_to_id(std::string_view content) const {
  auto it = content_to_id_.find(content);
  if (it == content_to_id_.end()) return std::nullopt;
  return it->second;
}

const AddedToken* AddedVocabulary::find(int32_t id) const {
  auto it = id_to_index_.find(id);
  return it == id_to_index_.end() ? nullptr : &tokens_[it->second];
}

bool AddedVocabulary::is_special(std::string_view content) const {
  return special_.find(content) != special_.end();
}

}  // namespace specula::tokenizer
