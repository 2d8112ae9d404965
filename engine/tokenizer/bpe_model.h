// SPDX-License-Identifier: Apache-2.0
// The BPE model of a Hugging Face tokenizer.json ("model": {"type": "BPE"}):
// vocab, ranked merges, byte fallback (<0xNN> tokens), unk handling and a word
// cache. It turns one pre-token ("word") into ids exactly as tokenizers'
// BPE::tokenize does: initial symbols per character, then repeatedly merge the
// adjacent pair with the lowest rank (ties: leftmost first).
#pragma once

#include <cstdint>
#include <mutex>
#include <optional>
#include <string>
#include <string_view>
#include <unordered_map>
#include <vector>

#include "engine/tokenizer/json_fields.h"

namespace specula::tokenizer {

// Hash for std::string / std::string_view keys (heterogeneous lookup).
struct StringHash {
  using is_transparent = void;
  size_t operator()(std::string_view s) const { return std::hash<std::string_view>{}(s); }
};
using StringIdMap = std::unordered_map<std::string, int32_t, StringHash, std::equal_to<>>;

// Open-addressing map (left id, right id) -> (rank, merged id). Immutable after build.
class MergeTable {
 public:
  struct Entry {
    uint64_t key = kEmpty;
    uint32_t rank = 0;
    int32_t merged = 0;
  };
  static constexpr uint64_t kEmpty = ~uint64_t{0};

  void reserve(size_t n);
  // Later inserts of the same pair overwrite earlier ones (as tokenizers' HashMap collect does).
  void insert(int32_t left, int32_t right, uint32_t rank, int32_t merged);
  const Entry* find(int32_t left, int32_t right) const {
    if (slots_.empty()) return nullptr;
    const uint64_t key = pack(left, right);
    size_t i = slot_of(key);
    while (true) {
      const Entry& e = slots_[i];
      if (e.key == key) return &e;
      if (e.key == kEmpty) return nullptr;
      i = (i + 1) & mask_;
    }
  }
  size_t size() const { return count_; }

 private:
  static uint64_t pack(int32_t a, int32_t b) {
    return (static_cast<uint64_t>(static_cast<uint32_t>(a)) << 32) | static_cast<uint32_t>(b);
  }
  size_t slot_of(uint64_t key) const {
    return static_cast<size_t>((key * 0x9E3779B97F4A7C15ull) >> shift_) & mask_;
  }

  std::vector<Entry> slots_;
  size_t mask_ = 0;
  int shift_ = 64;
  size_t count_ = 0;
};

class BpeModel {
 public:
  // Parses the "model" object of tokenizer.json (view names the file and path).
  static BpeModel from_json(const JsonView& model);

  BpeModel(BpeModel&& other) noexcept;
  BpeModel& operator=(BpeModel&& other) noexcept;
  BpeModel(const BpeModel&) = delete;
  BpeModel& operator=(const BpeModel&) = delete;

  // Appends the ids of `word` (valid UTF-8, one pre-token) to `out`. Thread-safe.
  void tokenize(std::string_view word, std::vector<int32_t>& out) const;

  std::optional<int32_t> token_to_id(std::string_view token) const;
  // nullptr when no vocab entry has this id.
  const std::string* id_to_token(int32_t id) const;
  // Number of vocab entries (tokenizers' BPE::get_vocab_size).
  size_t vocab_entries() const { return vocab_.size(); }
  // Largest id in the vocab, -1 if empty.
  int32_t max_id() const { return static_cast<int32_t>(id_to_token_.size()) - 1; }
  bool byte_fallback() const { return byte_fallback_; }
  std::optional<int32_t> unk_id() const { return unk_id_; }
  const std::string& unk_token() const { return unk_token_; }
  size_t merge_count() const { return merges_.size(); }

 private:
  BpeModel() = default;
  struct Symbol {
    int32_t id;
    int32_t prev;
    int32_t next;
    uint32_t len;  // bytes covered; 0 marks a symbol merged into its left neighbour
  };
  void merge_word(std::string_view word, std::vector<int32_t>& out) const;
  std::optional<int32_t> lookup_char(std::string_view ch, uint32_t cp, bool first, bool last) const;

  StringIdMap vocab_;
  std::vector<const std::string*> id_to_token_;  // points into vocab_ keys
  MergeTable merges_;
  std::vector<int32_t> char_ids_;  // code point -> id of the one-character token, or -1
  int32_t byte_ids_[256] = {};     // <0xNN> ids, -1 when absent
  bool byte_fallback_ = false;
  bool fuse_unk_ = false;
  bool ignore_merges_ = false;
  std::string unk_token_;
  std::optional<int32_t> unk_id_;
  std::string continuing_subword_prefix_;
  std::string end_of_word_suffix_;

  // Word cache (tokenizers caches words shorter than 256 bytes, up to 10,000 of them).
  static constexpr size_t kCacheCapacity = 10000;
  static constexpr size_t kCacheMaxWordBytes = 256;
  mutable std::mutex cache_mutex_;
  mutable std::unordered_map<std::string, std::vector<int32_t>, StringHash, std::equal_to<>> cache_;
};

}  // namespace specula::tokenizer
