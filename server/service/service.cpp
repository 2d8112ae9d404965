// SPDX-License-Identifier: Apache-2.0
// Service: routing and request intake on the HTTP I/O thread (see service.h).
// The engine thread's half is engine_loop.cpp.
#include "server/service/service.h"

#include <fmt/format.h>

#include <chrono>
#include <random>

#include "engine/core/error.h"
#include "server/api/openai_response.h"
#include "server/service/job.h"
#include "server/web/web_assets.h"

namespace specula::server {
namespace {

// Compares without an early exit, so the time taken does not tell how much
// of a guessed key was right.
bool same_key(std::string_view a, std::string_view b) {
  unsigned diff = a.size() == b.size() ? 0u : 1u;
  for (size_t i = 0; i < a.size(); ++i)
    diff |= static_cast<unsigned char>(a[i]) ^
            static_cast<unsigned char>(b[i % (b.empty() ? 1 : b.size())]);
  return diff == 0 && !b.empty();
}

http::Response json_response(int status, std::string body) {
  http::Response r;
  r.status = status;
  r.body = std::move(body);
  return r;
}

}  // namespace

double steady_seconds() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

Service::Service(speculative::Engine& engine, const Tokenizer& tokenizer, ServiceOptions options)
    : engine_(engine),
      tokenizer_(tokenizer),
      options_(std::move(options)),
      metrics_(std::make_unique<Metrics>(registry_)) {
  std::random_device rd;
  id_salt_ = (static_cast<uint64_t>(rd()) << 32) ^ rd();
}

Service::~Service() = default;

http::Response Service::error_response(int status, std::string message) {
  api::ApiError e;
  e.status = status;
  e.message = std::move(message);
  if (status == 503) e.type = "service_unavailable";
  return json_response(status, api::error_body(e));
}

void Service::respond_error(http::Exchange& exchange, const api::ApiError& error,
                            std::vector<std::pair<std::string, std::string>> headers) {
  http::Response r = json_response(error.status, api::error_body(error));
  r.headers = std::move(headers);
  exchange.respond(std::move(r));
}

void Service::handle(const http::Request& request, std::shared_ptr<http::Exchange> exchange) {
  const std::string& path = request.path;
  const bool get = request.method == "GET" || request.method == "HEAD";
  const bool post = request.method == "POST";
  auto method_not_allowed = [&](const char* allowed) {
    api::ApiError e{
        .status = 405,
        .message = fmt::format("{} {} is not supported; use {}", request.method, path, allowed)};
    respond_error(*exchange, e, {{"Allow", allowed}});
  };
  if (path == "/" || path == "/index.html") {
    if (!get) return method_not_allowed("GET");
    http::Response r;
    r.content_type = "text/html; charset=utf-8";
    r.body = std::string(web::chat_page_html());
    exchange->respond(std::move(r));
    return;
  }
  if (path == "/health") {
    if (!get) return method_not_allowed("GET");
    const bool down = stopping();
    exchange->respond(json_response(down ? 503 : 200,
                                    down ? R"({"status":"shutting down"})" : R"({"status":"ok"})"));
    return;
  }
  if (path == "/metrics") {
    if (!get) return method_not_allowed("GET");
    http::Response r;
    r.content_type = "text/plain; version=0.0.4; charset=utf-8";
    r.body = registry_.render();
    exchange->respond(std::move(r));
    return;
  }
  const bool v1 = path.starts_with("/v1/");
  if (v1 && !options_.api_key.empty()) {
    std::string_view auth = request.header("authorization").value_or("");
    constexpr std::string_view kBearer = "Bearer ";
    if (!auth.starts_with(kBearer) || !same_key(auth.substr(kBearer.size()), options_.api_key)) {
      respond_error(*exchange, {.status = 401,
                                .message = "missing or incorrect API key: send the header "
                                           "'Authorization: Bearer <key>' (the server's --api-key)",
                                .code = "invalid_api_key"});
      return;
    }
  }
  if (path == "/v1/models") {
    if (!get) return method_not_allowed("GET");
    exchange->respond(json_response(200, api::models_body({options_.model_name}, started_unix_)));
    return;
  }
  if (path == "/v1/chat/completions" || path == "/v1/completions") {
    if (!post) return method_not_allowed("POST");
    handle_completion(
        request, std::move(exchange),
        path == "/v1/completions" ? api::Endpoint::kCompletions : api::Endpoint::kChat);
    return;
  }
  respond_error(*exchange, {.status = 404,
                            .message = fmt::format("no route for {} {}", request.method, path),
                            .code = "not_found"});
}

bool Service::stopping() const {
  std::lock_guard lock(mu_);
  return shutting_down_;
}

void Service::handle_completion(const http::Request& request,
                                std::shared_ptr<http::Exchange> exchange, api::Endpoint endpoint) {
  const double arrived = steady_seconds();
  auto parsed = api::parse_request(request.body, endpoint, options_.limits);
  if (auto* e = std::get_if<api::ApiError>(&parsed)) return respond_error(*exchange, *e);
  api::CompletionRequest req = std::move(std::get<api::CompletionRequest>(parsed));
  if (!req.model.empty() && req.model != options_.model_name) {
    return respond_error(*exchange,
                         {.status = 404,
                          .message = fmt::format("The model '{}' does not exist; this server "
                                                 "serves '{}' (GET /v1/models)",
                                                 req.model, options_.model_name),
                          .param = "model",
                          .code = "model_not_found"});
  }
  std::vector<int32_t> prompt;
  if (auto e = prepare_prompt(req, endpoint, prompt)) return respond_error(*exchange, *e);
  if (auto e = reserve_choices(req.n)) {
    if (e->status == 429) return respond_error(*exchange, *e, {{"Retry-After", "1"}});
    return respond_error(*exchange, *e);
  }
  auto job = std::make_shared<Job>();
  job->serial = next_job_++;
  job->id = fmt::format("{}{:016x}", endpoint == api::Endpoint::kChat ? "chatcmpl-" : "cmpl-",
                        (job->serial * 0x9E3779B97F4A7C15ull) ^ id_salt_);
  job->created = unix_seconds();
  job->arrived = arrived;
  job->deadline = arrived + options_.request_timeout_s;
  job->prompt = std::move(prompt);
  job->request = std::move(req);
  job->exchange = exchange;
  active_jobs_++;
  std::weak_ptr<Job> weak = job;
  {
    std::lock_guard lock(mu_);
    inbox_.push_back(job);
  }
  // Registered after the job is queued: a client already gone cancels it at once.
  exchange->on_close([this, weak] {
    if (auto j = weak.lock()) {
      std::lock_guard lock(mu_);
      cancels_.push_back(std::move(j));
      wake_.notify_one();
    }
  });
  wake_.notify_one();
}

std::optional<api::ApiError> Service::prepare_prompt(api::CompletionRequest& req,
                                                     api::Endpoint endpoint,
                                                     std::vector<int32_t>& prompt) const {
  // Render and tokenize here, on the I/O thread, so the engine thread only decodes.
  const char* prompt_param = endpoint == api::Endpoint::kChat ? "messages" : "prompt";
  try {
    if (endpoint == api::Endpoint::kChat) {
      ChatOptions chat = options_.chat;
      chat.enable_thinking = req.enable_thinking;
      prompt = tokenizer_.encode(render_chat(req.messages, chat), /*add_special_tokens=*/false);
    } else if (req.prompt_is_ids) {
      prompt = req.prompt_ids;
    } else {
      prompt = tokenizer_.encode(req.prompt, /*add_special_tokens=*/true);
    }
  } catch (const Error& e) {
    return api::ApiError{.status = 400, .message = e.what(), .param = prompt_param};
  }
  const int64_t context = options_.context_length;
  const int64_t n_prompt = static_cast<int64_t>(prompt.size());
  if (prompt.empty()) {
    return api::ApiError{.status = 400, .message = "the prompt is empty", .param = prompt_param};
  }
  if (n_prompt >= context) {
    return api::ApiError{
        .status = 400,
        .message = fmt::format("the prompt is {} tokens; this server's context is {} tokens "
                               "(-c/--ctx-size), which must also hold at least one generated token",
                               n_prompt, context),
        .param = prompt_param,
        .code = "context_length_exceeded"};
  }
  if (req.params.max_tokens <= 0) {
    int64_t room = context - n_prompt;
    if (options_.default_max_tokens > 0)
      room = std::min<int64_t>(room, options_.default_max_tokens);
    req.params.max_tokens = static_cast<int32_t>(room);
  } else if (n_prompt + req.params.max_tokens > context) {
    return api::ApiError{
        .status = 400,
        .message =
            fmt::format("the prompt ({} tokens) plus max_tokens ({}) is {} tokens, past "
                        "this server's context of {} tokens",
                        n_prompt, req.params.max_tokens, n_prompt + req.params.max_tokens, context),
        .param = endpoint == api::Endpoint::kChat ? "max_completion_tokens" : "max_tokens",
        .code = "context_length_exceeded"};
  }
  return std::nullopt;
}

std::optional<api::ApiError> Service::reserve_choices(int n) {
  std::lock_guard lock(mu_);
  if (shutting_down_) {
    return api::ApiError{
        .status = 503, .message = "the server is shutting down", .type = "service_unavailable"};
  }
  const int limit = options_.max_num_seqs + options_.max_queue;
  if (in_flight_choices_ + n > limit) {
    metrics_->rejected->inc();
    return api::ApiError{
        .status = 429,
        .message = fmt::format("the server is busy: {} sequences are running or queued (the "
                               "limit is --max-num-seqs + --max-queue = {}); retry later",
                               in_flight_choices_, limit),
        .type = "rate_limit_error",
        .code = "queue_full"};
  }
  in_flight_choices_ += n;
  return std::nullopt;
}

void Service::shutdown(double grace_s) {
  std::lock_guard lock(mu_);
  if (!shutting_down_) {
    shutting_down_ = true;
    shutdown_deadline_ = steady_seconds() + grace_s;
  }
  wake_.notify_one();
}

}  // namespace specula::server
