// SPDX-License-Identifier: Apache-2.0
#include "engine/tokenizer/json_fields.h"

#include "engine/core/error.h"
#include "engine/io/json_util.h"

namespace specula::tokenizer {

bool JsonView::has(std::string_view key) const {
  return value_->is_object() && value_->contains(key);
}

JsonView JsonView::at(std::string_view key) const {
  expect_object();
  auto it = value_->find(key);
  if (it == value_->end()) {
    fail("{}: missing field {}{}{}", *origin_, path_, path_.empty() ? "" : ".", key);
  }
  return JsonView(*it, *origin_, path_.empty() ? std::string(key) : path_ + "." + std::string(key));
}

std::optional<JsonView> JsonView::find(std::string_view key) const {
  expect_object();
  auto it = value_->find(key);
  if (it == value_->end() || it->is_null()) return std::nullopt;
  return JsonView(*it, *origin_, path_.empty() ? std::string(key) : path_ + "." + std::string(key));
}

JsonView JsonView::at(size_t index) const {
  expect_array();
  if (index >= value_->size()) fail_here(fmt::format("index {} out of range", index));
  return JsonView((*value_)[index], *origin_, fmt::format("{}[{}]", path_, index));
}

std::string JsonView::as_string() const {
  if (!value_->is_string())
    fail_here(fmt::format("expected a string, found {}", type_name(*value_)));
  return value_->get<std::string>();
}

int64_t JsonView::as_int() const {
  if (!value_->is_number_integer()) {
    fail_here(fmt::format("expected an integer, found {}", type_name(*value_)));
  }
  return value_->get<int64_t>();
}

bool JsonView::as_bool() const {
  if (!value_->is_boolean())
    fail_here(fmt::format("expected a boolean, found {}", type_name(*value_)));
  return value_->get<bool>();
}

double JsonView::as_number() const {
  if (!value_->is_number())
    fail_here(fmt::format("expected a number, found {}", type_name(*value_)));
  return value_->get<double>();
}

void JsonView::expect_object() const {
  if (!value_->is_object())
    fail_here(fmt::format("expected an object, found {}", type_name(*value_)));
}

void JsonView::expect_array() const {
  if (!value_->is_array())
    fail_here(fmt::format("expected an array, found {}", type_name(*value_)));
}

std::string JsonView::string_or(std::string_view key, std::string fallback) const {
  auto v = find(key);
  return v ? v->as_string() : fallback;
}

bool JsonView::bool_or(std::string_view key, bool fallback) const {
  auto v = find(key);
  return v ? v->as_bool() : fallback;
}

int64_t JsonView::int_or(std::string_view key, int64_t fallback) const {
  auto v = find(key);
  return v ? v->as_int() : fallback;
}

void JsonView::fail_here(std::string_view message) const {
  fail("{}: field {}: {}", *origin_, path_.empty() ? "<root>" : path_, message);
}

std::string JsonView::type_name(const nlohmann::json& v) {
  return io::json_type_name(v);
}

nlohmann::json parse_json(std::string_view text, const std::string& origin) {
  return io::parse_json_text(std::string(text), origin);
}

nlohmann::json read_json(const std::string& file) {
  return io::read_json_file(file);
}

}  // namespace specula::tokenizer
