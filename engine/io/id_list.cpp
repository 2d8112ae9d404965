// SPDX-License-Identifier: Apache-2.0
#include "engine/io/id_list.h"

#include <charconv>
#include <system_error>

#include "engine/core/error.h"

namespace specula::io {

std::vector<int32_t> parse_id_list(const std::string& text, const char* flag) {
  std::vector<int32_t> ids;
  size_t i = 0;
  while (i < text.size()) {
    while (i < text.size() && (text[i] == ' ' || text[i] == ',')) ++i;
    if (i >= text.size()) break;
    size_t j = i;
    while (j < text.size() && text[j] != ',' && text[j] != ' ') ++j;
    int32_t value = 0;
    auto [ptr, ec] = std::from_chars(text.data() + i, text.data() + j, value);
    if (ec != std::errc() || ptr != text.data() + j || value < 0) {
      fail("{}: '{}' is not a token id (expected non-negative integers separated by commas)", flag,
           text.substr(i, j - i));
    }
    ids.push_back(value);
    i = j;
  }
  if (ids.empty()) fail("{}: no token ids given", flag);
  return ids;
}

}  // namespace specula::io
