// SPDX-License-Identifier: Apache-2.0
// The response builders: OpenAI's exact shapes (parsed back and checked key by
// key), the SSE framing, and text that is not valid UTF-8.
#include "server/api/openai_response.h"

#include <gtest/gtest.h>

#include <cmath>
#include <limits>
#include <nlohmann/json.hpp>
#include <set>
#include <string>

namespace specula::api {
namespace {

using json = nlohmann::json;

const std::string kReplacement = "\xEF\xBF\xBD";  // U+FFFD

std::set<std::string> keys(const json& j) {
  std::set<std::string> out;
  for (auto it = j.begin(); it != j.end(); ++it) out.insert(it.key());
  return out;
}

// The JSON of one SSE event, checking its framing: "data: " + compact JSON + "\n\n".
json event_json(const std::string& event) {
  EXPECT_EQ(event.rfind("data: ", 0), 0u) << event;
  EXPECT_GE(event.size(), 8u);
  EXPECT_EQ(event.substr(event.size() - 2), "\n\n");
  const std::string payload = event.substr(6, event.size() - 8);
  EXPECT_EQ(payload.find('\n'), std::string::npos) << "not compact: " << payload;
  return json::parse(payload);
}

TokenLogprob token(std::string text, float logprob, std::vector<TokenLogprob> top = {}) {
  TokenLogprob t;
  t.bytes.assign(text.begin(), text.end());
  t.token = std::move(text);
  t.logprob = logprob;
  t.top = std::move(top);
  return t;
}

Usage usage(bool speculative) {
  Usage u;
  u.prompt_tokens = 12;
  u.completion_tokens = 5;
  if (speculative) u.speculative = SpeculativeUsage{8, 6, {3, 2, 1}, 2.5};
  return u;
}

TEST(OpenaiResponse, ChatCompletionShape) {
  Choice c;
  c.text = "Hello \"world\"";
  c.finish_reason = "stop";
  c.logprobs = std::vector<TokenLogprob>{
      token("Hello", -0.1f, {token("Hello", -0.1f), token("Hi", -2.5f)}), token(" \"", -1.0f)};
  Choice d;
  d.index = 1;
  d.text = "x";
  d.finish_reason = "length";
  const json j =
      json::parse(chat_completion_body("chatcmpl-1", 1700000000, "gemma", {c, d}, usage(true)));

  EXPECT_EQ(keys(j),
            (std::set<std::string>{"id", "object", "created", "model", "choices", "usage"}));
  EXPECT_EQ(j["id"], "chatcmpl-1");
  EXPECT_EQ(j["object"], "chat.completion");
  EXPECT_EQ(j["created"], 1700000000);
  EXPECT_EQ(j["model"], "gemma");
  ASSERT_EQ(j["choices"].size(), 2u);
  const json& c0 = j["choices"][0];
  EXPECT_EQ(keys(c0), (std::set<std::string>{"index", "message", "logprobs", "finish_reason"}));
  EXPECT_EQ(c0["index"], 0);
  EXPECT_EQ(c0["message"], (json{{"role", "assistant"}, {"content", "Hello \"world\""}}));
  EXPECT_EQ(c0["finish_reason"], "stop");
  EXPECT_EQ(keys(c0["logprobs"]), (std::set<std::string>{"content"}));
  const json& lp = c0["logprobs"]["content"];
  ASSERT_EQ(lp.size(), 2u);
  EXPECT_EQ(keys(lp[0]), (std::set<std::string>{"token", "logprob", "bytes", "top_logprobs"}));
  EXPECT_EQ(lp[0]["token"], "Hello");
  // The float's shortest form: -0.1, not -0.10000000149011612.
  EXPECT_EQ(lp[0]["logprob"].get<double>(), -0.1);
  EXPECT_EQ(lp[0]["bytes"], (json{72, 101, 108, 108, 111}));
  ASSERT_EQ(lp[0]["top_logprobs"].size(), 2u);
  EXPECT_EQ(keys(lp[0]["top_logprobs"][1]), (std::set<std::string>{"token", "logprob", "bytes"}));
  EXPECT_EQ(lp[0]["top_logprobs"][1]["token"], "Hi");
  EXPECT_EQ(lp[0]["top_logprobs"][1]["logprob"].get<double>(), -2.5);
  EXPECT_EQ(lp[1]["top_logprobs"], json::array());

  const json& c1 = j["choices"][1];
  EXPECT_EQ(c1["index"], 1);
  EXPECT_TRUE(c1["logprobs"].is_null());
  EXPECT_EQ(c1["finish_reason"], "length");

  const json& u = j["usage"];
  EXPECT_EQ(keys(u), (std::set<std::string>{"prompt_tokens", "completion_tokens", "total_tokens",
                                            "speculative"}));
  EXPECT_EQ(u["prompt_tokens"], 12);
  EXPECT_EQ(u["completion_tokens"], 5);
  EXPECT_EQ(u["total_tokens"], 17);
  EXPECT_EQ(
      u["speculative"],
      (json{{"drafted", 8}, {"accepted", 6}, {"accepted_by_position", {3, 2, 1}}, {"tau", 2.5}}));
}

TEST(OpenaiResponse, KeysInOpenAiOrder) {
  const std::string body = chat_completion_body("id", 1, "m", {Choice{}}, usage(false));
  EXPECT_EQ(body.rfind(R"({"id":"id","object":"chat.completion","created":1,"model":"m",)", 0), 0u)
      << body;
  // Usage without speculation has no "speculative" key.
  EXPECT_FALSE(json::parse(body)["usage"].contains("speculative"));
}

TEST(OpenaiResponse, TextCompletionShape) {
  Choice c;
  c.text = "ab c";
  c.finish_reason = "length";
  c.logprobs = std::vector<TokenLogprob>{
      token("ab", -0.5f, {token("ab", -0.5f), token("a", -1.5f)}), token(" c", -0.25f)};
  const json j = json::parse(completion_body("cmpl-7", 5, "gemma", {c}, usage(false)));
  EXPECT_EQ(keys(j),
            (std::set<std::string>{"id", "object", "created", "model", "choices", "usage"}));
  EXPECT_EQ(j["object"], "text_completion");
  EXPECT_EQ(j["id"], "cmpl-7");
  const json& c0 = j["choices"][0];
  EXPECT_EQ(keys(c0), (std::set<std::string>{"index", "text", "logprobs", "finish_reason"}));
  EXPECT_EQ(c0["text"], "ab c");
  EXPECT_EQ(c0["finish_reason"], "length");
  const json& lp = c0["logprobs"];
  EXPECT_EQ(keys(lp),
            (std::set<std::string>{"tokens", "token_logprobs", "top_logprobs", "text_offset"}));
  EXPECT_EQ(lp["tokens"], (json{"ab", " c"}));
  EXPECT_EQ(lp["token_logprobs"], (json{-0.5, -0.25}));
  EXPECT_EQ(lp["top_logprobs"], (json{{{"ab", -0.5}, {"a", -1.5}}, json::object()}));
  EXPECT_EQ(lp["text_offset"], (json{0, 2}));
  EXPECT_EQ(j["usage"]["total_tokens"], 17);

  c.logprobs.reset();
  EXPECT_TRUE(json::parse(completion_body("cmpl-7", 5, "gemma", {c},
                                          usage(false)))["choices"][0]["logprobs"]
                  .is_null());
}

TEST(OpenaiResponse, ChatStreamEvents) {
  const json role = event_json(chat_role_event("chatcmpl-2", 9, "gemma", 1));
  EXPECT_EQ(keys(role), (std::set<std::string>{"id", "object", "created", "model", "choices"}));
  EXPECT_EQ(role["object"], "chat.completion.chunk");
  EXPECT_EQ(role["created"], 9);
  ASSERT_EQ(role["choices"].size(), 1u);
  EXPECT_EQ(role["choices"][0], (json{{"index", 1},
                                      {"delta", {{"role", "assistant"}, {"content", ""}}},
                                      {"logprobs", nullptr},
                                      {"finish_reason", nullptr}}));

  Choice delta;
  delta.text = "Hel";
  const json content = event_json(chat_delta_event("chatcmpl-2", 9, "gemma", delta));
  EXPECT_EQ(content["object"], "chat.completion.chunk");
  EXPECT_EQ(content["choices"][0], (json{{"index", 0},
                                         {"delta", {{"content", "Hel"}}},
                                         {"logprobs", nullptr},
                                         {"finish_reason", nullptr}}));

  delta.logprobs = std::vector<TokenLogprob>{token("Hel", -0.75f)};
  const json with_lp = event_json(chat_delta_event("chatcmpl-2", 9, "gemma", delta));
  const json& lp = with_lp["choices"][0]["logprobs"];
  EXPECT_EQ(keys(lp), (std::set<std::string>{"content"}));
  ASSERT_EQ(lp["content"].size(), 1u);
  EXPECT_EQ(lp["content"][0]["token"], "Hel");
  EXPECT_EQ(lp["content"][0]["logprob"].get<double>(), -0.75);

  // The last event: only the finish_reason, an empty delta.
  Choice last;
  last.finish_reason = "stop";
  const json fin = event_json(chat_delta_event("chatcmpl-2", 9, "gemma", last));
  EXPECT_EQ(fin["choices"][0]["delta"], json::object());
  EXPECT_EQ(fin["choices"][0]["finish_reason"], "stop");
}

TEST(OpenaiResponse, CompletionStreamEvents) {
  Choice delta;
  delta.index = 2;
  delta.text = " c";
  delta.text_offset = 2;
  delta.logprobs = std::vector<TokenLogprob>{token(" c", -0.5f)};
  const json e = event_json(completion_delta_event("cmpl-3", 4, "gemma", delta));
  EXPECT_EQ(keys(e), (std::set<std::string>{"id", "object", "created", "model", "choices"}));
  EXPECT_EQ(e["object"], "text_completion");
  const json& c = e["choices"][0];
  EXPECT_EQ(keys(c), (std::set<std::string>{"index", "text", "logprobs", "finish_reason"}));
  EXPECT_EQ(c["index"], 2);
  EXPECT_EQ(c["text"], " c");
  EXPECT_TRUE(c["finish_reason"].is_null());
  // Offsets continue from the bytes already streamed.
  EXPECT_EQ(c["logprobs"]["text_offset"], (json{2}));

  Choice last;
  last.finish_reason = "length";
  const json fin = event_json(completion_delta_event("cmpl-3", 4, "gemma", last));
  EXPECT_EQ(fin["choices"][0]["text"], "");
  EXPECT_EQ(fin["choices"][0]["finish_reason"], "length");
}

TEST(OpenaiResponse, UsageErrorAndDoneEvents) {
  const json chat = event_json(usage_event("chatcmpl-2", 9, "gemma", true, usage(true)));
  EXPECT_EQ(keys(chat),
            (std::set<std::string>{"id", "object", "created", "model", "choices", "usage"}));
  EXPECT_EQ(chat["object"], "chat.completion.chunk");
  EXPECT_EQ(chat["choices"], json::array());
  EXPECT_EQ(chat["usage"]["total_tokens"], 17);
  EXPECT_EQ(chat["usage"]["speculative"]["tau"], 2.5);
  const json text = event_json(usage_event("cmpl-2", 9, "gemma", false, usage(false)));
  EXPECT_EQ(text["object"], "text_completion");
  EXPECT_FALSE(text["usage"].contains("speculative"));

  const json error = event_json(error_event("the engine \"stopped\"", "server_error"));
  EXPECT_EQ(error, (json{{"error",
                          {{"message", "the engine \"stopped\""},
                           {"type", "server_error"},
                           {"param", nullptr},
                           {"code", nullptr}}}}));
  EXPECT_STREQ(kDoneEvent, "data: [DONE]\n\n");
}

TEST(OpenaiResponse, InvalidUtf8TokenTextNeverThrows) {
  // "é" is C3 A9: a token may hold only its first byte; "\xff" is never UTF-8.
  TokenLogprob partial = token("\xC3", -1.0f, {token("\xff", -2.0f)});
  Choice c;
  c.text = "ok \xC3";
  c.finish_reason = "stop";
  c.logprobs = std::vector<TokenLogprob>{partial};

  std::string body;
  ASSERT_NO_THROW(body = chat_completion_body("id", 1, "m\xfe", {c}, usage(false)));
  json j = json::parse(body);
  EXPECT_EQ(j["model"], "m" + kReplacement);
  EXPECT_EQ(j["choices"][0]["message"]["content"], "ok " + kReplacement);
  const json& t = j["choices"][0]["logprobs"]["content"][0];
  EXPECT_EQ(t["token"], kReplacement);
  EXPECT_EQ(t["bytes"], (json{0xC3}));  // the raw bytes survive
  EXPECT_EQ(t["top_logprobs"][0]["token"], kReplacement);
  EXPECT_EQ(t["top_logprobs"][0]["bytes"], (json{0xff}));

  ASSERT_NO_THROW(body = completion_body("id", 1, "m", {c}, usage(false)));
  j = json::parse(body);
  EXPECT_EQ(j["choices"][0]["logprobs"]["tokens"][0], kReplacement);
  EXPECT_TRUE(j["choices"][0]["logprobs"]["top_logprobs"][0].contains(kReplacement));

  ASSERT_NO_THROW(body = chat_delta_event("id", 1, "m", c));
  EXPECT_EQ(event_json(body)["choices"][0]["delta"]["content"], "ok " + kReplacement);
  ASSERT_NO_THROW(body = completion_delta_event("id", 1, "m", c));
  EXPECT_EQ(event_json(body)["choices"][0]["text"], "ok " + kReplacement);
  ASSERT_NO_THROW(body = error_event("bad \xff", "server_error"));
  EXPECT_EQ(event_json(body)["error"]["message"], "bad " + kReplacement);
  ASSERT_NO_THROW(body = models_body({"\xff"}, 0));
  EXPECT_EQ(json::parse(body)["data"][0]["id"], kReplacement);
}

TEST(OpenaiResponse, NonFiniteLogprobsAreNumbers) {
  Choice c;
  c.logprobs =
      std::vector<TokenLogprob>{token("a", -std::numeric_limits<float>::infinity(),
                                      {token("b", std::numeric_limits<float>::quiet_NaN())})};
  const json j = json::parse(chat_completion_body("id", 1, "m", {c}, usage(false)));
  const json& t = j["choices"][0]["logprobs"]["content"][0];
  EXPECT_EQ(t["logprob"].get<double>(), -9999.0);
  EXPECT_EQ(t["top_logprobs"][0]["logprob"].get<double>(), -9999.0);
  // An empty finish_reason (not finished) is null.
  EXPECT_TRUE(j["choices"][0]["finish_reason"].is_null());
}

TEST(OpenaiResponse, ModelsBody) {
  const json j = json::parse(models_body({"gemma-4-31b-it", "gemma-4-e2b-it"}, 1700000000));
  EXPECT_EQ(j, (json{{"object", "list"},
                     {"data",
                      {{{"id", "gemma-4-31b-it"},
                        {"object", "model"},
                        {"created", 1700000000},
                        {"owned_by", "specula"}},
                       {{"id", "gemma-4-e2b-it"},
                        {"object", "model"},
                        {"created", 1700000000},
                        {"owned_by", "specula"}}}}}));
  EXPECT_EQ(json::parse(models_body({}, 0))["data"], json::array());
}

}  // namespace
}  // namespace specula::api
