// SPDX-License-Identifier: Apache-2.0
// Reading JSON files with errors that name the file, the field and the value.
#pragma once

#include <nlohmann/json.hpp>

#include <string>

namespace specula::io {

// Parses a whole JSON file; an Error names the file and the parse position.
nlohmann::json read_json_file(const std::string& path);
// Parses JSON text; `origin` names its source in errors. Nesting deeper than
// 256 levels is rejected (no file we read nests that deep, and deep nesting
// would overflow the stack when the value is later copied or printed).
nlohmann::json parse_json_text(const std::string& text, const std::string& origin);

// "integer", "number", "string", "array", "object", "boolean" or "null": the
// JSON type as an error message should name it.
std::string json_type_name(const nlohmann::json& value);
// The value as compact JSON, clipped to `max_chars` (plus "...") for error messages.
std::string json_excerpt(const nlohmann::json& value, size_t max_chars = 80);

}  // namespace specula::io
