// SPDX-License-Identifier: Apache-2.0
#include "apps/cli/prompt_set.h"

#include <nlohmann/json.hpp>

#include <fstream>

#include "engine/chat/chat_format.h"
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

FormattedPromptSet read_formatted_prompt_set(const std::string& path,
                                             const std::string& format_name,
                                             std::optional<int> num_prompts) {
  FormattedPromptSet out{.set = {},
                         .format = parse_prompt_format(format_name),
                         .format_name = format_name,
                         .texts = {}};
  out.set = read_prompt_set(path);
  const auto total = static_cast<int64_t>(out.set.entries.size());
  if (num_prompts) {
    if (*num_prompts < 1 || *num_prompts > total) {
      fail("--num-prompts {}: {} holds {} prompt{}; give a count in [1, {}]", *num_prompts, path,
           total, total == 1 ? "" : "s", total);
    }
    out.set.entries.resize(static_cast<size_t>(*num_prompts));
  }
  for (const PromptEntry& e : out.set.entries)
    out.texts.push_back(prompt_text(e, out.format, out.set.path));
  return out;
}

std::vector<std::vector<int32_t>> tokenize_prompt_set(const FormattedPromptSet& prompts,
                                                      const Tokenizer* tokenizer, int64_t vocab,
                                                      const ChatOptions* chat) {
  const PromptSet& set = prompts.set;
  std::vector<std::vector<int32_t>> out;
  out.reserve(set.entries.size());
  for (size_t i = 0; i < set.entries.size(); ++i) {
    const PromptEntry& e = set.entries[i];
    if (!e.is_text) {
      for (int32_t id : e.ids) {
        if (id < 0 || id >= vocab)
          fail("--prompt-file {}:{}: token id {} is outside the model's vocabulary [0, {})",
               set.path, e.line, id, vocab);
      }
      out.push_back(e.ids);
      continue;
    }
    SPECULA_CHECK(tokenizer != nullptr, "a text prompt needs a tokenizer");
    if (prompts.format == PromptFormat::kChat) {
      SPECULA_CHECK(chat != nullptr, "--prompt-format chat needs the chat options");
      // The rendered conversation starts with the BOS text itself.
      const std::string rendered =
          render_chat({ChatMessage::text("user", prompts.texts[i])}, *chat);
      out.push_back(tokenizer->encode(rendered, /*add_special_tokens=*/false));
    } else {
      out.push_back(tokenizer->encode(prompts.texts[i], /*add_special_tokens=*/true));
    }
  }
  return out;
}

void check_prompts_fit(const FormattedPromptSet& prompts,
                       const std::vector<std::vector<int32_t>>& ids, int64_t new_tokens,
                       const std::string& new_tokens_flag, int64_t context) {
  SPECULA_CHECK(ids.size() == prompts.set.entries.size(), "one id list per prompt");
  for (size_t i = 0; i < ids.size(); ++i) {
    const auto len = static_cast<int64_t>(ids[i].size());
    if (len + new_tokens > context) {
      fail(
          "--prompt-file {}:{}: the prompt is {} tokens (--prompt-format {}); with {} {} that "
          "is {} tokens, past the context of {} tokens (--ctx-size)",
          prompts.set.path, prompts.set.entries[i].line, len, prompts.format_name, new_tokens_flag,
          new_tokens, len + new_tokens, context);
    }
  }
}

}  // namespace specula::cli
