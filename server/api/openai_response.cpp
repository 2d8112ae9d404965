// SPDX-License-Identifier: Apache-2.0
#include "server/api/openai_response.h"

#include <charconv>
#include <cmath>
#include <cstdlib>
#include <nlohmann/json.hpp>
#include <utility>

namespace specula::api {
namespace {

// ordered_json keeps OpenAI's key order (id, object, created, ...), which is
// what clients and people reading logs expect to see.
using ojson = nlohmann::ordered_json;

// Token text may end inside a UTF-8 sequence (a token is a byte piece), and
// JSON text must be valid UTF-8: invalid bytes become U+FFFD instead of making
// dump() throw. The raw bytes stay available in the `bytes` arrays.
std::string dump(const ojson& j) {
  return j.dump(-1, ' ', false, ojson::error_handler_t::replace);
}

std::string event(const ojson& j) {
  return "data: " + dump(j) + "\n\n";
}

ojson nullable(const std::string& s) {
  return s.empty() ? ojson(nullptr) : ojson(s);
}

// A float logprob as the double with the float's shortest decimal form, so
// -0.1f is written -0.1 and not -0.10000000149011612. A non-finite logprob
// (a token masked out by top-k/top-p) becomes -9999.0, as vLLM writes it:
// JSON has no -Infinity and nlohmann would write null.
double logprob_value(float x) {
  if (!std::isfinite(x)) return -9999.0;
  char buf[32];
  const auto res = std::to_chars(buf, buf + sizeof(buf) - 1, x);
  *res.ptr = '\0';
  return std::strtod(buf, nullptr);
}

ojson bytes_json(const TokenLogprob& t) {
  ojson a = ojson::array();
  for (uint8_t b : t.bytes) a.push_back(b);
  return a;
}

// Chat's logprobs object: {"content": [{token, logprob, bytes, top_logprobs}]}.
ojson chat_logprobs(const std::vector<TokenLogprob>& tokens) {
  ojson content = ojson::array();
  for (const TokenLogprob& t : tokens) {
    ojson top = ojson::array();
    for (const TokenLogprob& alt : t.top) {
      top.push_back({{"token", alt.token},
                     {"logprob", logprob_value(alt.logprob)},
                     {"bytes", bytes_json(alt)}});
    }
    content.push_back({{"token", t.token},
                       {"logprob", logprob_value(t.logprob)},
                       {"bytes", bytes_json(t)},
                       {"top_logprobs", std::move(top)}});
  }
  return ojson{{"content", std::move(content)}};
}

// Completions' (legacy) logprobs object: parallel arrays, top_logprobs one
// {token: logprob} object per position, text_offset the byte offset of each
// token from the start of the completion.
ojson completion_logprobs(const std::vector<TokenLogprob>& tokens, int64_t text_offset) {
  ojson out = {{"tokens", ojson::array()},
               {"token_logprobs", ojson::array()},
               {"top_logprobs", ojson::array()},
               {"text_offset", ojson::array()}};
  int64_t offset = text_offset;
  for (const TokenLogprob& t : tokens) {
    out["tokens"].push_back(t.token);
    out["token_logprobs"].push_back(logprob_value(t.logprob));
    ojson top = ojson::object();
    for (const TokenLogprob& alt : t.top) top[alt.token] = logprob_value(alt.logprob);
    out["top_logprobs"].push_back(std::move(top));
    out["text_offset"].push_back(offset);
    offset += static_cast<int64_t>(t.bytes.empty() ? t.token.size() : t.bytes.size());
  }
  return out;
}

ojson usage_json(const Usage& usage) {
  ojson u = {{"prompt_tokens", usage.prompt_tokens},
             {"completion_tokens", usage.completion_tokens},
             {"total_tokens", usage.prompt_tokens + usage.completion_tokens}};
  if (usage.speculative) {
    const SpeculativeUsage& s = *usage.speculative;
    u["speculative"] = {{"drafted", s.drafted},
                        {"accepted", s.accepted},
                        {"accepted_by_position", s.accepted_by_position},
                        {"tau", s.tau}};
  }
  return u;
}

ojson header(const std::string& id, const char* object, int64_t created, const std::string& model) {
  return {{"id", id}, {"object", object}, {"created", created}, {"model", model}};
}

}  // namespace

std::string chat_completion_body(const std::string& id, int64_t created, const std::string& model,
                                 const std::vector<Choice>& choices, const Usage& usage) {
  ojson body = header(id, "chat.completion", created, model);
  ojson out = ojson::array();
  for (const Choice& c : choices) {
    out.push_back({{"index", c.index},
                   {"message", {{"role", "assistant"}, {"content", c.text}}},
                   {"logprobs", c.logprobs ? chat_logprobs(*c.logprobs) : ojson(nullptr)},
                   {"finish_reason", nullable(c.finish_reason)}});
  }
  body["choices"] = std::move(out);
  body["usage"] = usage_json(usage);
  return dump(body);
}

std::string completion_body(const std::string& id, int64_t created, const std::string& model,
                            const std::vector<Choice>& choices, const Usage& usage) {
  ojson body = header(id, "text_completion", created, model);
  ojson out = ojson::array();
  for (const Choice& c : choices) {
    out.push_back({{"index", c.index},
                   {"text", c.text},
                   {"logprobs",
                    c.logprobs ? completion_logprobs(*c.logprobs, c.text_offset) : ojson(nullptr)},
                   {"finish_reason", nullable(c.finish_reason)}});
  }
  body["choices"] = std::move(out);
  body["usage"] = usage_json(usage);
  return dump(body);
}

std::string chat_role_event(const std::string& id, int64_t created, const std::string& model,
                            int index) {
  ojson body = header(id, "chat.completion.chunk", created, model);
  body["choices"] = ojson::array({ojson{{"index", index},
                                        {"delta", {{"role", "assistant"}, {"content", ""}}},
                                        {"logprobs", nullptr},
                                        {"finish_reason", nullptr}}});
  return event(body);
}

std::string chat_delta_event(const std::string& id, int64_t created, const std::string& model,
                             const Choice& delta) {
  ojson body = header(id, "chat.completion.chunk", created, model);
  // The final event may carry only the finish_reason: its delta is {}.
  ojson d = ojson::object();
  if (!delta.text.empty()) d["content"] = delta.text;
  body["choices"] = ojson::array(
      {ojson{{"index", delta.index},
             {"delta", std::move(d)},
             {"logprobs", delta.logprobs ? chat_logprobs(*delta.logprobs) : ojson(nullptr)},
             {"finish_reason", nullable(delta.finish_reason)}}});
  return event(body);
}

std::string completion_delta_event(const std::string& id, int64_t created, const std::string& model,
                                   const Choice& delta) {
  ojson body = header(id, "text_completion", created, model);
  body["choices"] = ojson::array(
      {ojson{{"index", delta.index},
             {"text", delta.text},
             {"logprobs", delta.logprobs ? completion_logprobs(*delta.logprobs, delta.text_offset)
                                         : ojson(nullptr)},
             {"finish_reason", nullable(delta.finish_reason)}}});
  return event(body);
}

std::string usage_event(const std::string& id, int64_t created, const std::string& model, bool chat,
                        const Usage& usage) {
  ojson body = header(id, chat ? "chat.completion.chunk" : "text_completion", created, model);
  body["choices"] = ojson::array();
  body["usage"] = usage_json(usage);
  return event(body);
}

std::string error_event(const std::string& message, const std::string& type) {
  return event(
      {{"error", {{"message", message}, {"type", type}, {"param", nullptr}, {"code", nullptr}}}});
}

std::string models_body(const std::vector<std::string>& model_ids, int64_t created) {
  ojson data = ojson::array();
  for (const std::string& id : model_ids) {
    data.push_back(
        {{"id", id}, {"object", "model"}, {"created", created}, {"owned_by", "specula"}});
  }
  return dump(ojson{{"object", "list"}, {"data", std::move(data)}});
}

}  // namespace specula::api
