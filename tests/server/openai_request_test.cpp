// SPDX-License-Identifier: Apache-2.0
// parse_request: every field's accepted forms, and every rejection naming the
// right `param` with status 400.
#include "server/api/openai_request.h"

#include <gtest/gtest.h>

#include <nlohmann/json.hpp>
#include <string>

namespace specula::api {
namespace {

using json = nlohmann::json;

constexpr const char* kChatBase = R"({"messages":[{"role":"user","content":"hi"}])";
constexpr const char* kCompletionBase = R"({"prompt":"Once")";

// A chat body: the one-message base plus `extra` fields ("" for none).
std::string chat(const std::string& extra = "") {
  return std::string(kChatBase) + (extra.empty() ? "" : "," + extra) + "}";
}
std::string completion(const std::string& extra = "") {
  return std::string(kCompletionBase) + (extra.empty() ? "" : "," + extra) + "}";
}

CompletionRequest ok(const std::string& body, Endpoint endpoint = Endpoint::kChat,
                     const RequestLimits& limits = {}) {
  auto r = parse_request(body, endpoint, limits);
  if (auto* e = std::get_if<ApiError>(&r)) {
    ADD_FAILURE() << "rejected: " << body << "\n  " << e->param << ": " << e->message;
    return {};
  }
  return std::get<CompletionRequest>(std::move(r));
}

ApiError err(const std::string& body, Endpoint endpoint = Endpoint::kChat,
             const RequestLimits& limits = {}) {
  auto r = parse_request(body, endpoint, limits);
  if (!std::holds_alternative<ApiError>(r)) {
    ADD_FAILURE() << "accepted: " << body;
    return {};
  }
  ApiError e = std::get<ApiError>(std::move(r));
  EXPECT_EQ(e.status, 400) << body;
  EXPECT_EQ(e.type, "invalid_request_error") << body;
  EXPECT_FALSE(e.message.empty()) << body;
  return e;
}

// The param of the rejection of `body`, checking that the message names it.
std::string param_of(const std::string& body, Endpoint endpoint = Endpoint::kChat,
                     const RequestLimits& limits = {}) {
  const ApiError e = err(body, endpoint, limits);
  if (!e.param.empty()) {
    EXPECT_NE(e.message.find(e.param), std::string::npos) << e.message;
  }
  return e.param;
}

TEST(OpenaiRequest, MinimalChatHasDefaults) {
  const CompletionRequest r = ok(chat());
  EXPECT_EQ(r.endpoint, Endpoint::kChat);
  ASSERT_EQ(r.messages.size(), 1u);
  EXPECT_EQ(r.messages[0].role, "user");
  EXPECT_EQ(r.messages[0].content, "hi");
  EXPECT_EQ(r.model, "");
  EXPECT_FALSE(r.enable_thinking);
  EXPECT_EQ(r.n, 1);
  EXPECT_FALSE(r.stream);
  EXPECT_FALSE(r.include_usage);
  EXPECT_EQ(r.params.temperature, 1.0f);
  EXPECT_EQ(r.params.top_p, 1.0f);
  EXPECT_EQ(r.params.top_k, 0);
  EXPECT_EQ(r.params.max_tokens, 0);
  EXPECT_TRUE(r.params.stop.empty());
  EXPECT_FALSE(r.has_seed);
  EXPECT_FALSE(r.ignore_eos);
  EXPECT_EQ(r.logprobs, -1);
  EXPECT_TRUE(r.speculative);
  EXPECT_EQ(r.draft_tokens, -1);
}

TEST(OpenaiRequest, EveryFieldAccepted) {
  const CompletionRequest r = ok(chat(R"(
    "model":"gemma-4-31b-it","n":3,"stream":true,"stream_options":{"include_usage":true},
    "stop":["\n\n","END"],"stop_token_ids":[1,106],"max_tokens":50,"temperature":0.7,
    "top_p":0.9,"top_k":40,"min_p":0.05,"repetition_penalty":1.1,"presence_penalty":-0.5,
    "frequency_penalty":1.5,"seed":-1,"ignore_eos":true,"user":"u1","logprobs":true,
    "top_logprobs":5,"chat_template_kwargs":{"enable_thinking":true,"other":1},
    "speculative":{"enabled":false,"draft_tokens":4},"unknown_field":{"x":[1]})"));
  EXPECT_EQ(r.model, "gemma-4-31b-it");
  EXPECT_EQ(r.n, 3);
  EXPECT_TRUE(r.stream);
  EXPECT_TRUE(r.include_usage);
  EXPECT_EQ(r.params.stop, (std::vector<std::string>{"\n\n", "END"}));
  EXPECT_EQ(r.params.stop_token_ids, (std::vector<int32_t>{1, 106}));
  EXPECT_EQ(r.params.max_tokens, 50);
  EXPECT_FLOAT_EQ(r.params.temperature, 0.7f);
  EXPECT_FLOAT_EQ(r.params.top_p, 0.9f);
  EXPECT_EQ(r.params.top_k, 40);
  EXPECT_FLOAT_EQ(r.params.min_p, 0.05f);
  EXPECT_FLOAT_EQ(r.params.repetition_penalty, 1.1f);
  EXPECT_FLOAT_EQ(r.params.presence_penalty, -0.5f);
  EXPECT_FLOAT_EQ(r.params.frequency_penalty, 1.5f);
  EXPECT_TRUE(r.has_seed);
  EXPECT_EQ(r.params.seed, UINT64_MAX);  // -1 as uint64
  EXPECT_TRUE(r.ignore_eos);
  EXPECT_EQ(r.user, "u1");
  EXPECT_EQ(r.logprobs, 5);
  EXPECT_TRUE(r.enable_thinking);
  EXPECT_FALSE(r.speculative);
  EXPECT_EQ(r.draft_tokens, 4);
}

TEST(OpenaiRequest, NullMeansAbsent) {
  const CompletionRequest r = ok(chat(R"(
    "model":null,"n":null,"stream":null,"stop":null,"stop_token_ids":null,"max_tokens":null,
    "temperature":null,"top_p":null,"top_k":null,"min_p":null,"repetition_penalty":null,
    "presence_penalty":null,"frequency_penalty":null,"seed":null,"ignore_eos":null,"user":null,
    "logprobs":null,"top_logprobs":null,"chat_template_kwargs":null,"speculative":null,
    "stream_options":null)"));
  EXPECT_EQ(r.n, 1);
  EXPECT_EQ(r.params.temperature, 1.0f);
  EXPECT_FALSE(r.has_seed);
  EXPECT_EQ(r.logprobs, -1);
  EXPECT_TRUE(r.speculative);
}

TEST(OpenaiRequest, BodyMustBeAJsonObject) {
  for (const char* body : {"", "{", "not json", "{\"messages\": [}", "{} trailing"}) {
    const ApiError e = err(body);
    EXPECT_NE(e.message.find("not valid JSON"), std::string::npos) << e.message;
    EXPECT_EQ(e.message.find("[json.exception"), std::string::npos) << e.message;
    EXPECT_EQ(e.param, "");
  }
  for (const char* body : {"[]", "3", "\"x\"", "null", "true"}) {
    const ApiError e = err(body);
    EXPECT_NE(e.message.find("must be a JSON object"), std::string::npos) << e.message;
  }
}

TEST(OpenaiRequest, InvalidUtf8IsRejected) {
  // A raw 0xff byte inside a string, a truncated sequence, an overlong
  // encoding and an unpaired surrogate escape.
  for (std::string bad : {std::string("\xff"), std::string("\xe2\x82"), std::string("\xc0\xaf"),
                          std::string("\\ud800")}) {
    const std::string body = chat().insert(chat().find("hi") + 2, bad);
    const ApiError e = err(body);
    EXPECT_NE(e.message.find("not valid JSON"), std::string::npos) << e.message;
    // The error body itself is valid JSON (the bad bytes quoted in the
    // parser's message are replaced).
    EXPECT_TRUE(json::accept(error_body(e))) << error_body(e);
    EXPECT_EQ(err(completion().insert(12, bad), Endpoint::kCompletions).param, "");
  }
}

TEST(OpenaiRequest, Messages) {
  EXPECT_EQ(param_of("{}"), "messages");
  EXPECT_EQ(param_of(R"({"messages":null})"), "messages");
  EXPECT_EQ(param_of(R"({"messages":[]})"), "messages");
  EXPECT_EQ(param_of(R"({"messages":"hi"})"), "messages");
  EXPECT_EQ(param_of(R"({"messages":[{"role":"user","content":"a"},7]})"), "messages[1]");
  EXPECT_EQ(param_of(R"({"messages":[{"content":"a"}]})"), "messages[0].role");
  EXPECT_EQ(param_of(R"({"messages":[{"role":3,"content":"a"}]})"), "messages[0].role");
  EXPECT_EQ(param_of(R"({"messages":[{"role":"user","content":"a"},{"role":"user","content":5}]})"),
            "messages[1].content");
  // What only chat_messages_from_json checks: the role's value, tool calls, parts.
  EXPECT_EQ(err(R"({"messages":[{"role":"tool","content":"a"}]})").param, "messages");
  EXPECT_EQ(err(R"({"messages":[{"role":"user","content":[{"type":"image_url"}]}]})").param,
            "messages");
  EXPECT_EQ(err(R"({"messages":[{"role":"user","content":[{"text":"a"}]}]})").param, "messages");

  const CompletionRequest r = ok(R"({"messages":[
      {"role":"system","content":"be brief"},
      {"role":"user","content":[{"type":"text","text":"a"},{"type":"text","text":"b"}]},
      {"role":"assistant","content":null,"reasoning_content":"hmm"}]})");
  ASSERT_EQ(r.messages.size(), 3u);
  EXPECT_TRUE(r.messages[1].has_parts);
  ASSERT_EQ(r.messages[1].parts.size(), 2u);
  EXPECT_EQ(r.messages[1].parts[1].text, "b");
  EXPECT_EQ(r.messages[2].reasoning, "hmm");
}

TEST(OpenaiRequest, ChatTemplateKwargs) {
  EXPECT_FALSE(ok(chat(R"("chat_template_kwargs":{})")).enable_thinking);
  EXPECT_FALSE(ok(chat(R"("chat_template_kwargs":{"enable_thinking":false})")).enable_thinking);
  EXPECT_EQ(param_of(chat(R"("chat_template_kwargs":true)")), "chat_template_kwargs");
  EXPECT_EQ(param_of(chat(R"("chat_template_kwargs":{"enable_thinking":"yes"})")),
            "chat_template_kwargs.enable_thinking");
}

TEST(OpenaiRequest, CompletionPrompt) {
  const Endpoint kC = Endpoint::kCompletions;
  CompletionRequest r = ok(R"({"prompt":"Once upon"})", kC);
  EXPECT_EQ(r.endpoint, kC);
  EXPECT_EQ(r.prompt, "Once upon");
  EXPECT_FALSE(r.prompt_is_ids);
  EXPECT_TRUE(r.messages.empty());

  r = ok(R"({"prompt":[2, 818, 0]})", kC);
  EXPECT_TRUE(r.prompt_is_ids);
  EXPECT_EQ(r.prompt_ids, (std::vector<int32_t>{2, 818, 0}));

  r = ok(R"({"prompt":["only one"]})", kC);
  EXPECT_EQ(r.prompt, "only one");
  EXPECT_FALSE(r.prompt_is_ids);
  r = ok(R"({"prompt":[[5, 6]]})", kC);
  EXPECT_EQ(r.prompt_ids, (std::vector<int32_t>{5, 6}));

  EXPECT_EQ(param_of("{}", kC), "prompt");
  EXPECT_EQ(param_of(R"({"prompt":null})", kC), "prompt");
  EXPECT_EQ(param_of(R"({"prompt":""})", kC), "prompt");
  EXPECT_EQ(param_of(R"({"prompt":[]})", kC), "prompt");
  EXPECT_EQ(param_of(R"({"prompt":5})", kC), "prompt");
  EXPECT_EQ(param_of(R"({"prompt":{"a":1}})", kC), "prompt");
  EXPECT_EQ(param_of(R"({"prompt":[1,-2]})", kC), "prompt[1]");
  EXPECT_EQ(param_of(R"({"prompt":[1,2.5]})", kC), "prompt[1]");
  EXPECT_EQ(param_of(R"({"prompt":[1,"a"]})", kC), "prompt[1]");
  EXPECT_EQ(param_of(R"({"prompt":[1,4294967296]})", kC), "prompt[1]");
  EXPECT_EQ(param_of(R"({"prompt":[""]})", kC), "prompt[0]");
  EXPECT_EQ(param_of(R"({"prompt":[[]]})", kC), "prompt[0]");
  EXPECT_EQ(param_of(R"({"prompt":[["a"]]})", kC), "prompt[0]");

  const ApiError many = err(R"({"prompt":["a","b"]})", kC);
  EXPECT_EQ(many.param, "prompt");
  EXPECT_NE(many.message.find("only one prompt per request"), std::string::npos);
  EXPECT_EQ(err(R"({"prompt":[[1],[2]]})", kC).param, "prompt");

  // A chat body is not a completion body, and the other way round.
  EXPECT_EQ(param_of(chat(), kC), "prompt");
  EXPECT_EQ(param_of(completion()), "messages");
}

TEST(OpenaiRequest, N) {
  EXPECT_EQ(ok(chat(R"("n":8)")).n, 8);
  EXPECT_EQ(ok(chat(R"("n":2.0)")).n, 2);  // an integral float, as pydantic accepts
  for (const char* v :
       {"0", "-1", "9", "2.5", "\"2\"", "true", "[1]", "1e30", "18446744073709551615"}) {
    EXPECT_EQ(param_of(chat(std::string("\"n\":") + v)), "n") << v;
  }
  RequestLimits limits;
  limits.max_n = 2;
  const ApiError e = err(chat(R"("n":3)"), Endpoint::kChat, limits);
  EXPECT_EQ(e.param, "n");
  EXPECT_NE(e.message.find('3'), std::string::npos);
}

TEST(OpenaiRequest, StreamAndStreamOptions) {
  EXPECT_TRUE(ok(chat(R"("stream":true)")).stream);
  EXPECT_FALSE(ok(chat(R"("stream":true,"stream_options":{})")).include_usage);
  EXPECT_FALSE(ok(chat(R"("stream":true,"stream_options":{"include_usage":false})")).include_usage);
  EXPECT_EQ(param_of(chat(R"("stream":1)")), "stream");
  EXPECT_EQ(param_of(chat(R"("stream":"true")")), "stream");
  EXPECT_EQ(param_of(chat(R"("stream":true,"stream_options":[])")), "stream_options");
  EXPECT_EQ(param_of(chat(R"("stream":true,"stream_options":{"include_usage":"yes"})")),
            "stream_options.include_usage");
  // As OpenAI: stream_options without a stream is an error.
  EXPECT_EQ(param_of(chat(R"("stream_options":{"include_usage":true})")), "stream_options");
  EXPECT_EQ(param_of(chat(R"("stream":false,"stream_options":{"include_usage":true})")),
            "stream_options");
  EXPECT_TRUE(ok(completion(R"("stream":true,"stream_options":{"include_usage":true})"),
                 Endpoint::kCompletions)
                  .include_usage);
}

TEST(OpenaiRequest, Stop) {
  EXPECT_EQ(ok(chat(R"("stop":"END")")).params.stop, (std::vector<std::string>{"END"}));
  EXPECT_TRUE(ok(chat(R"("stop":[])")).params.stop.empty());
  EXPECT_EQ(param_of(chat(R"("stop":"")")), "stop");
  EXPECT_EQ(param_of(chat(R"("stop":5)")), "stop");
  EXPECT_EQ(param_of(chat(R"("stop":{"a":"b"})")), "stop");
  EXPECT_EQ(param_of(chat(R"("stop":["a",3])")), "stop[1]");
  EXPECT_EQ(param_of(chat(R"("stop":["a",""])")), "stop[1]");
  RequestLimits limits;
  limits.max_stop = 2;
  EXPECT_EQ(ok(chat(R"("stop":["a","b"])"), Endpoint::kChat, limits).params.stop.size(), 2u);
  EXPECT_EQ(param_of(chat(R"("stop":["a","b","c"])"), Endpoint::kChat, limits), "stop");
  // The default limit is 16 (OpenAI's is 4; vLLM sets none).
  EXPECT_EQ(param_of(chat(R"("stop":["1","2","3","4","5","6","7","8","9","10","11","12","13",
                                    "14","15","16","17"])")),
            "stop");
}

TEST(OpenaiRequest, StopTokenIds) {
  EXPECT_TRUE(ok(chat(R"("stop_token_ids":[])")).params.stop_token_ids.empty());
  EXPECT_EQ(param_of(chat(R"("stop_token_ids":1)")), "stop_token_ids");
  EXPECT_EQ(param_of(chat(R"("stop_token_ids":[1,-1])")), "stop_token_ids[1]");
  EXPECT_EQ(param_of(chat(R"("stop_token_ids":["1"])")), "stop_token_ids[0]");
}

TEST(OpenaiRequest, MaxTokens) {
  EXPECT_EQ(ok(chat(R"("max_tokens":1)")).params.max_tokens, 1);
  EXPECT_EQ(ok(chat(R"("max_completion_tokens":7)")).params.max_tokens, 7);
  // max_completion_tokens wins over max_tokens, whatever the order.
  EXPECT_EQ(ok(chat(R"("max_completion_tokens":7,"max_tokens":9)")).params.max_tokens, 7);
  EXPECT_EQ(ok(chat(R"("max_tokens":9,"max_completion_tokens":7)")).params.max_tokens, 7);
  EXPECT_EQ(param_of(chat(R"("max_tokens":0)")), "max_tokens");
  EXPECT_EQ(param_of(chat(R"("max_tokens":-3)")), "max_tokens");
  EXPECT_EQ(param_of(chat(R"("max_tokens":"10")")), "max_tokens");
  EXPECT_EQ(param_of(chat(R"("max_tokens":3000000000)")), "max_tokens");
  EXPECT_EQ(param_of(chat(R"("max_completion_tokens":0)")), "max_completion_tokens");
  EXPECT_EQ(param_of(chat(R"("max_completion_tokens":1.5)")), "max_completion_tokens");

  RequestLimits limits;
  limits.max_tokens = 100;
  limits.default_max_tokens = 64;
  EXPECT_EQ(ok(chat(), Endpoint::kChat, limits).params.max_tokens, 64);
  EXPECT_EQ(ok(chat(R"("max_tokens":100)"), Endpoint::kChat, limits).params.max_tokens, 100);
  EXPECT_EQ(param_of(chat(R"("max_tokens":101)"), Endpoint::kChat, limits), "max_tokens");
  EXPECT_EQ(param_of(chat(R"("max_completion_tokens":101)"), Endpoint::kChat, limits),
            "max_completion_tokens");

  const Endpoint kC = Endpoint::kCompletions;
  EXPECT_EQ(ok(completion(R"("max_tokens":5)"), kC).params.max_tokens, 5);
  // max_completion_tokens is chat's: a completion request ignores it.
  EXPECT_EQ(ok(completion(R"("max_completion_tokens":5)"), kC).params.max_tokens, 0);
}

// Each (field, accepted values, rejected values): the rejections name the field.
struct RangeCase {
  const char* field;
  std::vector<const char*> good;
  std::vector<const char*> bad;
};

TEST(OpenaiRequest, SamplingRanges) {
  const std::vector<RangeCase> cases = {
      {"temperature", {"0", "0.0", "1", "2", "1.5"}, {"-0.1", "2.01", "\"1\"", "true", "1e300"}},
      {"top_p", {"1", "0.01", "1e-9"}, {"0", "-1", "1.01", "\"0.5\""}},
      {"top_k", {"-1", "0", "1", "50"}, {"-2", "1.5", "\"5\"", "4294967296"}},
      {"min_p", {"0", "1", "0.5"}, {"-0.01", "1.01", "[]"}},
      {"repetition_penalty", {"1", "0.5", "10", "100"}, {"0", "-1", "1e39", "\"1\""}},
      {"presence_penalty", {"-2", "2", "0"}, {"-2.01", "2.01", "{}"}},
      {"frequency_penalty", {"-2", "2", "0.3"}, {"-3", "3", "\"x\""}},
      {"seed",
       {"0", "-9223372036854775808", "9223372036854775807", "42"},
       {"9223372036854775808", "1.5", "\"42\""}},
      {"ignore_eos", {"true", "false"}, {"1", "\"true\""}},
      {"user", {"\"\"", "\"abc\""}, {"1", "[]"}},
      {"model", {"\"m\""}, {"1", "{}"}},
  };
  for (const RangeCase& c : cases) {
    for (const char* v : c.good) {
      ok(chat(std::string("\"") + c.field + "\":" + v));
      ok(completion(std::string("\"") + c.field + "\":" + v), Endpoint::kCompletions);
    }
    for (const char* v : c.bad) {
      const std::string body = chat(std::string("\"") + c.field + "\":" + v);
      auto r = parse_request(body, Endpoint::kChat, {});
      ASSERT_TRUE(std::holds_alternative<ApiError>(r)) << body;
      const ApiError& e = std::get<ApiError>(r);
      EXPECT_EQ(e.param, c.field) << body << "\n" << e.message;
      EXPECT_NE(e.message.find(c.field), std::string::npos) << e.message;
    }
  }
  const CompletionRequest r = ok(chat(R"("seed":9223372036854775807,"temperature":0)"));
  EXPECT_EQ(r.params.seed, 9223372036854775807ull);
  EXPECT_TRUE(r.params.greedy());
  EXPECT_EQ(ok(chat(R"("seed":-9223372036854775808)")).params.seed, 1ull << 63);
}

TEST(OpenaiRequest, MessagesNameTheValueAndTruncateIt) {
  const ApiError e = err(chat(R"("temperature":"warm")"));
  EXPECT_NE(e.message.find("'temperature'"), std::string::npos) << e.message;
  EXPECT_NE(e.message.find("\"warm\""), std::string::npos) << e.message;

  const std::string long_value(10000, 'x');
  const ApiError l = err(chat("\"user\":[\"" + long_value + "\"]"));
  EXPECT_EQ(l.param, "user");
  EXPECT_LT(l.message.size(), 200u) << l.message;
  EXPECT_NE(l.message.find("..."), std::string::npos) << l.message;

  // A deeply nested value is described without walking it all.
  const std::string deep = std::string(100000, '[') + std::string(100000, ']');
  const ApiError d = err(chat("\"temperature\":" + deep));
  EXPECT_EQ(d.param, "temperature");
  EXPECT_LT(d.message.size(), 300u);
}

TEST(OpenaiRequest, ChatLogprobs) {
  EXPECT_EQ(ok(chat(R"("logprobs":false)")).logprobs, -1);
  EXPECT_EQ(ok(chat(R"("logprobs":true)")).logprobs, 0);
  EXPECT_EQ(ok(chat(R"("logprobs":true,"top_logprobs":0)")).logprobs, 0);
  EXPECT_EQ(ok(chat(R"("logprobs":true,"top_logprobs":20)")).logprobs, 20);
  EXPECT_EQ(param_of(chat(R"("logprobs":1)")), "logprobs");
  EXPECT_EQ(param_of(chat(R"("logprobs":true,"top_logprobs":21)")), "top_logprobs");
  EXPECT_EQ(param_of(chat(R"("logprobs":true,"top_logprobs":-1)")), "top_logprobs");
  EXPECT_EQ(param_of(chat(R"("logprobs":true,"top_logprobs":"3")")), "top_logprobs");
  EXPECT_EQ(param_of(chat(R"("top_logprobs":3)")), "top_logprobs");
  EXPECT_EQ(param_of(chat(R"("logprobs":false,"top_logprobs":3)")), "top_logprobs");
  RequestLimits limits;
  limits.max_logprobs = 5;
  EXPECT_EQ(param_of(chat(R"("logprobs":true,"top_logprobs":6)"), Endpoint::kChat, limits),
            "top_logprobs");
}

TEST(OpenaiRequest, CompletionLogprobs) {
  const Endpoint kC = Endpoint::kCompletions;
  EXPECT_EQ(ok(completion(), kC).logprobs, -1);
  EXPECT_EQ(ok(completion(R"("logprobs":null)"), kC).logprobs, -1);
  EXPECT_EQ(ok(completion(R"("logprobs":0)"), kC).logprobs, 0);
  EXPECT_EQ(ok(completion(R"("logprobs":5)"), kC).logprobs, 5);
  EXPECT_EQ(param_of(completion(R"("logprobs":true)"), kC), "logprobs");
  EXPECT_EQ(param_of(completion(R"("logprobs":21)"), kC), "logprobs");
  EXPECT_EQ(param_of(completion(R"("logprobs":-1)"), kC), "logprobs");
}

TEST(OpenaiRequest, Speculative) {
  EXPECT_TRUE(ok(chat(R"("speculative":{})")).speculative);
  EXPECT_TRUE(ok(chat(R"("speculative":{"enabled":true})")).speculative);
  EXPECT_EQ(ok(chat(R"("speculative":{"draft_tokens":1})")).draft_tokens, 1);
  EXPECT_EQ(param_of(chat(R"("speculative":true)")), "speculative");
  EXPECT_EQ(param_of(chat(R"("speculative":{"enabled":"no"})")), "speculative.enabled");
  EXPECT_EQ(param_of(chat(R"("speculative":{"draft_tokens":0})")), "speculative.draft_tokens");
  EXPECT_EQ(param_of(chat(R"("speculative":{"draft_tokens":"4"})")), "speculative.draft_tokens");
}

TEST(OpenaiRequest, ErrorBody) {
  ApiError e;
  e.message = "bad \"quote\" \\ and \n newline and \xff byte";
  e.param = "messages[0].content";
  const json j = json::parse(error_body(e));
  ASSERT_TRUE(j.contains("error"));
  const json& inner = j["error"];
  EXPECT_EQ(inner.size(), 4u);
  EXPECT_EQ(inner["message"], "bad \"quote\" \\ and \n newline and \xEF\xBF\xBD byte");
  EXPECT_EQ(inner["type"], "invalid_request_error");
  EXPECT_EQ(inner["param"], "messages[0].content");
  EXPECT_TRUE(inner["code"].is_null());

  ApiError bare;
  bare.status = 404;
  bare.message = "no such model";
  bare.type = "not_found_error";
  bare.code = "model_not_found";
  const json b = json::parse(error_body(bare));
  EXPECT_TRUE(b["error"]["param"].is_null());
  EXPECT_EQ(b["error"]["code"], "model_not_found");
  EXPECT_EQ(b["error"]["type"], "not_found_error");
}

}  // namespace
}  // namespace specula::api
