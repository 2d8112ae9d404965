// SPDX-License-Identifier: Apache-2.0
#include "server/api/openai_request.h"

#include <fmt/format.h>

#include <cmath>
#include <exception>
#include <limits>
#include <nlohmann/json.hpp>
#include <utility>

#include "engine/core/error.h"

namespace specula::api {
namespace {

using json = nlohmann::json;

// Thrown inside the parser and caught in parse_request, so that each check is
// one line and no error can be forgotten on the way out.
struct Rejection {
  ApiError error;
};

[[noreturn]] void reject(std::string param, std::string message) {
  ApiError e;
  e.param = std::move(param);
  e.message = std::move(message);
  throw Rejection{std::move(e)};
}

// Every dump here replaces invalid UTF-8 rather than throwing: an error
// message must never become a second error.
std::string dump_replacing(const json& v) {
  return v.dump(-1, ' ', false, json::error_handler_t::replace);
}

constexpr size_t kValueBudget = 64;  // characters of an offending value shown in a message

// Appends a bounded rendering of `v` to `out`. Containers are walked by hand
// (not dumped whole) because a value may be huge or nested thousands deep: the
// budget bounds both the output and the recursion (each level adds a bracket).
void describe_into(const json& v, std::string& out) {
  if (out.size() >= kValueBudget) return;
  if (v.is_string()) {
    const std::string& s = v.get_ref<const std::string&>();
    const size_t room = kValueBudget - out.size();
    if (s.size() <= room) {
      out += dump_replacing(v);
    } else {
      // A cut inside a UTF-8 sequence becomes U+FFFD through dump_replacing.
      out += dump_replacing(json(s.substr(0, room)));
      out.insert(out.size() - 1, "...");
    }
    return;
  }
  if (v.is_array() || v.is_object()) {
    const bool is_object = v.is_object();
    out += is_object ? '{' : '[';
    bool first = true;
    for (auto it = v.begin(); it != v.end(); ++it) {
      if (out.size() >= kValueBudget) {
        out += "...";
        break;
      }
      if (!first) out += ',';
      first = false;
      if (is_object) {
        describe_into(json(it.key()), out);
        out += ':';
      }
      describe_into(*it, out);
    }
    out += is_object ? '}' : ']';
    return;
  }
  out += dump_replacing(v);  // a number, bool or null: short
}

std::string describe(const json& v) {
  std::string out;
  describe_into(v, out);
  return out;
}

[[noreturn]] void wrong_type(const std::string& param, const char* expected, const json& v) {
  reject(param,
         fmt::format("'{}' must be {}, got {} ({})", param, expected, describe(v), v.type_name()));
}

// The member `key` of `obj`, or nullptr when absent or null (OpenAI treats an
// explicit null as "not set").
const json* member(const json& obj, const char* key) {
  auto it = obj.find(key);
  if (it == obj.end() || it->is_null()) return nullptr;
  return &*it;
}

bool as_bool(const json& v, const std::string& param) {
  if (!v.is_boolean()) wrong_type(param, "a boolean", v);
  return v.get<bool>();
}

const std::string& as_string(const json& v, const std::string& param) {
  if (!v.is_string()) wrong_type(param, "a string", v);
  return v.get_ref<const std::string&>();
}

// An integer. An integral float (2.0) is accepted too, as pydantic-based
// servers (vLLM) accept it; 2.5 is not.
int64_t as_int(const json& v, const std::string& param) {
  if (v.is_number_integer() && !v.is_number_unsigned()) return v.get<int64_t>();
  if (v.is_number_unsigned()) {
    const uint64_t u = v.get<uint64_t>();
    if (u > static_cast<uint64_t>(std::numeric_limits<int64_t>::max())) {
      reject(param, fmt::format("'{}' = {} is out of range: it must fit a signed 64-bit integer",
                                param, u));
    }
    return static_cast<int64_t>(u);
  }
  if (v.is_number_float()) {
    const double d = v.get<double>();
    // 2^63 is exactly representable; every double below it in magnitude
    // converts to int64 without overflow.
    if (std::trunc(d) == d && d >= -9223372036854775808.0 && d < 9223372036854775808.0) {
      return static_cast<int64_t>(d);
    }
  }
  wrong_type(param, "an integer", v);
}

int64_t as_int_in(const json& v, const std::string& param, int64_t lo, int64_t hi) {
  const int64_t x = as_int(v, param);
  if (x < lo || x > hi) {
    reject(param, fmt::format("'{}' = {} is out of range: it must be between {} and {}", param, x,
                              lo, hi));
  }
  return x;
}

double as_number(const json& v, const std::string& param) {
  if (!v.is_number()) wrong_type(param, "a number", v);
  return v.get<double>();
}

// A number in [lo, hi]; with lo_open, in (lo, hi].
float as_float_in(const json& v, const std::string& param, double lo, double hi,
                  bool lo_open = false) {
  const double x = as_number(v, param);
  if (!(lo_open ? x > lo : x >= lo) || !(x <= hi)) {
    reject(param, fmt::format("'{}' = {} is out of range: it must be in {}{}, {}]", param,
                              dump_replacing(v), lo_open ? '(' : '[', lo, hi));
  }
  return static_cast<float>(x);
}

std::string indexed(const std::string& param, size_t i) {
  return fmt::format("{}[{}]", param, i);
}

int32_t as_token_id(const json& v, const std::string& param) {
  return static_cast<int32_t>(as_int_in(v, param, 0, std::numeric_limits<int32_t>::max()));
}

// Type-checks what chat_messages_from_json would reject only in general terms,
// so that the error names the exact field (messages[1].content).
void precheck_messages(const json& messages) {
  for (size_t i = 0; i < messages.size(); ++i) {
    const json& m = messages[i];
    const std::string at = indexed("messages", i);
    if (!m.is_object()) wrong_type(at, "an object", m);
    const json* role = member(m, "role");
    if (role == nullptr) reject(at + ".role", fmt::format("'{}.role' is required", at));
    as_string(*role, at + ".role");
    if (const json* content = member(m, "content")) {
      if (!content->is_string() && !content->is_array()) {
        wrong_type(at + ".content", "a string or an array of content parts", *content);
      }
    }
  }
}

void parse_chat_fields(const json& body, const RequestLimits& limits, CompletionRequest& r) {
  const json* messages = member(body, "messages");
  if (messages == nullptr) reject("messages", "'messages' is required");
  if (!messages->is_array()) wrong_type("messages", "an array of messages", *messages);
  if (messages->empty()) reject("messages", "'messages' must not be empty");
  precheck_messages(*messages);
  try {
    r.messages = chat_messages_from_json(*messages);
  } catch (const Error& e) {
    reject("messages", e.what());
  }

  if (const json* kwargs = member(body, "chat_template_kwargs")) {
    if (!kwargs->is_object()) wrong_type("chat_template_kwargs", "an object", *kwargs);
    if (const json* v = member(*kwargs, "enable_thinking")) {
      r.enable_thinking = as_bool(*v, "chat_template_kwargs.enable_thinking");
    }
  }

  // Chat: logprobs is a flag and top_logprobs the count of alternatives.
  bool logprobs = false;
  if (const json* v = member(body, "logprobs")) logprobs = as_bool(*v, "logprobs");
  int top = 0;
  if (const json* v = member(body, "top_logprobs")) {
    top = static_cast<int>(as_int_in(*v, "top_logprobs", 0, limits.max_logprobs));
    if (!logprobs) reject("top_logprobs", "'top_logprobs' requires 'logprobs' to be true");
  }
  r.logprobs = logprobs ? top : -1;
}

// Sets r.prompt or r.prompt_ids from one prompt: a string or token ids.
void parse_one_prompt(const json& p, const std::string& param, CompletionRequest& r) {
  if (p.is_string()) {
    r.prompt = p.get<std::string>();
    if (r.prompt.empty()) reject(param, fmt::format("'{}' must not be empty", param));
    return;
  }
  if (!p.is_array() || p.empty() || !p[0].is_number()) {
    wrong_type(param, "a non-empty string or a non-empty array of token ids", p);
  }
  r.prompt_is_ids = true;
  r.prompt_ids.reserve(p.size());
  for (size_t i = 0; i < p.size(); ++i)
    r.prompt_ids.push_back(as_token_id(p[i], indexed(param, i)));
}

void parse_completion_fields(const json& body, const RequestLimits& limits, CompletionRequest& r) {
  const json* prompt = member(body, "prompt");
  if (prompt == nullptr) reject("prompt", "'prompt' is required");
  // OpenAI's prompt is a string, an array of token ids, or a batch (an array
  // of strings or of token-id arrays); a batch of one is that one prompt.
  if (prompt->is_array() && !prompt->empty() &&
      ((*prompt)[0].is_string() || (*prompt)[0].is_array())) {
    if (prompt->size() > 1) {
      reject("prompt", fmt::format("only one prompt per request is supported, got {} prompts",
                                   prompt->size()));
    }
    parse_one_prompt((*prompt)[0], "prompt[0]", r);
  } else {
    parse_one_prompt(*prompt, "prompt", r);
  }

  // Completions: logprobs is the count of alternatives (0: the chosen token only).
  if (const json* v = member(body, "logprobs")) {
    r.logprobs = static_cast<int>(as_int_in(*v, "logprobs", 0, limits.max_logprobs));
  }
}

// The field named by a SamplingParams::validate message ("sampling parameter
// stop[2] is ..." -> "stop"), or "" when it names none.
std::string validated_field(const std::string& message) {
  constexpr std::string_view kPrefix = "sampling parameter ";
  if (message.rfind(kPrefix, 0) != 0) return "";
  const size_t end = message.find_first_of(" [", kPrefix.size());
  return message.substr(kPrefix.size(), end - kPrefix.size());
}

CompletionRequest parse_or_reject(std::string_view text, Endpoint endpoint,
                                  const RequestLimits& limits) {
  json body;
  try {
    // nlohmann's lexer rejects ill-formed UTF-8 (and unpaired \u surrogates)
    // inside strings, so every string below is valid UTF-8.
    body = json::parse(text.begin(), text.end());
  } catch (const json::exception& e) {
    std::string what = e.what();
    // Drop the "[json.exception.parse_error.101] " tag: it means nothing to a client.
    if (const size_t tag_end = what.find("] ");
        what.rfind("[json.", 0) == 0 && tag_end != std::string::npos) {
      what.erase(0, tag_end + 2);
    }
    reject("", "the request body is not valid JSON: " + what);
  }
  if (!body.is_object()) {
    reject("", fmt::format("the request body must be a JSON object, got {}", body.type_name()));
  }

  CompletionRequest r;
  r.endpoint = endpoint;
  if (const json* v = member(body, "model")) r.model = as_string(*v, "model");
  if (endpoint == Endpoint::kChat) {
    parse_chat_fields(body, limits, r);
  } else {
    parse_completion_fields(body, limits, r);
  }

  if (const json* v = member(body, "n"))
    r.n = static_cast<int>(as_int_in(*v, "n", 1, limits.max_n));
  if (const json* v = member(body, "stream")) r.stream = as_bool(*v, "stream");
  if (const json* v = member(body, "stream_options")) {
    if (!v->is_object()) wrong_type("stream_options", "an object", *v);
    // As OpenAI: stream_options only make sense on a stream.
    if (!r.stream) {
      reject("stream_options", "'stream_options' is only allowed when 'stream' is true");
    }
    if (const json* u = member(*v, "include_usage")) {
      r.include_usage = as_bool(*u, "stream_options.include_usage");
    }
  }

  SamplingParams& p = r.params;
  if (const json* v = member(body, "stop")) {
    if (v->is_string()) {
      p.stop.push_back(v->get<std::string>());
      if (p.stop.back().empty()) reject("stop", "'stop' must not be an empty string");
    } else if (v->is_array()) {
      if (v->size() > static_cast<size_t>(limits.max_stop)) {
        reject("stop", fmt::format("'stop' has {} strings; at most {} are allowed", v->size(),
                                   limits.max_stop));
      }
      for (size_t i = 0; i < v->size(); ++i) {
        const std::string param = indexed("stop", i);
        p.stop.push_back(as_string((*v)[i], param));
        if (p.stop.back().empty()) reject(param, fmt::format("'{}' must not be empty", param));
      }
    } else {
      wrong_type("stop", "a string or an array of strings", *v);
    }
  }
  if (const json* v = member(body, "stop_token_ids")) {
    if (!v->is_array()) wrong_type("stop_token_ids", "an array of token ids", *v);
    for (size_t i = 0; i < v->size(); ++i) {
      p.stop_token_ids.push_back(as_token_id((*v)[i], indexed("stop_token_ids", i)));
    }
  }

  // max_completion_tokens is the newer name of max_tokens (chat only); it wins.
  const int64_t max_tokens_cap =
      limits.max_tokens > 0 ? limits.max_tokens : std::numeric_limits<int32_t>::max();
  p.max_tokens = limits.default_max_tokens;
  if (const json* v = member(body, "max_tokens")) {
    p.max_tokens = static_cast<int32_t>(as_int_in(*v, "max_tokens", 1, max_tokens_cap));
  }
  if (endpoint == Endpoint::kChat) {
    if (const json* v = member(body, "max_completion_tokens")) {
      p.max_tokens =
          static_cast<int32_t>(as_int_in(*v, "max_completion_tokens", 1, max_tokens_cap));
    }
  }

  // Ranges: OpenAI's for its fields, vLLM's for the extensions.
  if (const json* v = member(body, "temperature"))
    p.temperature = as_float_in(*v, "temperature", 0, 2);
  if (const json* v = member(body, "top_p"))
    p.top_p = as_float_in(*v, "top_p", 0, 1, /*lo_open=*/true);
  if (const json* v = member(body, "top_k")) {
    p.top_k = static_cast<int32_t>(as_int_in(*v, "top_k", -1, std::numeric_limits<int32_t>::max()));
  }
  if (const json* v = member(body, "min_p")) p.min_p = as_float_in(*v, "min_p", 0, 1);
  if (const json* v = member(body, "repetition_penalty")) {
    // vLLM sets no upper bound; FLT_MAX keeps the float conversion finite.
    p.repetition_penalty = as_float_in(*v, "repetition_penalty", 0,
                                       std::numeric_limits<float>::max(), /*lo_open=*/true);
  }
  if (const json* v = member(body, "presence_penalty")) {
    p.presence_penalty = as_float_in(*v, "presence_penalty", -2, 2);
  }
  if (const json* v = member(body, "frequency_penalty")) {
    p.frequency_penalty = as_float_in(*v, "frequency_penalty", -2, 2);
  }
  if (const json* v = member(body, "seed")) {
    // Any int64 (OpenAI's and vLLM's range); the bits seed the Rng as they are.
    p.seed = static_cast<uint64_t>(as_int(*v, "seed"));
    r.has_seed = true;
  }
  if (const json* v = member(body, "ignore_eos")) r.ignore_eos = as_bool(*v, "ignore_eos");
  if (const json* v = member(body, "user")) r.user = as_string(*v, "user");

  if (const json* v = member(body, "speculative")) {
    if (!v->is_object()) wrong_type("speculative", "an object", *v);
    if (const json* e = member(*v, "enabled")) r.speculative = as_bool(*e, "speculative.enabled");
    if (const json* d = member(*v, "draft_tokens")) {
      r.draft_tokens = static_cast<int>(
          as_int_in(*d, "speculative.draft_tokens", 1, std::numeric_limits<int32_t>::max()));
    }
  }

  // The engine's own checks, as the last word (the checks above should make
  // them pass). max_tokens 0 means "the server fills it in", valid here.
  try {
    SamplingParams check = p;
    if (check.max_tokens == 0) check.max_tokens = 1;
    check.validate();
  } catch (const Error& e) {
    reject(validated_field(e.what()), e.what());
  }
  return r;
}

}  // namespace

std::string error_body(const ApiError& error) {
  json inner = json::object();
  inner["message"] = error.message;
  inner["type"] = error.type;
  inner["param"] = error.param.empty() ? json(nullptr) : json(error.param);
  inner["code"] = error.code.empty() ? json(nullptr) : json(error.code);
  return dump_replacing(json{{"error", std::move(inner)}});
}

std::variant<CompletionRequest, ApiError> parse_request(std::string_view body, Endpoint endpoint,
                                                        const RequestLimits& limits) {
  try {
    return parse_or_reject(body, endpoint, limits);
  } catch (const Rejection& r) {
    return r.error;
  } catch (const std::bad_alloc&) {
    ApiError e;
    e.status = 413;
    e.message = "the request is too large to parse";
    return e;
  } catch (const std::exception& e) {
    // Not expected (every check above rejects by value); kept so that a
    // missed case is a 400, not a dropped connection.
    ApiError err;
    err.message = fmt::format("the request could not be parsed: {}", e.what());
    return err;
  }
}

}  // namespace specula::api
