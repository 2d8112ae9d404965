// SPDX-License-Identifier: Apache-2.0
#include "engine/io/json_util.h"

#include <cerrno>
#include <cstring>
#include <fstream>
#include <sstream>

#include "engine/core/error.h"

namespace specula::io {
namespace {

// nlohmann's parser is iterative, but dumping, comparing and copying a value
// recurse; a hostile file nested a million levels deep would overflow the
// stack there. No config or header we read nests beyond a handful of levels.
constexpr int kMaxDepth = 256;

// Returns the byte offset where the nesting first exceeds kMaxDepth, or npos.
// Brackets inside strings do not count; escapes inside strings are skipped.
size_t find_excess_nesting(const std::string& text) {
  int depth = 0;
  bool in_string = false;
  for (size_t i = 0; i < text.size(); ++i) {
    const char c = text[i];
    if (in_string) {
      if (c == '\\') {
        ++i;
      } else if (c == '"') {
        in_string = false;
      }
      continue;
    }
    if (c == '"') {
      in_string = true;
    } else if (c == '[' || c == '{') {
      if (++depth > kMaxDepth) return i;
    } else if (c == ']' || c == '}') {
      --depth;
    }
  }
  return std::string::npos;
}

}  // namespace

nlohmann::json read_json_file(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) fail("cannot open JSON file '{}': {}", path, std::strerror(errno));
  std::ostringstream text;
  text << in.rdbuf();
  if (in.bad()) fail("cannot read JSON file '{}': {}", path, std::strerror(errno));
  return parse_json_text(text.str(), path);
}

nlohmann::json parse_json_text(const std::string& text, const std::string& origin) {
  if (const size_t at = find_excess_nesting(text); at != std::string::npos) {
    fail("{}: invalid JSON: nesting deeper than {} levels at byte {}", origin, kMaxDepth, at);
  }
  try {
    return nlohmann::json::parse(text);
  } catch (const nlohmann::json::parse_error& e) {
    // e.what() already carries "line L, column C" and what was expected.
    fail("{}: invalid JSON at byte {}: {}", origin, e.byte, e.what());
  } catch (const nlohmann::json::exception& e) {
    // A number too large for a double is reported as out_of_range, not parse_error.
    fail("{}: invalid JSON: {}", origin, e.what());
  }
}

std::string json_type_name(const nlohmann::json& value) {
  if (value.is_number_integer()) return "integer";
  if (value.is_number_float()) return "number";
  return value.type_name();
}

std::string json_excerpt(const nlohmann::json& value, size_t max_chars) {
  std::string s = value.dump(-1, ' ', false, nlohmann::json::error_handler_t::replace);
  if (s.size() > max_chars) {
    s.resize(max_chars);
    s += "...";
  }
  return s;
}

}  // namespace specula::io
