// SPDX-License-Identifier: Apache-2.0
#include "engine/tokenizer/bpe_model.h"

#include <algorithm>
#include <bit>

#include "engine/core/error.h"
#include "engine/tokenizer/unicode.h"

namespace specula::tokenizer {

void MergeTable::reserve(size_t n) {
  size_t cap = 16;
  while (cap < n * 2) cap <<= 1;
  slots_.assign(cap, Entry{});
  mask_ = cap - 1;
  shift_ = 64 - std::countr_zero(cap);
  count_ = 0;
}

void MergeTable::insert(int32_t left, int32_t right, uint32_t rank, int32_t merged) {
  if ((count_ + 1) * 2 > slots_.size()) {
    // Grow and rehash.
    std::vector<Entry> old = std::move(slots_);
    reserve(std::max<size_t>(count_ + 1, old.size()));
    for (const Entry& e : old) {
      if (e.key != kEmpty) {
        insert(static_cast<int32_t>(e.key >> 32), static_cast<int32_t>(e.key & 0xFFFFFFFFu), e.rank,
               e.merged);
      }
    }
  }
  const uint64_t key = pack(left, right);
  size_t i = slot_of(key);
  while (slots_[i].key != kEmpty && slots_[i].key != key) i = (i + 1) & mask_;
  if (slots_[i].key == kEmpty) ++count_;
  slots_[i] = Entry{key, rank, merged};
}

BpeModel::BpeModel(BpeModel&& other) noexcept {
  *this = std::move(other);
}

BpeModel& BpeModel::operator=(BpeModel&& other) noexcept {
  if (this == &other) return *this;
  vocab_ = std::move(other.vocab_);
  id_to_token_ = std::move(other.id_to_token_);
  merges_ = std::move(other.merges_);
  char_ids_ = std::move(other.char_ids_);
  std::copy(std::begin(other.byte_ids_), std::end(other.byte_ids_), std::begin(byte_ids_));
  byte_fallback_ = other.byte_fallback_;
  fuse_unk_ = other.fuse_unk_;
  ignore_merges_ = other.ignore_merges_;
  unk_token_ = std::move(other.unk_token_);
  unk_id_ = other.unk_id_;
  continuing_subword_prefix_ = std::move(other.continuing_subword_prefix_);
  end_of_word_suffix_ = std::move(other.end_of_word_suffix_);
  std::lock_guard<std::mutex> lock(other.cache_mutex_);
  cache_ = std::move(other.cache_);
  return *this;
}

BpeModel BpeModel::from_json(const JsonView& model) {
  BpeModel bpe;
  const std::string type = model.string_or("type", "BPE");
  if (type != "BPE") {
    model.at("type").fail_here(fmt::format("unsupported model type '{}' (supported: BPE)", type));
  }
  if (auto dropout = model.find("dropout")) {
    const double p = dropout->as_number();
    if (p != 0.0)
      dropout->fail_here(fmt::format("BPE dropout {} is not supported (only 0/null)", p));
  }
  bpe.byte_fallback_ = model.bool_or("byte_fallback", false);
  bpe.fuse_unk_ = model.bool_or("fuse_unk", false);
  bpe.ignore_merges_ = model.bool_or("ignore_merges", false);
  bpe.continuing_subword_prefix_ = model.string_or("continuing_subword_prefix", "");
  bpe.end_of_word_suffix_ = model.string_or("end_of_word_suffix", "");

  // Vocab: {"token": id, ...}.
  const JsonView vocab = model.at("vocab");
  vocab.expect_object();
  bpe.vocab_.reserve(vocab.json().size());
  int64_t max_id = -1;
  for (auto it = vocab.json().begin(); it != vocab.json().end(); ++it) {
    if (!it.value().is_number_integer()) {
      vocab.fail_here(
          fmt::format("id of token '{}' is {}, expected an integer", it.key(), it.value().dump()));
    }
    const int64_t id = it.value().get<int64_t>();
    if (id < 0 || id >= (int64_t{1} << 30)) {
      vocab.fail_here(fmt::format("id of token '{}' is {}, out of range", it.key(), id));
    }
    bpe.vocab_.emplace(it.key(), static_cast<int32_t>(id));
    max_id = std::max(max_id, id);
  }
  if (max_id >= 0 && static_cast<size_t>(max_id) > 16 * bpe.vocab_.size() + 4096) {
    vocab.fail_here(
        fmt::format("ids are too sparse: {} tokens but max id {}", bpe.vocab_.size(), max_id));
  }
  bpe.id_to_token_.assign(static_cast<size_t>(max_id + 1), nullptr);
  for (const auto& [token, id] : bpe.vocab_) {
    // Several tokens with one id: keep one deterministically (the smallest string).
    const std::string*& slot = bpe.id_to_token_[static_cast<size_t>(id)];
    if (slot == nullptr || token < *slot) slot = &token;
  }

  // Single-character tokens, for the fast path of the initial symbol lookup.
  if (bpe.continuing_subword_prefix_.empty() && bpe.end_of_word_suffix_.empty()) {
    uint32_t max_cp = 0;
    std::vector<std::pair<uint32_t, int32_t>> singles;
    for (const auto& [token, id] : bpe.vocab_) {
      if (token.empty() || token.size() > 4) continue;
      size_t n = utf8_sequence_length(static_cast<uint8_t>(token[0]));
      if (n != token.size()) continue;
      size_t pos = 0;
      const uint32_t cp = next_code_point(token, pos);
      singles.emplace_back(cp, id);
      max_cp = std::max(max_cp, cp);
    }
    bpe.char_ids_.assign(max_cp + 1, -1);
    for (auto [cp, id] : singles) bpe.char_ids_[cp] = id;
  }
  for (int b = 0; b < 256; ++b) {
    auto it = bpe.vocab_.find(fmt::format("<0x{:02X}>", b));
    bpe.byte_ids_[b] = it == bpe.vocab_.end() ? -1 : it->second;
  }

  if (auto unk = model.find("unk_token")) {
    bpe.unk_token_ = unk->as_string();
    auto it = bpe.vocab_.find(bpe.unk_token_);
    if (it != bpe.vocab_.end()) bpe.unk_id_ = it->second;
  }

  // Merges: ["a b", ...] or [["a", "b"], ...]; rank = position in the list.
  const JsonView merges = model.at("merges");
  merges.expect_array();
  const size_t n_merges = merges.json().size();
  bpe.merges_.reserve(n_merges);
  const size_t prefix_len = bpe.continuing_subword_prefix_.size();
  std::string left, right, merged;
  for (size_t rank = 0; rank < n_merges; ++rank) {
    const nlohmann::json& m = merges.json()[rank];
    // tokenizers accepts either form for the whole list, never a mix.
    if (rank > 0 && m.is_string() != merges.json()[0].is_string()) {
      merges.at(rank).fail_here("merges mix the \"a b\" and [\"a\", \"b\"] forms");
    }
    if (m.is_string()) {
      const std::string& line = m.get_ref<const std::string&>();
      const size_t space = line.find(' ');
      if (space == std::string::npos || line.find(' ', space + 1) != std::string::npos) {
        merges.at(rank).fail_here(
            fmt::format("merge '{}' must be two tokens separated by one space", line));
      }
      left.assign(line, 0, space);
      right.assign(line, space + 1);
    } else if (m.is_array() && m.size() == 2 && m[0].is_string() && m[1].is_string()) {
      left = m[0].get<std::string>();
      right = m[1].get<std::string>();
    } else {
      merges.at(rank).fail_here(
          fmt::format("expected \"a b\" or [\"a\", \"b\"], found {}", m.dump().substr(0, 80)));
    }
    auto a = bpe.vocab_.find(left);
    auto b = bpe.vocab_.find(right);
    if (a == bpe.vocab_.end() || b == bpe.vocab_.end()) {
      merges.at(rank).fail_here(fmt::format("merge token '{}' is not in the vocab",
                                            a == bpe.vocab_.end() ? left : right));
    }
    merged = left;
    if (prefix_len > 0 && right.compare(0, prefix_len, bpe.continuing_subword_prefix_) == 0) {
      merged.append(right, prefix_len);
    } else {
      merged.append(right);
    }
    auto c = bpe.vocab_.find(merged);
    if (c == bpe.vocab_.end()) {
      merges.at(rank).fail_here(fmt::format("merged token '{}' is not in the vocab", merged));
    }
    bpe.merges_.insert(a->second, b->second, static_cast<uint32_t>(rank), c->second);
  }
  return bpe;
}

std::optional<int32_t> BpeModel::token_to_id(std::string_view token) const {
  auto it = vocab_.find(token);
  if (it == vocab_.end()) return std::nullopt;
  return it->second;
}

const std::string* BpeModel::id_to_token(int32_t id) const {
  if (id < 0 || static_cast<size_t>(id) >= id_to_token_.size()) return nullptr;
  return id_to_token_[static_cast<size_t>(id)];
}

std::optional<int32_t> BpeModel::lookup_char(std::string_view ch, uint32_t cp, bool first,
                                             bool last) const {
  if (continuing_subword_prefix_.empty() && end_of_word_suffix_.empty()) {
    if (cp < char_ids_.size() && char_ids_[cp] >= 0) return char_ids_[cp];
    return std::nullopt;
  }
  std::string s;
  if (!first) s += continuing_subword_prefix_;
  s.append(ch);
  if (last) s += end_of_word_suffix_;
  return token_to_id(s);
}

void BpeModel::tokenize(std::string_view word, std::vector<int32_t>& out) const {
  if (word.empty()) return;
  if (ignore_merges_) {
    if (auto id = token_to_id(word)) {
      out.push_back(*id);
      return;
    }
  }
  const bool cacheable = word.size() < kCacheMaxWordBytes;
  if (cacheable) {
    std::unique_lock<std::mutex> lock(cache_mutex_, std::try_to_lock);
    if (lock.owns_lock()) {
      auto it = cache_.find(word);
      if (it != cache_.end()) {
        out.insert(out.end(), it->second.begin(), it->second.end());
        return;
      }
    }
  }
  const size_t start = out.size();
  merge_word(word, out);
  if (cacheable) {
    std::unique_lock<std::mutex> lock(cache_mutex_, std::try_to_lock);
    if (lock.owns_lock() && cache_.size() < kCacheCapacity) {
      cache_.emplace(
          std::string(word),
          std::vector<int32_t>(out.begin() + static_cast<std::ptrdiff_t>(start), out.end()));
    }
  }
}

void BpeModel::merge_word(std::string_view word, std::vector<int32_t>& out) const {
  // Per-thread scratch so long words do not allocate on every call.
  thread_local std::vector<Symbol> symbols;
  struct Candidate {
    uint32_t rank;
    uint32_t pos;
    int32_t merged;
  };
  thread_local std::vector<Candidate> heap;
  symbols.clear();
  heap.clear();

  const auto add = [&](int32_t id, uint32_t len) {
    const int32_t index = static_cast<int32_t>(symbols.size());
    symbols.push_back(Symbol{id, index - 1, -1, len});
    if (index > 0) symbols[static_cast<size_t>(index - 1)].next = index;
  };

  // Initial symbols: one per character, or its <0xNN> bytes, or (fused) unk.
  bool have_unk = false;
  int32_t unk_pending_id = 0;
  uint32_t unk_pending_len = 0;
  size_t pos = 0;
  while (pos < word.size()) {
    const size_t begin = pos;
    const uint32_t cp = next_code_point(word, pos);
    const std::string_view ch = word.substr(begin, pos - begin);
    const uint32_t len = static_cast<uint32_t>(ch.size());
    if (auto id = lookup_char(ch, cp, begin == 0, pos == word.size())) {
      if (have_unk) {
        add(unk_pending_id, unk_pending_len);
        have_unk = false;
      }
      add(*id, len);
      continue;
    }
    if (byte_fallback_) {
      // tokenizers falls back on the bytes of the looked-up string, prefix included.
      std::string looked_up;
      if (!continuing_subword_prefix_.empty() && begin != 0)
        looked_up += continuing_subword_prefix_;
      looked_up.append(ch);
      if (!end_of_word_suffix_.empty() && pos == word.size()) looked_up += end_of_word_suffix_;
      bool all = true;
      for (char c : looked_up) all = all && byte_ids_[static_cast<uint8_t>(c)] >= 0;
      if (all) {
        // A pending unk is deliberately not flushed here (tokenizers does the same).
        for (char c : looked_up) add(byte_ids_[static_cast<uint8_t>(c)], 1);
        continue;
      }
    }
    if (!unk_token_.empty()) {
      if (!unk_id_) {
        fail("tokenizer: unk_token '{}' is not in the vocab (needed for character '{}')",
             unk_token_, ch);
      }
      if (have_unk && fuse_unk_) {
        unk_pending_len += len;
      } else {
        if (have_unk) add(unk_pending_id, unk_pending_len);
        have_unk = true;
        unk_pending_id = *unk_id_;
        unk_pending_len = len;
      }
    }
    // Without an unk token the character is dropped, as tokenizers does.
  }
  if (have_unk) add(unk_pending_id, unk_pending_len);

  // Min-heap on (rank, pos): lowest rank first, leftmost on ties.
  const auto later = [](const Candidate& a, const Candidate& b) {
    return a.rank != b.rank ? a.rank > b.rank : a.pos > b.pos;
  };
  for (size_t i = 0; i + 1 < symbols.size(); ++i) {
    if (const auto* m = merges_.find(symbols[i].id, symbols[i + 1].id)) {
      heap.push_back(Candidate{m->rank, static_cast<uint32_t>(i), m->merged});
    }
  }
  std::make_heap(heap.begin(), heap.end(), later);
  while (!heap.empty()) {
    std::pop_heap(heap.begin(), heap.end(), later);
    const Candidate top = heap.back();
    heap.pop_back();
    Symbol& left = symbols[top.pos];
    if (left.len == 0 || left.next < 0) continue;
    const int32_t right_index = left.next;
    const Symbol right = symbols[static_cast<size_t>(right_index)];
    // Skip stale candidates: the pair at this position changed since it was queued.
    const auto* m = merges_.find(left.id, right.id);
    if (m == nullptr || m->merged != top.merged) continue;

    left.id = top.merged;
    left.len += right.len;
    left.next = right.next;
    symbols[static_cast<size_t>(right_index)].len = 0;
    if (right.next >= 0)
      symbols[static_cast<size_t>(right.next)].prev = static_cast<int32_t>(top.pos);

    if (left.prev >= 0) {
      const Symbol& prev = symbols[static_cast<size_t>(left.prev)];
      if (const auto* pm = merges_.find(prev.id, left.id)) {
        heap.push_back(Candidate{pm->rank, static_cast<uint32_t>(left.prev), pm->merged});
        std::push_heap(heap.begin(), heap.end(), later);
      }
    }
    if (left.next >= 0) {
      const Symbol& next = symbols[static_cast<size_t>(left.next)];
      if (const auto* nm = merges_.find(left.id, next.id)) {
        heap.push_back(Candidate{nm->rank, top.pos, nm->merged});
        std::push_heap(heap.begin(), heap.end(), later);
      }
    }
  }
  for (const Symbol& s : symbols) {
    if (s.len != 0) out.push_back(s.id);
  }
}

}  // namespace specula::tokenizer
