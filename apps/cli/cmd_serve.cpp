// SPDX-License-Identifier: Apache-2.0
// `specula serve`: the OpenAI-compatible HTTP server (server/service) on the
// engine core. Flag parsing and wiring only: three threads (HTTP I/O, engine,
// and this one waiting for SIGINT/SIGTERM to shut down gracefully).
#include <fmt/format.h>
#include <pthread.h>
#include <signal.h>

#include <chrono>
#include <filesystem>
#include <memory>
#include <thread>

#include "apps/cli/bench.h"
#include "apps/cli/commands.h"
#include "apps/cli/setup.h"
#include "apps/cli/spec_scheduler.h"
#include "engine/chat/chat_template_check.h"
#include "engine/core/error.h"
#include "engine/speculative/engine.h"
#include "server/http/http_server.h"
#include "server/service/service.h"

namespace specula::cli {
namespace {

struct ServeArgs {
  ModelArgs model;
  speculative::DraftSchedule schedule;
  std::string host = "127.0.0.1";
  int port = 8080;
  std::string api_key;
  std::string served_model_name;
  int max_num_seqs = 16;
  int64_t max_num_batched_tokens = 0;
  double kv_memory = 0;
  int max_queue = 256;
  int64_t default_max_tokens = 0;
  int max_n = 8;
  double request_timeout = 600;
  double shutdown_timeout = 10;
  int64_t max_body_size = 8 << 20;
  int max_connections = 4096;
  double http_timeout = 30;
  bool disable_log_requests = false;
  // Benchmarking: a random-weight model of a released shape (needs --tokenizer).
  std::string random_weights;
  uint64_t seed = 1234;
  SchedulerArgs scheduler;  // --spec-scheduler and the SPS table
};

void check_args(const ServeArgs& a) {
  check_scheduler_args(a.scheduler);
  if (a.port < 0 || a.port > 65535) fail("--port: {} is not a TCP port (0..65535)", a.port);
  if (a.max_num_seqs < 1 || a.max_num_seqs > 4096)
    fail("--max-num-seqs: {} is out of range (1..4096)", a.max_num_seqs);
  if (a.max_queue < 0 || a.max_queue > 1'000'000)
    fail("--max-queue: {} is out of range (0..1000000)", a.max_queue);
  if (a.max_num_batched_tokens < 0)
    fail("--max-num-batched-tokens: {} is negative (0 = no limit)", a.max_num_batched_tokens);
  if (a.default_max_tokens < 0)
    fail("--max-tokens: {} is negative (0 = up to the context)", a.default_max_tokens);
  if (a.max_n < 1 || a.max_n > 128) fail("--max-n: {} is out of range (1..128)", a.max_n);
  if (!(a.request_timeout > 0))
    fail("--request-timeout: {} is not a positive number of seconds", a.request_timeout);
  if (!(a.shutdown_timeout >= 0))
    fail("--shutdown-timeout: {} is not a number of seconds >= 0", a.shutdown_timeout);
  if (a.max_body_size < 1024 || a.max_body_size > (int64_t{1} << 30))
    fail("--max-body-size: {} is out of range (1024 .. 1 GiB)", a.max_body_size);
  if (!(a.http_timeout > 0) || a.http_timeout > 3600)
    fail("--http-timeout: {} is out of range (0 < seconds <= 3600)", a.http_timeout);
  if (a.max_connections < 1 || a.max_connections > 1'000'000)
    fail("--max-connections: {} is out of range (1..1000000)", a.max_connections);
}

void run_serve(ServeArgs& args) {
  check_args(args);
  // Every thread started from here on inherits the blocked signals; this one
  // takes them with sigwait, so shutdown runs as ordinary code.
  sigset_t signals;
  sigemptyset(&signals);
  sigaddset(&signals, SIGINT);
  sigaddset(&signals, SIGTERM);
  pthread_sigmask(SIG_BLOCK, &signals, nullptr);
  signal(SIGPIPE, SIG_IGN);

  LoadedModels m;
  if (!args.random_weights.empty() || args.model.draft == kRandomDraft ||
      args.model.draft.starts_with("replay:")) {
    // The benchmarks' loader: random weights of a released shape, and the
    // random or replay (simulated acceptance) drafters.
    BenchArgs ba;
    ba.model = args.model;
    ba.random_weights = args.random_weights;
    ba.seed = args.seed;
    ba.need_tokenizer = true;
    m = load_bench_models(ba, parse_device(args.model.device));
  } else {
    m = load_models(args.model, /*with_draft=*/true, /*with_tokenizer=*/true, /*quiet=*/false);
  }
  speculative::EngineOptions eo;
  eo.schedule = args.schedule;
  resolve_schedule(eo.schedule, m.draft_source.get());
  eo.max_rows = args.max_num_seqs;
  eo.max_batch_tokens = args.max_num_batched_tokens;
  eo.kv_memory = args.kv_memory;
  eo.max_waiting = args.max_num_seqs * 128 + args.max_queue;  // the service bounds it first
  if (m.draft_source) {
    const int max_k =
        std::max(eo.schedule.draft_tokens, eo.schedule.adaptive ? eo.schedule.max_draft_tokens : 0);
    eo.scheduler = scheduler_options(args.scheduler, *m.target, eo.max_rows, max_k, false);
  }
  speculative::Engine engine(*m.target, m.draft_source.get(), eo);
  if (const std::string note = unscheduled_note(args.scheduler, engine, m.draft_source.get());
      !note.empty()) {
    fmt::print(stderr, "note: {}\n", note);
  }

  server::ServiceOptions so;
  so.model_name = !args.served_model_name.empty() ? args.served_model_name
                  : !args.random_weights.empty()  ? "random-" + args.random_weights
                  : args.model.model.empty()
                      ? std::string("specula-default")
                      : std::filesystem::path(args.model.model).filename().string();
  if (so.model_name.empty()) so.model_name = args.model.model;
  so.api_key = args.api_key;
  so.max_num_seqs = engine.kv_pool().max_rows;
  so.max_queue = args.max_queue;
  so.limits.max_n = args.max_n;
  so.request_timeout_s = args.request_timeout;
  so.log_requests = !args.disable_log_requests;
  so.eos_ids =
      !m.tokenizer->eos_ids().empty() ? m.tokenizer->eos_ids() : m.target->config().eos_token_ids;
  if (auto end_turn = m.tokenizer->token_to_id("<turn|>")) so.chat_stop_ids.push_back(*end_turn);
  so.chat.family =
      m.target->config().has_ple() ? ChatTemplateFamily::kEdge : ChatTemplateFamily::kLarge;
  const ChatTemplateCheck check = check_checkpoint_chat_template(m.model_dir);
  if (check.status == ChatTemplateCheck::Status::kCurrent ||
      check.status == ChatTemplateCheck::Status::kOlderOfficial)
    so.chat.family = check.family;
  if (check.status != ChatTemplateCheck::Status::kCurrent)
    fmt::print(stderr, "note: {}\n", check.message);
  if (auto bos = m.tokenizer->bos_id())
    so.chat.bos_token = m.tokenizer->id_to_token(*bos).value_or("<bos>");
  so.has_drafter = m.draft_source != nullptr;
  so.context_length = m.target->max_context();
  so.default_max_tokens = args.default_max_tokens;
  if (m.replay) {
    // The replay drafter proposes the target's greedy continuation of prompts
    // it has seen finish (a simulation for benchmarks): teach it every one.
    so.on_choice_finished = [&m](const std::vector<int32_t>& prompt,
                                 const std::vector<int32_t>& output) {
      std::vector<int32_t> sequence = prompt;
      sequence.insert(sequence.end(), output.begin(), output.end());
      m.replay->add_reference(std::move(sequence));
    };
    fmt::print(stderr,
               "note: --draft replay: SIMULATED acceptance, replaying the greedy output of prompts "
               "served before (a first pass of a prompt drafts nothing useful)\n");
  }
  server::Service service(engine, *m.tokenizer, so);

  http::ServerOptions ho;
  ho.host = args.host;
  ho.port = args.port;
  ho.max_body_bytes = static_cast<size_t>(args.max_body_size);
  ho.max_connections = args.max_connections;
  ho.request_timeout_s = args.http_timeout;
  ho.error_response = &server::Service::error_response;
  http::Server http_server(ho,
                           [&service](const http::Request& r, std::shared_ptr<http::Exchange> e) {
                             service.handle(r, std::move(e));
                           });

  std::thread engine_thread([&] { service.run_engine(); });
  std::thread io_thread([&] { http_server.run(); });
  const speculative::KvPoolInfo pool = engine.kv_pool();
  fmt::print(stderr,
             "specula serve: '{}' on http://{}:{} ({} rows of {:.1f} MiB KV, context {}, {})\n",
             so.model_name, args.host, http_server.port(), pool.max_rows,
             pool.bytes_per_row / 1048576.0, so.context_length,
             so.has_drafter ? fmt::format("speculation k={}", eo.schedule.draft_tokens)
                            : std::string("no drafter"));
  std::fflush(stderr);

  int sig = 0;
  sigwait(&signals, &sig);
  fmt::print(
      stderr,
      "specula serve: {} received: not accepting new requests; {} in flight get up to {:g} s\n",
      sig == SIGINT ? "SIGINT" : "SIGTERM", service.active_jobs(), args.shutdown_timeout);
  http_server.stop_accepting();
  service.shutdown(args.shutdown_timeout);
  engine_thread.join();
  // Let the I/O thread send what the last jobs wrote, then close everything.
  const auto flush_until = std::chrono::steady_clock::now() + std::chrono::seconds(2);
  while (service.active_jobs() > 0 && std::chrono::steady_clock::now() < flush_until)
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  std::this_thread::sleep_for(std::chrono::milliseconds(200));
  http_server.stop();
  io_thread.join();
  fmt::print(stderr, "specula serve: stopped\n");
}

}  // namespace

void register_serve(CLI::App& app) {
  auto args = std::make_shared<ServeArgs>();
  CLI::App* cmd = app.add_subcommand(
      "serve",
      "OpenAI-compatible HTTP server (/v1/chat/completions, /v1/completions, /v1/models, "
      "/health, /metrics, and a chat page at /)");
  add_model_options(cmd, args->model, /*with_draft=*/true);
  add_scheduler_options(cmd, args->scheduler);
  add_draft_options(cmd, args->schedule);
  cmd->add_option("--host", args->host, "Address to listen on (loopback by default)")
      ->capture_default_str();
  cmd->add_option("--port", args->port, "TCP port (0: any free port)")->capture_default_str();
  cmd->add_option("--api-key", args->api_key,
                  "Require 'Authorization: Bearer KEY' on /v1/* requests");
  cmd->add_option("--served-model-name", args->served_model_name,
                  "Model id in /v1/models and responses (default: the model directory's name)");
  cmd->add_option("--max-num-seqs", args->max_num_seqs,
                  "Most sequences decoding at once (the KV pool may allow fewer)")
      ->capture_default_str();
  cmd->add_option("--max-num-batched-tokens", args->max_num_batched_tokens,
                  "Token budget of one engine step (0: no limit)")
      ->capture_default_str();
  cmd->add_option("--kv-memory", args->kv_memory,
                  "KV memory: bytes when > 1, a fraction of free memory when in (0, 1], 0: "
                  "--max-num-seqs rows")
      ->capture_default_str();
  cmd->add_option("--max-queue", args->max_queue,
                  "Sequences that may wait beyond --max-num-seqs; past it requests get 429")
      ->capture_default_str();
  cmd->add_option("--max-tokens", args->default_max_tokens,
                  "max_tokens of requests that set none (0: up to the context)")
      ->capture_default_str();
  cmd->add_option("--max-n", args->max_n, "Largest n (choices per request) accepted")
      ->capture_default_str();
  cmd->add_option("--request-timeout", args->request_timeout,
                  "Seconds a request may take before it is cancelled (504)")
      ->capture_default_str();
  cmd->add_option("--shutdown-timeout", args->shutdown_timeout,
                  "On SIGINT/SIGTERM, seconds in-flight requests get to finish")
      ->capture_default_str();
  cmd->add_option("--max-body-size", args->max_body_size, "Largest request body, in bytes (413)")
      ->capture_default_str();
  cmd->add_option("--max-connections", args->max_connections, "Most open connections (503)")
      ->capture_default_str();
  cmd->add_option("--random-weights", args->random_weights,
                  "Benchmarking: serve a random-weight model of a released shape (e2b, e4b, 31b, "
                  "26b-a4b) or config.json; needs --tokenizer. --draft random / replay:A1,A2,... "
                  "(simulated acceptance) work here as in bench");
  cmd->add_option("--seed", args->seed, "Seed of --random-weights")->capture_default_str();
  cmd->add_option("--http-timeout", args->http_timeout,
                  "Seconds a request's headers and body may take to arrive (408 after)")
      ->capture_default_str();
  cmd->add_flag("--disable-log-requests", args->disable_log_requests,
                "No log line per request on stderr");
  cmd->callback([args] { run_serve(*args); });
}

}  // namespace specula::cli
