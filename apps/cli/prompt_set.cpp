// SPDX-License-Identifier: Apache-2.0
#include "apps/cli/prompt_set.h"

#include <nlohmann/json.hpp>

#include <fstream>

#include "engine/core/error.h"

namespace specula::cli {

bool PromptSet::needs_tokenizer() const {
  for (const PromptEntry& e : entries)
    if (e.is_text) return true;
  return false;
}

PromptSet read_prompt_set(const std::string& path, const std::string& flag) {
  std::ifstream in(path);
  if (!in) fail("{} {}: cannot open the file", flag, path);
  PromptSet set{.path = path, .entries = {}};
  std::string line;
  for (int n = 1; std::getline(in, line); ++n) {
    if (line.find_first_not_of(" \t\r") == std::string::npos) continue;
    const nlohmann::json j = nlohmann::json::parse(line, nullptr, /*allow_exceptions=*/false);
    if (j.is_discarded() || !j.is_object()) fail("{} {}:{}: not a JSON object", flag, path, n);
    PromptEntry e;
    e.line = n;
    if (const auto t = j.find("turns"); t != j.end()) {
      if (!t->is_array() || t->empty() || !(*t)[0].is_string() ||
          (*t)[0].get<std::string>().empty()) {
        fail("{} {}:{}: \"turns\" must be a list whose first item is a non-empty string", flag,
             path, n);
      }
      e.text = (*t)[0].get<std::string>();
      e.is_text = true;
    } else if (const auto ids = j.find("ids"); ids != j.end()) {
      if (!ids->is_array() || ids->empty())
        fail("{} {}:{}: \"ids\" must be a non-empty list of token ids", flag, path, n);
      for (const nlohmann::json& v : *ids) {
        if (!v.is_number_integer())
          fail("{} {}:{}: \"ids\" holds {}, not a token id", flag, path, n, v.dump());
        e.ids.push_back(v.get<int32_t>());
      }
    } else {
      fail(
          "{} {}:{}: expected {{\"turns\": [\"prompt\", ...]}} (DeepSpec's layout) or "
          "{{\"ids\": [token ids]}}",
          flag, path, n);
    }
    set.entries.push_back(std::move(e));
  }
  if (set.entries.empty()) fail("{} {}: no prompts in the file", flag, path);
  return set;
}

std::vector<std::vector<int32_t>> prompt_ids(const PromptSet& set, const Tokenizer* tokenizer,
                                             int64_t vocab) {
  std::vector<std::vector<int32_t>> out;
  out.reserve(set.entries.size());
  for (size_t i = 0; i < set.entries.size(); ++i) {
    const PromptEntry& e = set.entries[i];
    if (e.is_text) {
      SPECULA_CHECK(tokenizer != nullptr, "a text prompt needs a tokenizer");
      out.push_back(tokenizer->encode(e.text, /*add_special_tokens=*/true));
      continue;
    }
    for (int32_t id : e.ids) {
      if (id < 0 || id >= vocab)
        fail("{}:{}: token id {} is outside the model's vocabulary [0, {})", set.path, e.line, id,
             vocab);
    }
    out.push_back(e.ids);
  }
  return out;
}

}  // namespace specula::cli
