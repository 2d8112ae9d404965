// SPDX-License-Identifier: Apache-2.0
#include "engine/tokenizer/byte_level.h"

#include <array>
#include <cstdint>

#include "engine/tokenizer/unicode.h"

namespace specula::tokenizer {
namespace {

struct ByteTables {
  std::array<uint32_t, 256> to_char{};   // byte -> code point
  std::array<int16_t, 324> to_byte{};    // code point (< 324) -> byte, -1 if unmapped
  std::array<std::string, 256> encoded;  // byte -> UTF-8 of its code point

  ByteTables() {
    // Printable Latin-1 bytes map to themselves; the rest to 256, 257, ...
    const auto printable = [](int b) {
      return (b >= '!' && b <= '~') || (b >= 0xA1 && b <= 0xAC) || (b >= 0xAE && b <= 0xFF);
    };
    uint32_t next = 256;
    for (int b = 0; b < 256; ++b)
      to_char[static_cast<size_t>(b)] = printable(b) ? static_cast<uint32_t>(b) : next++;
    to_byte.fill(-1);
    for (int b = 0; b < 256; ++b) {
      to_byte[to_char[static_cast<size_t>(b)]] = static_cast<int16_t>(b);
      append_utf8(encoded[static_cast<size_t>(b)], to_char[static_cast<size_t>(b)]);
    }
  }
};

const ByteTables& tables() {
  static const ByteTables t;
  return t;
}

}  // namespace

std::string bytes_to_unicode(std::string_view bytes) {
  const ByteTables& t = tables();
  std::string out;
  out.reserve(bytes.size() * 2);
  for (char c : bytes) out.append(t.encoded[static_cast<uint8_t>(c)]);
  return out;
}

void unicode_to_bytes(std::string_view token, std::string& out) {
  const ByteTables& t = tables();
  const size_t mark = out.size();
  size_t pos = 0;
  while (pos < token.size()) {
    const uint32_t cp = next_code_point(token, pos);
    if (cp >= t.to_byte.size() || t.to_byte[cp] < 0) {
      out.resize(mark);
      out.append(token);
      return;
    }
    out.push_back(static_cast<char>(t.to_byte[cp]));
  }
}

}  // namespace specula::tokenizer
