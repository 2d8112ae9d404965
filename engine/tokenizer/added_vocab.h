// SPDX-License-Identifier: Apache-2.0
// Added tokens of a tokenizer.json ("added_tokens"): special and user tokens
// that are matched in the text before the model runs, with the semantics of
// tokenizers' AddedVocabulary (leftmost-longest matching, lstrip/rstrip/
// single_word, `normalized` tokens matched after normalization).
#pragma once

#include <cstdint>
#include <functional>
#include <optional>
#include <string>
#include <string_view>
#include <unordered_map>
#include <vector>

#include "engine/tokenizer/bpe_model.h"

namespace specula::tokenizer {

struct AddedToken {
  std::string content;
  int32_t id = -1;
  bool special = false;
  bool single_word = false;
  bool lstrip = false;
  bool rstrip = false;
  bool normalized = false;
};

// One piece of a split: [begin, end) bytes of the split text; id >= 0 for an
// added token, -1 for plain text still to be tokenized.
struct TextSpan {
  size_t begin;
  size_t end;
  int32_t id;
};

class AddedVocabulary {
 public:
  // Adds `tokens` in order, resolving ids as tokenizers does: a token whose
  // content is in the model vocab takes that id, otherwise the next id after
  // the model vocab. `normalize` is applied to the content of normalized tokens.
  void build(const std::vector<AddedToken>& tokens, const BpeModel& model,
             const std::function<std::string(std::string_view)>& normalize);

  // Splits `text` into plain spans and added-token spans (in order, covering the
  // text; empty plain spans are left out). `normalized` picks the tokens with
  // normalized = true (for normalized text) or those with normalized = false.
  void split(std::string_view text, bool normalized, std::vector<TextSpan>& out) const;
  bool has_tokens(bool normalized) const { return !trie(normalized).terminal.empty(); }

  std::optional<int32_t> token_to_id(std::string_view content) const;
  // The added token with this id, or nullptr.
  const AddedToken* find(int32_t id) const;
  bool is_special(std::string_view content) const;
  int32_t max_id() const { return max_id_; }
  const std::vector<AddedToken>& tokens() const { return tokens_; }

 private:
  // Byte trie of token contents; terminal[node] = token index or -1.
  struct Trie {
    std::unordered_map<uint64_t, uint32_t> edges;  // (node << 8 | byte) -> child
    std::vector<int32_t> terminal;
    bool first_byte[256] = {};
    void add(std::string_view pattern, int32_t token_index);
    // Longest pattern starting at text[pos]: returns its length (0 if none).
    size_t longest_at(std::string_view text, size_t pos, int32_t* token_index) const;
  };
  const Trie& trie(bool normalized) const { return normalized ? normalized_trie_ : raw_trie_; }

  std::vector<AddedToken> tokens_;  // unique contents, in insertion order
  StringIdMap content_to_id_;
  std::unordered_map<int32_t, size_t> id_to_index_;
  std::unordered_map<std::string, bool, StringHash, std::equal_to<>> special_;
  Trie raw_trie_;
  Trie normalized_trie_;
  int32_t max_id_ = -1;
};

}  // namespace specula::tokenizer
