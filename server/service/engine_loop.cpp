// SPDX-License-Identifier: Apache-2.0
// The engine thread's half of the Service (see service.h): submitting jobs,
// stepping the engine, turning each row's tokens into text and responses.
#include <fmt/format.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <random>

#include "engine/core/error.h"
#include "server/service/job.h"

namespace specula::server {

int64_t unix_seconds() {
  return std::chrono::duration_cast<std::chrono::seconds>(
             std::chrono::system_clock::now().time_since_epoch())
      .count();
}

namespace {

// vLLM's buckets for time to first token / end-to-end latency and for
// inter-token latency (seconds).
const std::vector<double> kLatencyBuckets = {0.001, 0.005, 0.01, 0.02,  0.04,  0.06,  0.08, 0.1,
                                             0.25,  0.5,   0.75, 1.0,   2.5,   5.0,   7.5,  10.0,
                                             20.0,  40.0,  80.0, 160.0, 640.0, 2560.0};
const std::vector<double> kItlBuckets = {0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1,
                                         0.15,  0.2,    0.3,   0.4,  0.5,   0.75, 1.0,   2.5,
                                         5.0,   7.5,    10.0,  20.0, 40.0,  80.0};

bool contains(const std::vector<int32_t>& ids, int32_t id) {
  return std::find(ids.begin(), ids.end(), id) != ids.end();
}

}  // namespace

Service::Metrics::Metrics(metrics::Registry& r)
    : registry(r),
      running(&r.gauge("specula:num_requests_running", "Sequences decoding or prefilling.")),
      waiting(&r.gauge("specula:num_requests_waiting", "Sequences waiting for a KV row.")),
      kv_usage(&r.gauge("specula:kv_cache_usage_perc", "Fraction of the KV pool's rows in use.")),
      prompt_tokens(&r.counter("specula:prompt_tokens_total", "Prompt tokens processed.")),
      generation_tokens(&r.counter("specula:generation_tokens_total", "Tokens generated.")),
      rejected(&r.counter("specula:request_rejected_total",
                          "Requests refused with 429 because the queue was full.")),
      ttft(&r.histogram("specula:time_to_first_token_seconds",
                        "Time from a request's arrival to its first token.", kLatencyBuckets)),
      itl(&r.histogram("specula:inter_token_latency_seconds",
                       "Time between successive token updates of a sequence (an update of a "
                       "speculative round may carry several tokens).",
                       kItlBuckets)),
      e2e(&r.histogram("specula:e2e_request_latency_seconds",
                       "Time from a request's arrival to its last token.", kLatencyBuckets)),
      num_drafts(&r.counter("specula:spec_decode_num_drafts_total",
                            "Speculative rounds that drafted at least one token.")),
      draft_tokens(&r.counter("specula:spec_decode_num_draft_tokens_total", "Tokens drafted.")),
      accepted_tokens(&r.counter("specula:spec_decode_num_accepted_tokens_total",
                                 "Drafted tokens the target accepted.")) {
  for (const char* reason : {"stop", "length", "abort"}) success(reason);
}

metrics::Counter& Service::Metrics::success(const std::string& finished_reason) {
  return registry.counter("specula:request_success_total", "Requests finished, by reason.",
                          {{"finished_reason", finished_reason}});
}

metrics::Counter& Service::Metrics::accepted_at(size_t position) {
  while (accepted_per_pos.size() <= position) {
    accepted_per_pos.push_back(
        &registry.counter("specula:spec_decode_num_accepted_tokens_per_pos_total",
                          "Drafted tokens accepted, by draft position (0 = the first draft).",
                          {{"position", std::to_string(accepted_per_pos.size())}}));
  }
  return *accepted_per_pos[position];
}

void Service::run_engine() {
  started_unix_ = unix_seconds();
  while (true) {
    take_inbox();
    check_deadlines();
    if (engine_.has_work()) {
      std::span<const speculative::RequestUpdate> updates;
      try {
        updates = engine_.step();
      } catch (const std::exception& e) {
        // The engine's state cannot be trusted after a failed step: end every
        // job with the error and cancel its rows, and keep serving.
        fmt::print(stderr, "specula serve: engine error: {}\n", e.what());
        for (auto& job : jobs_) {
          job->abort_status = 500;
          job->abort_type = "server_error";
          job->abort_message = fmt::format("engine error: {}", e.what());
          for (auto& c : job->choices)
            if (c->engine_id >= 0) engine_.cancel(c->engine_id);
        }
        continue;
      }
      for (const speculative::RequestUpdate& u : updates) dispatch(u);
      update_gauges();
      continue;
    }
    update_gauges();
    std::unique_lock lock(mu_);
    if (shutting_down_ && jobs_.empty() && inbox_.empty()) break;
    wake_.wait_for(lock, std::chrono::milliseconds(100),
                   [&] { return !inbox_.empty() || !cancels_.empty(); });
  }
}

void Service::take_inbox() {
  std::deque<std::shared_ptr<Job>> fresh;
  std::vector<std::shared_ptr<Job>> cancels;
  bool past_grace = false;
  {
    std::lock_guard lock(mu_);
    fresh.swap(inbox_);
    cancels.swap(cancels_);
    past_grace = shutting_down_ && steady_seconds() >= shutdown_deadline_;
  }
  for (auto& job : fresh) start_job(std::move(job));
  for (auto& job : cancels) {
    if (job->client_gone) continue;
    job->client_gone = true;
    for (auto& c : job->choices)
      if (c->engine_id >= 0) engine_.cancel(c->engine_id);
  }
  if (past_grace) {
    for (auto& job : jobs_) {
      if (job->abort_status) continue;
      job->abort_status = 503;
      job->abort_type = "service_unavailable";
      job->abort_message = "the server shut down before this request finished";
      for (auto& c : job->choices)
        if (c->engine_id >= 0) engine_.cancel(c->engine_id);
    }
  }
}

void Service::start_job(std::shared_ptr<Job> job) {
  const api::CompletionRequest& req = job->request;
  uint64_t seed = req.params.seed;
  if (!req.has_seed) seed = (static_cast<uint64_t>(std::random_device{}()) << 32) ^ job->serial;
  std::vector<int32_t> stop_ids = req.params.stop_token_ids;
  if (!req.ignore_eos) {
    stop_ids.insert(stop_ids.end(), options_.eos_ids.begin(), options_.eos_ids.end());
    if (req.endpoint == api::Endpoint::kChat)
      stop_ids.insert(stop_ids.end(), options_.chat_stop_ids.begin(), options_.chat_stop_ids.end());
  }
  std::string refusal;
  for (int i = 0; i < req.n; ++i) {
    auto choice = std::make_unique<Choice>(tokenizer_, req.params.stop);
    choice->job = job.get();
    choice->index = i;
    speculative::DecodeRequest dr;
    dr.prompt = job->prompt;
    dr.params = req.params;
    dr.params.stop_token_ids = stop_ids;
    dr.params.seed = seed + static_cast<uint64_t>(i);
    dr.draft_tokens = req.speculative ? req.draft_tokens : 0;
    dr.logprobs = req.logprobs;
    speculative::Submission s = engine_.submit(std::move(dr));
    if (!s.accepted()) {
      refusal = s.error;
      break;
    }
    choice->engine_id = s.id;
    rows_[s.id] = choice.get();
    job->choices.push_back(std::move(choice));
  }
  job->open_choices = static_cast<int>(job->choices.size());
  if (!refusal.empty()) {
    // All of the job or none of it: cancel the choices already submitted.
    job->abort_status = 400;
    job->abort_type = "invalid_request_error";
    job->abort_message = refusal;
    for (auto& c : job->choices) engine_.cancel(c->engine_id);
    jobs_.push_back(job);
    // With nothing submitted no update will come to finish it: answer now.
    if (job->choices.empty()) finish_job(*job);
    return;
  }
  if (job->request.stream && !job->client_gone) {
    job->exchange->start_stream(200, "text/event-stream");
    if (req.endpoint == api::Endpoint::kChat) {
      for (auto& c : job->choices)
        job->exchange->write(
            api::chat_role_event(job->id, job->created, options_.model_name, c->index));
    }
  }
  job->started = true;
  metrics_->prompt_tokens->inc(static_cast<double>(job->prompt.size() * job->choices.size()));
  jobs_.push_back(std::move(job));
}

void Service::dispatch(const speculative::RequestUpdate& update) {
  auto it = rows_.find(update.id);
  if (it == rows_.end()) return;
  Choice& choice = *it->second;
  Job& job = *choice.job;
  const double now = steady_seconds();
  const SamplingParams& params = job.request.params;
  if (!update.tokens.empty() && choice.stop_reason.empty()) {
    if (choice.first_token_at == 0) {
      choice.first_token_at = now;
      metrics_->ttft->observe(now - job.arrived);
    } else {
      metrics_->itl->observe(now - choice.last_token_at);
    }
    choice.last_token_at = now;
    std::string fresh;
    for (size_t t = 0; t < update.tokens.size() && choice.stop_reason.empty(); ++t) {
      const int32_t id = update.tokens[t];
      ++choice.completion_tokens;
      if (job.request.logprobs >= 0 && t < update.token_logprobs.size())
        choice.logprobs.push_back(token_logprob(update, t));
      // Stop tokens end generation without appearing in the text.
      if (contains(params.stop_token_ids, id) || is_stop_id(job, id)) continue;
      StopMatcher::Step step = choice.stops.feed(choice.detok.feed(id));
      fresh += step.emit;
      if (step.stopped) {
        choice.stop_reason = "stop";
        engine_.cancel(choice.engine_id);
      }
    }
    if (!fresh.empty() || !choice.logprobs.empty()) emit_text(job, choice, fresh, false);
  }
  if (update.finished) {
    std::string reason = choice.stop_reason.empty() ? update.finish_reason : choice.stop_reason;
    if (reason == "context") reason = "length";
    if (choice.stop_reason.empty() && reason != "cancelled") {
      // The text held back for a possible stop string or an unfinished character.
      std::string rest = choice.stops.feed(choice.detok.flush()).emit;
      if (!choice.stops.stopped()) rest += choice.stops.flush();
      if (!rest.empty()) emit_text(job, choice, rest, true);
    }
    finish_choice(job, choice, reason, update.stats);
  }
}

api::TokenLogprob Service::token_logprob(const speculative::RequestUpdate& u, size_t t) const {
  auto entry = [&](int32_t id, float value) {
    api::TokenLogprob e;
    e.token = tokenizer_.decode(std::span(&id, 1), /*skip_special_tokens=*/false);
    e.bytes.assign(e.token.begin(), e.token.end());
    e.logprob = value;
    return e;
  };
  api::TokenLogprob e = entry(u.tokens[t], u.token_logprobs[t]);
  const size_t n = static_cast<size_t>(u.top_logprobs);
  for (size_t j = 0; j < n && (t * n + j) < u.top_ids.size(); ++j)
    e.top.push_back(entry(u.top_ids[t * n + j], u.top_values[t * n + j]));
  return e;
}

bool Service::is_stop_id(const Job& job, int32_t id) const {
  const api::CompletionRequest& req = job.request;
  if (req.ignore_eos) return false;
  if (contains(options_.eos_ids, id)) return true;
  return req.endpoint == api::Endpoint::kChat && contains(options_.chat_stop_ids, id);
}

void Service::emit_text(Job& job, Choice& choice, const std::string& text, bool final_piece) {
  if (!job.request.stream) {
    choice.text += text;
    return;
  }
  if (job.client_gone || job.abort_status) {
    choice.logprobs.clear();
    return;
  }
  api::Choice delta;
  delta.index = choice.index;
  delta.text = text;
  if (job.request.logprobs >= 0) {
    delta.logprobs = std::move(choice.logprobs);
    choice.logprobs.clear();
  }
  const bool chat = job.request.endpoint == api::Endpoint::kChat;
  job.exchange->write(
      chat ? api::chat_delta_event(job.id, job.created, options_.model_name, delta)
           : api::completion_delta_event(job.id, job.created, options_.model_name, delta));
}

void Service::finish_choice(Job& job, Choice& choice, const std::string& reason,
                            const speculative::DecodeStats* stats) {
  if (choice.done) return;
  choice.done = true;
  choice.finish_reason = reason;
  if (stats) choice.stats = *stats;
  rows_.erase(choice.engine_id);
  choice.engine_id = -1;
  const double now = steady_seconds();
  // Counted at the end, from the same numbers as the usage, so the two agree.
  metrics_->generation_tokens->inc(static_cast<double>(choice.completion_tokens));
  const speculative::DecodeStats& s = choice.stats;
  if (!s.drafted_at.empty()) metrics_->num_drafts->inc(static_cast<double>(s.drafted_at[0]));
  metrics_->draft_tokens->inc(static_cast<double>(s.drafted));
  metrics_->accepted_tokens->inc(static_cast<double>(s.accepted));
  for (size_t p = 0; p < s.accepted_at.size(); ++p)
    metrics_->accepted_at(p).inc(static_cast<double>(s.accepted_at[p]));
  if (choice.first_token_at > 0) metrics_->e2e->observe(now - job.arrived);
  if (job.request.stream && !job.client_gone && !job.abort_status && reason != "cancelled") {
    api::Choice delta;
    delta.index = choice.index;
    delta.finish_reason = reason;
    const bool chat = job.request.endpoint == api::Endpoint::kChat;
    job.exchange->write(
        chat ? api::chat_delta_event(job.id, job.created, options_.model_name, delta)
             : api::completion_delta_event(job.id, job.created, options_.model_name, delta));
  }
  if (--job.open_choices == 0) finish_job(job);
}

void Service::finish_job(Job& job) {
  const double now = steady_seconds();
  const bool chat = job.request.endpoint == api::Endpoint::kChat;
  api::Usage usage;
  usage.prompt_tokens = static_cast<int64_t>(job.prompt.size());
  speculative::DecodeStats merged;
  for (auto& c : job.choices) {
    usage.completion_tokens += c->completion_tokens;
    merged.merge(c->stats);
  }
  if (options_.has_drafter && merged.drafted > 0) {
    api::SpeculativeUsage su;
    su.drafted = merged.drafted;
    su.accepted = merged.accepted;
    su.accepted_by_position = merged.accepted_at;
    su.tau = merged.mean_accepted_length();
    usage.speculative = su;
  }
  std::string outcome;
  if (job.client_gone) {
    outcome = "client disconnected";
    metrics_->success("abort").inc();
  } else if (job.abort_status) {
    outcome = fmt::format("error {}", job.abort_status);
    metrics_->success("abort").inc();
    if (job.request.stream && job.started) {
      job.exchange->write(api::error_event(job.abort_message, job.abort_type));
      job.exchange->write(api::kDoneEvent);
      job.exchange->end();
    } else {
      api::ApiError e{
          .status = job.abort_status, .message = job.abort_message, .type = job.abort_type};
      respond_error(*job.exchange, e);
    }
  } else {
    std::vector<api::Choice> choices;
    for (auto& c : job.choices) {
      metrics_->success(c->finish_reason == "stop" ? "stop" : "length").inc();
      outcome += (outcome.empty() ? "" : ",") + c->finish_reason;
      if (job.request.stream) continue;
      api::Choice out;
      out.index = c->index;
      out.text = std::move(c->text);
      out.finish_reason = c->finish_reason;
      if (job.request.logprobs >= 0) out.logprobs = std::move(c->logprobs);
      choices.push_back(std::move(out));
    }
    if (job.request.stream) {
      if (job.request.include_usage)
        job.exchange->write(
            api::usage_event(job.id, job.created, options_.model_name, chat, usage));
      job.exchange->write(api::kDoneEvent);
      job.exchange->end();
    } else {
      http::Response r;
      r.body =
          chat ? api::chat_completion_body(job.id, job.created, options_.model_name, choices, usage)
               : api::completion_body(job.id, job.created, options_.model_name, choices, usage);
      job.exchange->respond(std::move(r));
    }
  }
  if (options_.log_requests) {
    double ttft = 0;
    for (auto& c : job.choices)
      if (c->first_token_at > 0) ttft = std::max(ttft, c->first_token_at - job.arrived);
    std::string spec;
    if (usage.speculative)
      spec = fmt::format(", drafted {} accepted {} ({:.1f}%), tau {:.2f}", merged.drafted,
                         merged.accepted, 100.0 * merged.acceptance_rate(),
                         merged.mean_accepted_length());
    fmt::print(stderr,
               "request {}: n {}, prompt {} tokens, completion {} tokens, {:.3f} s (ttft {:.3f} "
               "s){}, {}\n",
               job.id, job.request.n, usage.prompt_tokens, usage.completion_tokens,
               now - job.arrived, ttft, spec, outcome);
  }
  {
    std::lock_guard lock(mu_);
    in_flight_choices_ -= job.request.n;
  }
  active_jobs_--;
  // The job leaves jobs_ (its choices' rows were already unmapped).
  auto it = std::find_if(jobs_.begin(), jobs_.end(), [&](auto& j) { return j.get() == &job; });
  if (it != jobs_.end()) jobs_.erase(it);
}

void Service::check_deadlines() {
  const double now = steady_seconds();
  for (auto& job : jobs_) {
    if (job->abort_status || job->client_gone || now < job->deadline) continue;
    job->abort_status = 504;
    job->abort_type = "timeout_error";
    job->abort_message = fmt::format("the request did not finish within {:g} s (--request-timeout)",
                                     options_.request_timeout_s);
    for (auto& c : job->choices)
      if (c->engine_id >= 0) engine_.cancel(c->engine_id);
  }
}

void Service::update_gauges() {
  const speculative::KvPoolInfo pool = engine_.kv_pool();
  metrics_->running->set(pool.rows_in_use);
  metrics_->waiting->set(pool.waiting);
  metrics_->kv_usage->set(pool.max_rows ? static_cast<double>(pool.rows_in_use) / pool.max_rows
                                        : 0.0);
}

}  // namespace specula::server
