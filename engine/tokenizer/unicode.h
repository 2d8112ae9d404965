// SPDX-License-Identifier: Apache-2.0
// UTF-8 and Unicode helpers the tokenizer needs: validation with byte offsets,
// Rust-compatible lossy decoding (Hugging Face tokenizers is written in Rust and
// its decoders use String::from_utf8_lossy), general category classes for the
// GPT-2 split pattern, White_Space, and canonical NFC/NFD normalization.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>

namespace specula::tokenizer {

// General category class (first letter of the Unicode general category).
enum class CharClass : uint8_t {
  kOther = 0,        // C*: controls, format, unassigned, private use, surrogates
  kLetter = 1,       // L*
  kMark = 2,         // M*
  kNumber = 3,       // N*
  kPunctuation = 4,  // P*
  kSymbol = 5,       // S*
  kSeparator = 6,    // Z*
};

// Throws Error naming `what` and the byte offset of the first invalid byte if
// `text` is not well-formed UTF-8 (no overlongs, surrogates or values > U+10FFFF).
void validate_utf8(std::string_view text, std::string_view what);

// Decodes the code point at text[pos] and advances pos. `text` must be valid
// UTF-8 (validate first); no checks are made here.
uint32_t next_code_point(std::string_view text, size_t& pos);

// Byte length of the UTF-8 sequence that starts with `lead` (1 for invalid leads).
inline size_t utf8_sequence_length(uint8_t lead) {
  if (lead < 0x80) return 1;
  if (lead >= 0xF0) return 4;
  if (lead >= 0xE0) return 3;
  if (lead >= 0xC0) return 2;
  return 1;
}

// Appends the UTF-8 encoding of `cp` (must be a valid scalar value).
void append_utf8(std::string& out, uint32_t cp);

// Converts arbitrary bytes to valid UTF-8 exactly as Rust's
// String::from_utf8_lossy does: every maximal invalid subpart becomes one U+FFFD.
// When `incomplete_tail` is given it receives the number of trailing bytes that
// are a valid but unfinished sequence (0..3); those bytes produced the final
// U+FFFD and could still become a character if more bytes followed.
std::string utf8_lossy(std::string_view bytes, size_t* incomplete_tail = nullptr);

CharClass char_class(uint32_t cp);
// Unicode White_Space (what Rust's char::is_whitespace and Oniguruma's \s test).
bool is_whitespace(uint32_t cp);
// Letters or numbers (general categories L* and N*). Rust's char::is_alphanumeric
// uses the Alphabetic property, which also includes a few marks; the difference
// only affects added tokens with single_word = true.
bool is_alphanumeric(uint32_t cp);
// Canonical combining class (0 for starters).
uint8_t combining_class(uint32_t cp);

// Canonical decomposition / composition of valid UTF-8 text.
std::string normalize_nfd(std::string_view text);
std::string normalize_nfc(std::string_view text);

}  // namespace specula::tokenizer
