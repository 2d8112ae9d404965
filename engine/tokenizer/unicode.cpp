// SPDX-License-Identifier: Apache-2.0
#include "engine/tokenizer/unicode.h"

#include <algorithm>
#include <vector>

#include "engine/core/error.h"
#include "engine/tokenizer/unicode_tables.h"

namespace specula::tokenizer {
namespace {

// Hangul syllables are composed algorithmically (Unicode 3.12).
constexpr uint32_t kSBase = 0xAC00, kLBase = 0x1100, kVBase = 0x1161, kTBase = 0x11A7;
constexpr uint32_t kLCount = 19, kVCount = 21, kTCount = 28;
constexpr uint32_t kNCount = kVCount * kTCount, kSCount = kLCount * kNCount;

// Length of the valid sequence starting at bytes[i], following the byte ranges
// of Rust's UTF-8 validator. Returns 0 if invalid; *consumed receives the number
// of bytes of the maximal invalid subpart and *at_end whether the failure was
// running out of input.
size_t scan_sequence(std::string_view bytes, size_t i, size_t* consumed, bool* at_end) {
  const auto byte_at = [&](size_t k) -> int {
    return k < bytes.size() ? static_cast<uint8_t>(bytes[k]) : -1;
  };
  const uint8_t lead = static_cast<uint8_t>(bytes[i]);
  *at_end = false;
  if (lead < 0x80) return 1;
  size_t width = 0;
  if (lead >= 0xC2 && lead <= 0xDF) {
    width = 2;
  } else if (lead >= 0xE0 && lead <= 0xEF) {
    width = 3;
  } else if (lead >= 0xF0 && lead <= 0xF4) {
    width = 4;
  } else {
    *consumed = 1;
    return 0;
  }
  // Allowed range of the second byte.
  int lo = 0x80, hi = 0xBF;
  if (lead == 0xE0) lo = 0xA0;
  if (lead == 0xED) hi = 0x9F;
  if (lead == 0xF0) lo = 0x90;
  if (lead == 0xF4) hi = 0x8F;
  for (size_t k = 1; k < width; ++k) {
    const int b = byte_at(i + k);
    const int min = k == 1 ? lo : 0x80;
    const int max = k == 1 ? hi : 0xBF;
    if (b < min || b > max) {
      *consumed = k;
      *at_end = b < 0;
      return 0;
    }
  }
  return width;
}

template <typename T>
const T* find_range(const T* table, size_t count, uint32_t cp) {
  const T* end = table + count;
  const T* it =
      std::upper_bound(table, end, cp, [](uint32_t v, const T& r) { return v < r.first; });
  if (it == table) return nullptr;
  --it;
  return cp <= it->last ? it : nullptr;
}

const tables::Decomposition* find_decomposition(uint32_t cp) {
  const auto* begin = tables::kDecompositions;
  const auto* end = begin + tables::kDecompositionCount;
  const auto* it = std::lower_bound(
      begin, end, cp, [](const tables::Decomposition& d, uint32_t v) { return d.cp < v; });
  return it != end && it->cp == cp ? it : nullptr;
}

void decompose(uint32_t cp, std::vector<uint32_t>& out) {
  if (cp >= kSBase && cp < kSBase + kSCount) {
    const uint32_t s = cp - kSBase;
    out.push_back(kLBase + s / kNCount);
    out.push_back(kVBase + (s % kNCount) / kTCount);
    if (s % kTCount != 0) out.push_back(kTBase + s % kTCount);
    return;
  }
  const auto* d = find_decomposition(cp);
  if (d == nullptr) {
    out.push_back(cp);
    return;
  }
  decompose(d->first, out);
  if (d->second != 0) decompose(d->second, out);
}

// Returns the primary composite of a + b, or 0 if there is none.
uint32_t compose_pair(uint32_t a, uint32_t b) {
  if (a >= kLBase && a < kLBase + kLCount && b >= kVBase && b < kVBase + kVCount) {
    return kSBase + ((a - kLBase) * kVCount + (b - kVBase)) * kTCount;
  }
  if (a >= kSBase && a < kSBase + kSCount && (a - kSBase) % kTCount == 0 && b > kTBase &&
      b < kTBase + kTCount) {
    return a + (b - kTBase);
  }
  const auto* begin = tables::kCompositions;
  const auto* end = begin + tables::kCompositionCount;
  const auto* it =
      std::lower_bound(begin, end, std::pair<uint32_t, uint32_t>(a, b),
                       [](const tables::Composition& c, std::pair<uint32_t, uint32_t> v) {
                         return c.first != v.first ? c.first < v.first : c.second < v.second;
                       });
  return it != end && it->first == a && it->second == b ? it->composite : 0;
}

// Full canonical decomposition followed by canonical ordering.
std::vector<uint32_t> decomposed(std::string_view text) {
  std::vector<uint32_t> cps;
  cps.reserve(text.size());
  size_t pos = 0;
  while (pos < text.size()) decompose(next_code_point(text, pos), cps);
  // Stable sort of each run of non-starters by combining class.
  size_t i = 0;
  while (i < cps.size()) {
    if (combining_class(cps[i]) == 0) {
      ++i;
      continue;
    }
    size_t j = i;
    while (j < cps.size() && combining_class(cps[j]) != 0) ++j;
    std::stable_sort(
        cps.begin() + static_cast<std::ptrdiff_t>(i), cps.begin() + static_cast<std::ptrdiff_t>(j),
        [](uint32_t a, uint32_t b) { return combining_class(a) < combining_class(b); });
    i = j;
  }
  return cps;
}

bool is_ascii(std::string_view text) {
  for (char c : text) {
    if (static_cast<uint8_t>(c) >= 0x80) return false;
  }
  return true;
}

}  // namespace

void validate_utf8(std::string_view text, std::string_view what) {
  size_t i = 0;
  while (i < text.size()) {
    if (static_cast<uint8_t>(text[i]) < 0x80) {
      ++i;
      continue;
    }
    size_t consumed = 0;
    bool at_end = false;
    const size_t len = scan_sequence(text, i, &consumed, &at_end);
    if (len == 0) {
      fail("{}: invalid UTF-8 at byte offset {} (byte 0x{:02X}{})", what, i,
           static_cast<uint8_t>(text[i]), at_end ? ", truncated sequence at end of input" : "");
    }
    i += len;
  }
}

uint32_t next_code_point(std::string_view text, size_t& pos) {
  const uint8_t b0 = static_cast<uint8_t>(text[pos]);
  if (b0 < 0x80) {
    ++pos;
    return b0;
  }
  const size_t len = utf8_sequence_length(b0);
  uint32_t cp = len == 2 ? (b0 & 0x1F) : len == 3 ? (b0 & 0x0F) : (b0 & 0x07);
  for (size_t k = 1; k < len; ++k) cp = (cp << 6) | (static_cast<uint8_t>(text[pos + k]) & 0x3F);
  pos += len;
  return cp;
}

void append_utf8(std::string& out, uint32_t cp) {
  if (cp < 0x80) {
    out.push_back(static_cast<char>(cp));
  } else if (cp < 0x800) {
    out.push_back(static_cast<char>(0xC0 | (cp >> 6)));
    out.push_back(static_cast<char>(0x80 | (cp & 0x3F)));
  } else if (cp < 0x10000) {
    out.push_back(static_cast<char>(0xE0 | (cp >> 12)));
    out.push_back(static_cast<char>(0x80 | ((cp >> 6) & 0x3F)));
    out.push_back(static_cast<char>(0x80 | (cp & 0x3F)));
  } else {
    out.push_back(static_cast<char>(0xF0 | (cp >> 18)));
    out.push_back(static_cast<char>(0x80 | ((cp >> 12) & 0x3F)));
    out.push_back(static_cast<char>(0x80 | ((cp >> 6) & 0x3F)));
    out.push_back(static_cast<char>(0x80 | (cp & 0x3F)));
  }
}

std::string utf8_lossy(std::string_view bytes, size_t* incomplete_tail) {
  std::string out;
  out.reserve(bytes.size());
  if (incomplete_tail != nullptr) *incomplete_tail = 0;
  size_t i = 0;
  while (i < bytes.size()) {
    size_t consumed = 0;
    bool at_end = false;
    const size_t len = scan_sequence(bytes, i, &consumed, &at_end);
    if (len > 0) {
      out.append(bytes.substr(i, len));
      i += len;
      continue;
    }
    out.append("\xEF\xBF\xBD");
    if (at_end && incomplete_tail != nullptr) *incomplete_tail = consumed;
    i += consumed;
  }
  return out;
}

CharClass char_class(uint32_t cp) {
  const auto* r = find_range(tables::kCategoryRanges, tables::kCategoryRangeCount, cp);
  return r == nullptr ? CharClass::kOther : static_cast<CharClass>(r->cls);
}

bool is_whitespace(uint32_t cp) {
  if (cp < 0x80) return cp == 0x20 || (cp >= 0x09 && cp <= 0x0D);
  return cp == 0x85 || cp == 0xA0 || cp == 0x1680 || (cp >= 0x2000 && cp <= 0x200A) ||
         cp == 0x2028 || cp == 0x2029 || cp == 0x202F || cp == 0x205F || cp == 0x3000;
}

bool is_alphanumeric(uint32_t cp) {
  if (cp < 0x80) {
    return (cp >= '0' && cp <= '9') || (cp >= 'a' && cp <= 'z') || (cp >= 'A' && cp <= 'Z');
  }
  const CharClass c = char_class(cp);
  return c == CharClass::kLetter || c == CharClass::kNumber;
}

uint8_t combining_class(uint32_t cp) {
  if (cp < 0x300) return 0;
  const auto* r = find_range(tables::kCombiningRanges, tables::kCombiningRangeCount, cp);
  return r == nullptr ? 0 : r->ccc;
}

std::string normalize_nfd(std::string_view text) {
  if (is_ascii(text)) return std::string(text);
  std::string out;
  out.reserve(text.size());
  for (uint32_t cp : decomposed(text)) append_utf8(out, cp);
  return out;
}

std::string normalize_nfc(std::string_view text) {
  if (is_ascii(text)) return std::string(text);
  std::vector<uint32_t> cps = decomposed(text);
  std::vector<uint32_t> result;
  result.reserve(cps.size());
  std::ptrdiff_t starter = -1;
  for (uint32_t cp : cps) {
    const uint8_t ccc = combining_class(cp);
    if (starter >= 0) {
      const bool adjacent = static_cast<std::ptrdiff_t>(result.size()) - 1 == starter;
      const uint8_t prev_ccc = adjacent ? 0 : combining_class(result.back());
      // cp may combine with the starter unless a character between them blocks it.
      if (adjacent || (prev_ccc != 0 && prev_ccc < ccc)) {
        const uint32_t composite = compose_pair(result[static_cast<size_t>(starter)], cp);
        if (composite != 0) {
          result[static_cast<size_t>(starter)] = composite;
          continue;
        }
      }
    }
    if (ccc == 0) starter = static_cast<std::ptrdiff_t>(result.size());
    result.push_back(cp);
  }
  std::string out;
  out.reserve(text.size());
  for (uint32_t cp : result) append_utf8(out, cp);
  return out;
}

}  // namespace specula::tokenizer
