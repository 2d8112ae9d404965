// SPDX-License-Identifier: Apache-2.0
// Reading JSON files with errors that name the file, the field and the value.
#pragma once

#include <nlohmann/json.hpp>

#include <string>

namespace specula::io {

// Parses a whole JSON file; an Error names the file and the parse position.
nlohmann::json read_json_file(const std::string& path);
// Parses JSON text; `origin` names its source in errors.
nlohmann::json parse_json_text(const std::string& text, const std::string& origin);

}  // namespace specula::io
