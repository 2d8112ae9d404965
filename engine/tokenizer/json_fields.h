// SPDX-License-Identifier: Apache-2.0
// Typed access to tokenizer JSON fields. Every error names the file (origin),
// the dotted field path and what was found there, so a malformed or truncated
// tokenizer.json is reported, never crashed on.
#pragma once

#include <nlohmann/json.hpp>

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>

namespace specula::tokenizer {

// A JSON value plus where it came from: `origin` is the file, `path` the dotted
// field path inside it (e.g. "model.merges[12]"). Non-owning: the json and the
// strings must outlive the view.
class JsonView {
 public:
  JsonView(const nlohmann::json& value, const std::string& origin, std::string path)
      : value_(&value), origin_(&origin), path_(std::move(path)) {}

  const nlohmann::json& json() const { return *value_; }
  const std::string& origin() const { return *origin_; }
  const std::string& path() const { return path_; }

  bool has(std::string_view key) const;
  // Member `key` (must exist and this must be an object).
  JsonView at(std::string_view key) const;
  // Member `key` when present and not null.
  std::optional<JsonView> find(std::string_view key) const;
  JsonView at(size_t index) const;

  std::string as_string() const;
  int64_t as_int() const;
  bool as_bool() const;
  double as_number() const;
  void expect_object() const;
  void expect_array() const;

  // Optional members with defaults (a present member of the wrong type is an error).
  std::string string_or(std::string_view key, std::string fallback) const;
  bool bool_or(std::string_view key, bool fallback) const;
  int64_t int_or(std::string_view key, int64_t fallback) const;

  // Throws Error: "<origin>: field <path>: <message>".
  [[noreturn]] void fail_here(std::string_view message) const;

 private:
  static std::string type_name(const nlohmann::json& v);

  const nlohmann::json* value_;
  const std::string* origin_;
  std::string path_;
};

// Parses JSON text (via io::parse_json_text: errors name `origin` and the
// position; absurdly deep nesting is rejected instead of overflowing the stack).
nlohmann::json parse_json(std::string_view text, const std::string& origin);
// Reads and parses a JSON file; errors name the file.
nlohmann::json read_json(const std::string& file);

}  // namespace specula::tokenizer
