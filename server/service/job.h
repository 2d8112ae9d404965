// SPDX-License-Identifier: Apache-2.0
// What the service keeps per HTTP request (a Job of n Choices, each one
// engine row) and its Prometheus series. Internal to server/service.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "engine/sampling/stop_matcher.h"
#include "engine/tokenizer/tokenizer.h"
#include "server/api/openai_request.h"
#include "server/api/openai_response.h"
#include "server/http/http_server.h"
#include "server/metrics/prometheus.h"
#include "server/service/service.h"

namespace specula::server {

double steady_seconds();
int64_t unix_seconds();

struct Service::Choice {
  Choice(const Tokenizer& tokenizer, std::vector<std::string> stop_strings)
      : detok(tokenizer, /*skip_special_tokens=*/true), stops(std::move(stop_strings)) {}

  Job* job = nullptr;
  int index = 0;
  int64_t engine_id = -1;  // -1 before submit and after the engine's last update
  StreamingDecoder detok;
  StopMatcher stops;
  std::string text;               // what was emitted (kept for non-streaming responses)
  std::string stop_reason;        // set when we ended the row ourselves (a stop string)
  std::string finish_reason;      // the final one
  int64_t completion_tokens = 0;  // tokens the row committed, up to the one that stopped it
  double first_token_at = 0, last_token_at = 0;
  speculative::DecodeStats stats;
  std::vector<api::TokenLogprob> logprobs;  // all (non-streaming) or this update's (streaming)
  bool done = false;
};

struct Service::Job {
  uint64_t serial = 0;
  std::string id;
  int64_t created = 0;
  double arrived = 0, deadline = 0;
  api::CompletionRequest request;
  std::vector<int32_t> prompt;
  std::shared_ptr<http::Exchange> exchange;
  std::vector<std::unique_ptr<Choice>> choices;
  int open_choices = 0;
  bool started = false;      // every choice was submitted (and a stream began)
  bool client_gone = false;  // the client disconnected
  // Set when the job must end with an error instead of its choices' results.
  int abort_status = 0;
  std::string abort_message, abort_type;
};

// The server's Prometheus series, named as vLLM's with a "specula:" prefix.
struct Service::Metrics {
  explicit Metrics(metrics::Registry& r);

  metrics::Registry& registry;
  metrics::Gauge* running;
  metrics::Gauge* waiting;
  metrics::Gauge* kv_usage;
  metrics::Counter* prompt_tokens;
  metrics::Counter* generation_tokens;
  metrics::Counter* rejected;
  metrics::Histogram* ttft;
  metrics::Histogram* itl;
  metrics::Histogram* e2e;
  metrics::Counter* num_drafts;
  metrics::Counter* draft_tokens;
  metrics::Counter* accepted_tokens;
  std::vector<metrics::Counter*> accepted_per_pos;  // grows as positions appear

  metrics::Counter& success(const std::string& finished_reason);
  metrics::Counter& accepted_at(size_t position);
};

}  // namespace specula::server
