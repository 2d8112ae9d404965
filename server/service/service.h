// SPDX-License-Identifier: Apache-2.0
// Service: the OpenAI-compatible server's logic between the HTTP layer
// (server/http) and the engine (engine/speculative/engine.h).
//
// Threads: the HTTP I/O thread calls handle() for every request; handle()
// parses and validates, renders the chat template and tokenizes, and queues a
// Job (or answers at once: errors, /health, /metrics, /v1/models, the page).
// One engine thread (run_engine) owns the Engine: it submits queued jobs'
// choices, steps, detokenizes and applies stop strings per choice, and writes
// each client's response through its Exchange (thread-safe; the I/O thread
// sends it). A client that disconnects cancels its job: the engine thread
// cancels its rows, which frees their KV at once.
//
// Back-pressure: at most max_num_seqs + max_queue choices are in flight; a
// request past that gets 429 with Retry-After. shutdown() refuses new work
// (503), lets running jobs finish until the grace deadline, then cancels the
// rest (each client still gets a well-formed end of its response).
#pragma once

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <unordered_map>
#include <vector>

#include "engine/chat/chat_format.h"
#include "engine/speculative/engine.h"
#include "engine/tokenizer/tokenizer.h"
#include "server/api/openai_request.h"
#include "server/api/openai_response.h"
#include "server/http/http_server.h"
#include "server/metrics/prometheus.h"

namespace specula::server {

struct ServiceOptions {
  std::string model_name = "specula";  // the id in /v1/models; requests may name it or omit it
  std::string api_key;                 // non-empty: /v1/* need "Authorization: Bearer <key>"
  int max_num_seqs = 16;               // the engine's rows (for the in-flight bound)
  int max_queue = 256;                 // choices that may wait beyond max_num_seqs
  api::RequestLimits limits;
  double request_timeout_s = 600;  // a job still running after this is cancelled
  bool log_requests = true;        // one line per request on stderr
  // EOS ids (end generation unless ignore_eos) and, for chat, the end-of-turn id.
  std::vector<int32_t> eos_ids;
  std::vector<int32_t> chat_stop_ids;
  ChatOptions chat;
  // Whether the engine has a drafter (usage.speculative is reported then).
  bool has_drafter = false;
  // The target's context (prompt + generated tokens); requests past it get 400.
  int64_t context_length = 4096;
  // max_tokens for requests that do not set it: up to the context, at most this (0: no cap).
  int64_t default_max_tokens = 0;
  // Called on the engine thread with each choice that ended by itself (stop or
  // length): its prompt and generated tokens. Benchmarks feed the replay
  // drafter with it; empty by default.
  std::function<void(const std::vector<int32_t>& prompt, const std::vector<int32_t>& output)>
      on_choice_finished;
};

class Service {
 public:
  // engine and tokenizer must outlive the service; only the engine thread
  // (run_engine) touches the engine.
  Service(speculative::Engine& engine, const Tokenizer& tokenizer, ServiceOptions options);
  ~Service();
  Service(const Service&) = delete;
  Service& operator=(const Service&) = delete;

  // The HTTP handler (runs on the I/O thread; never blocks on the engine).
  void handle(const http::Request& request, std::shared_ptr<http::Exchange> exchange);
  // The engine loop; returns after shutdown() once every job has ended.
  void run_engine();
  // Refuses new requests from now on (503), lets jobs run until `grace_s`
  // from now, then cancels the rest. Thread-safe; returns at once.
  void shutdown(double grace_s);
  // Jobs accepted and not yet answered (any thread).
  int active_jobs() const { return active_jobs_.load(); }
  // The error response the HTTP layer sends for its own errors.
  static http::Response error_response(int status, std::string message);

  metrics::Registry& registry() { return registry_; }

 private:
  struct Job;
  struct Choice;
  struct Metrics;

  bool stopping() const;
  // I/O thread.
  void handle_completion(const http::Request& request, std::shared_ptr<http::Exchange> exchange,
                         api::Endpoint endpoint);
  // Renders and tokenizes the request's prompt into `prompt` and checks it
  // against the context, filling in a default max_tokens; or the error to send.
  std::optional<api::ApiError> prepare_prompt(api::CompletionRequest& req, api::Endpoint endpoint,
                                              std::vector<int32_t>& prompt) const;
  // Counts n more choices in flight, or says why not (503 shutting down, 429 busy).
  std::optional<api::ApiError> reserve_choices(int n);
  void respond_error(http::Exchange& exchange, const api::ApiError& error,
                     std::vector<std::pair<std::string, std::string>> headers = {});
  // Engine thread.
  void take_inbox();
  void start_job(std::shared_ptr<Job> job);
  void dispatch(const speculative::RequestUpdate& update);
  void emit_text(Job& job, Choice& choice, const std::string& text, bool final_piece);
  void finish_choice(Job& job, Choice& choice, const std::string& reason,
                     const speculative::DecodeStats* stats);
  void finish_job(Job& job);
  api::TokenLogprob token_logprob(const speculative::RequestUpdate& update, size_t t) const;
  bool is_stop_id(const Job& job, int32_t id) const;
  void check_deadlines();
  void update_gauges();

  speculative::Engine& engine_;
  const Tokenizer& tokenizer_;
  ServiceOptions options_;
  metrics::Registry registry_;
  std::unique_ptr<Metrics> metrics_;

  mutable std::mutex mu_;  // guards the inbox, cancels and the shutdown state
  std::condition_variable wake_;
  std::deque<std::shared_ptr<Job>> inbox_;
  std::vector<std::shared_ptr<Job>> cancels_;  // jobs whose client left
  bool shutting_down_ = false;
  double shutdown_deadline_ = 0;  // steady seconds
  int in_flight_choices_ = 0;     // guarded by mu_
  uint64_t id_salt_ = 0;
  int64_t started_unix_ = 0;
  std::atomic<int> active_jobs_{0};
  std::atomic<uint64_t> next_job_{1};

  // Engine thread only.
  std::vector<std::shared_ptr<Job>> jobs_;     // running jobs
  std::unordered_map<int64_t, Choice*> rows_;  // engine id -> its choice, while the row lives
};

}  // namespace specula::server
