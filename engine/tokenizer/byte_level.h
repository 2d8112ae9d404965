// SPDX-License-Identifier: Apache-2.0
// GPT-2's reversible byte <-> printable character mapping used by byte-level
// BPE: every byte becomes one visible code point so BPE never sees raw
// control bytes or partial UTF-8.
#pragma once

#include <string>
#include <string_view>

namespace specula::tokenizer {

// Maps each byte of `bytes` to its GPT-2 character; returns UTF-8.
std::string bytes_to_unicode(std::string_view bytes);
// Appends the bytes that `token` stands for. A token with a character outside
// the mapping (e.g. an added token) is appended unchanged, as tokenizers does.
void unicode_to_bytes(std::string_view token, std::string& out);

}  // namespace specula::tokenizer
