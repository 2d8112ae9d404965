// SPDX-License-Identifier: Apache-2.0
// `specula bench-serve`: a load generator for a running OpenAI-compatible
// server on this machine (`specula serve`, or any server with streaming
// completions), with vLLM `vllm bench serve`'s flag names where they exist.
//
// One phase per --max-concurrency value: that many worker threads take request
// numbers from a shared counter and issue them back to back (one connection
// per request), until --num-prompts requests are done or --duration-limit
// seconds have passed; requests still in flight then are abandoned (not
// counted as errors). Every request streams ("stream": true, usage included,
// "ignore_eos": true so that each produces --max-tokens tokens). Measured per
// request, from just before connecting:
//   TTFT  until the first event that carries content (text / delta.content),
//   ITL   between successive content events (under speculation an event may
//         carry several tokens, so ITLs are per event, not per token),
//   E2E   until "data: [DONE]",
//   TPOT  (E2E - TTFT) / (usage.completion_tokens - 1).
// Failed requests are counted by kind: "connect", "timeout", "http NNN", "error
// event" (a {"error": ...} event), "protocol" (a malformed response or event, a
// stream without [DONE] or without usage). Only loopback hosts are accepted.
#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <fstream>
#include <map>
#include <memory>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "apps/cli/bench.h"
#include "apps/cli/commands.h"
#include "apps/cli/http_client.h"
#include "engine/core/error.h"

namespace specula::cli {
namespace {

using http::Clock;

constexpr int kMaxPrompts = 10000;
constexpr int kMaxConcurrency = 1024;

struct BenchServeArgs {
  std::string host = "127.0.0.1";
  int port = 8080;
  std::string endpoint = "/v1/completions";
  std::string model;
  std::vector<int> concurrency = {1, 8, 32, 64};
  int num_prompts = 64;
  std::string dataset_path;
  int random_input_len = 64;
  int max_tokens = 128;
  double temperature = 0;
  bool no_speculation = false;
  double timeout = 120;
  double duration_limit = 600;
  std::string json_path;
  uint64_t seed = 0;
};

// What one request measured. Times in seconds.
struct RequestRecord {
  bool started = false;
  bool ok = false;
  bool abandoned = false;  // cut off by the phase's --duration-limit
  std::string error_kind, error_message;
  double ttft = NAN, e2e = NAN, tpot = NAN;
  std::vector<double> itl;
  int64_t content_events = 0;
  int64_t prompt_tokens = -1, completion_tokens = -1;
  double tau = NAN;  // usage.speculative.tau, when present
};

struct PhaseResult {
  int concurrency = 0;
  double seconds = 0;
  std::vector<RequestRecord> requests;
};

// Synthetic prompts: `words` words drawn from a fixed list by a seeded
// generator (a stand-in for vLLM's random token ids: no tokenizer here).
std::vector<std::string> synthetic_prompts(int count, int words, uint64_t seed) {
  static const char* const kWords[] = {
      "the",     "model",   "reads",   "a",      "long",     "story",   "about",   "rivers",
      "and",     "cities",  "where",   "people", "build",    "bridges", "over",    "water",
      "every",   "summer",  "light",   "falls",  "on",       "green",   "fields",  "while",
      "engines", "hum",     "quietly", "under",  "old",      "stone",   "roofs",   "of",
      "small",   "towns",   "near",    "hills",  "children", "count",   "stars",   "before",
      "sleep",   "because", "numbers", "tell",   "stories",  "too",     "code",    "runs",
      "fast",    "when",    "data",    "fits",   "in",       "memory",  "clear",   "simple",
      "words",   "carry",   "meaning", "across", "time",     "through", "careful", "thought"};
  constexpr size_t kCount = sizeof(kWords) / sizeof(kWords[0]);
  std::mt19937_64 rng(seed);
  std::uniform_int_distribution<size_t> pick(0, kCount - 1);
  std::vector<std::string> out;
  out.reserve(static_cast<size_t>(count));
  for (int i = 0; i < count; ++i) {
    std::string p;
    for (int w = 0; w < words; ++w) {
      if (w > 0) p += ' ';
      p += kWords[pick(rng)];
    }
    out.push_back(std::move(p));
  }
  return out;
}

// DeepSpec's prompt layout: one JSON object a line, {"turns": ["first user
// turn", ...]}; the first turn is the prompt. Blank lines are skipped.
std::vector<std::string> dataset_prompts(const std::string& path) {
  std::ifstream in(path);
  if (!in) fail("--dataset-path {}: cannot open the file", path);
  std::vector<std::string> out;
  std::string line;
  for (int n = 1; std::getline(in, line); ++n) {
    if (line.find_first_not_of(" \t\r") == std::string::npos) continue;
    const nlohmann::json j = nlohmann::json::parse(line, nullptr, /*allow_exceptions=*/false);
    if (j.is_discarded()) fail("--dataset-path {}:{}: not a JSON object", path, n);
    if (!j.is_object() || !j.contains("turns") || !j["turns"].is_array() || j["turns"].empty() ||
        !j["turns"][0].is_string()) {
      fail("--dataset-path {}:{}: expected {{\"turns\": [\"prompt\", ...]}} (DeepSpec's layout)",
           path, n);
    }
    out.push_back(j["turns"][0].get<std::string>());
  }
  if (out.empty()) fail("--dataset-path {}: no prompts in the file", path);
  return out;
}

bool is_chat(const BenchServeArgs& a) {
  return a.endpoint == "/v1/chat/completions";
}

std::string request_body(const BenchServeArgs& a, const std::string& prompt, int index) {
  nlohmann::json j;
  if (!a.model.empty()) j["model"] = a.model;
  if (is_chat(a)) {
    j["messages"] = nlohmann::json::array({{{"role", "user"}, {"content", prompt}}});
  } else {
    j["prompt"] = prompt;
  }
  j["max_tokens"] = a.max_tokens;
  j["temperature"] = a.temperature;
  if (a.temperature > 0) j["seed"] = a.seed + static_cast<uint64_t>(index);
  j["ignore_eos"] = true;
  j["stream"] = true;
  j["stream_options"] = {{"include_usage", true}};
  if (a.no_speculation) j["speculative"] = {{"enabled", false}};
  return j.dump();
}

double seconds_between(Clock::time_point a, Clock::time_point b) {
  return std::chrono::duration<double>(b - a).count();
}

// One request, start to end; never throws for anything the server does.
RequestRecord run_request(const BenchServeArgs& a, const http::Address& address,
                          const std::string& body, Clock::time_point phase_end) {
  RequestRecord r;
  r.started = true;
  const Clock::time_point t0 = Clock::now();
  const auto own_deadline =
      t0 + std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(a.timeout));
  const bool phase_cuts = phase_end < own_deadline;
  const Clock::time_point deadline = phase_cuts ? phase_end : own_deadline;
  const bool chat = is_chat(a);

  int status = 0;
  std::string error_body;  // of a non-200 response, up to 4 KiB
  http::SseSplitter sse;
  std::vector<std::string> events;
  bool done = false;
  Clock::time_point last_content{};
  auto set_error = [&](const std::string& kind, const std::string& message) {
    if (r.error_kind.empty()) {
      r.error_kind = kind;
      r.error_message = message;
    }
  };
  auto on_head = [&](const http::ResponseHead& head) { status = head.status; };
  auto on_body = [&](std::string_view bytes) {
    if (status != 200) {
      error_body.append(bytes.substr(0, 4096 - std::min<size_t>(4096, error_body.size())));
      return true;
    }
    events.clear();
    sse.feed(bytes, events);
    for (const std::string& ev : events) {
      const Clock::time_point now = Clock::now();
      if (ev == "[DONE]") {
        r.e2e = seconds_between(t0, now);
        done = true;
        return false;
      }
      const nlohmann::json j = nlohmann::json::parse(ev, nullptr, /*allow_exceptions=*/false);
      if (j.is_discarded() || !j.is_object()) {
        set_error("protocol", fmt::format("an event that is not a JSON object: {:.80}", ev));
        return false;
      }
      if (j.contains("error")) {
        const auto& e = j["error"];
        set_error("error event", e.is_object() && e.contains("message") && e["message"].is_string()
                                     ? e["message"].get<std::string>()
                                     : e.dump());
        return false;
      }
      if (j.contains("usage") && j["usage"].is_object()) {
        const auto& u = j["usage"];
        if (u.contains("completion_tokens") && u["completion_tokens"].is_number_integer())
          r.completion_tokens = u["completion_tokens"].get<int64_t>();
        if (u.contains("prompt_tokens") && u["prompt_tokens"].is_number_integer())
          r.prompt_tokens = u["prompt_tokens"].get<int64_t>();
        if (u.contains("speculative") && u["speculative"].is_object() &&
            u["speculative"].contains("tau") && u["speculative"]["tau"].is_number())
          r.tau = u["speculative"]["tau"].get<double>();
      }
      if (j.contains("choices") && j["choices"].is_array() && !j["choices"].empty() &&
          j["choices"][0].is_object()) {
        const auto& c = j["choices"][0];
        const nlohmann::json* text = nullptr;
        if (chat && c.contains("delta") && c["delta"].is_object() && c["delta"].contains("content"))
          text = &c["delta"]["content"];
        if (!chat && c.contains("text")) text = &c["text"];
        if (text && text->is_string() && !text->get_ref<const std::string&>().empty()) {
          if (r.content_events == 0) {
            r.ttft = seconds_between(t0, now);
          } else {
            r.itl.push_back(seconds_between(last_content, now));
          }
          last_content = now;
          ++r.content_events;
        }
      }
    }
    return true;
  };
  try {
    http::post(address, a.endpoint, "application/json", body, deadline, on_head, on_body);
  } catch (const http::HttpError& e) {
    if (e.kind() == http::HttpErrorKind::kTimeout && phase_cuts) {
      r.abandoned = true;
      return r;
    }
    set_error(e.kind() == http::HttpErrorKind::kConnect   ? "connect"
              : e.kind() == http::HttpErrorKind::kTimeout ? "timeout"
                                                          : "protocol",
              e.what());
  }
  if (r.error_kind.empty() && status != 200) {
    std::string message = error_body;
    const nlohmann::json j = nlohmann::json::parse(error_body, nullptr, false);
    if (j.is_object() && j.contains("error") && j["error"].is_object() &&
        j["error"].contains("message") && j["error"]["message"].is_string())
      message = j["error"]["message"].get<std::string>();
    set_error(fmt::format("http {}", status), message);
  }
  if (r.error_kind.empty() && !done) set_error("protocol", "the stream ended without [DONE]");
  if (r.error_kind.empty() && r.completion_tokens < 0)
    set_error("protocol",
              "no usage.completion_tokens in the stream (stream_options.include_usage)");
  if (r.error_kind.empty() && r.content_events == 0 && r.completion_tokens > 0)
    set_error("protocol", "usage counts tokens but no event carried content");
  if (!r.error_kind.empty()) return r;
  r.ok = true;
  if (r.completion_tokens > 1 && r.content_events > 0)
    r.tpot = (r.e2e - r.ttft) / static_cast<double>(r.completion_tokens - 1);
  return r;
}

PhaseResult run_phase(const BenchServeArgs& a, const http::Address& address,
                      const std::vector<std::string>& bodies, int concurrency) {
  PhaseResult out;
  out.concurrency = concurrency;
  out.requests.resize(bodies.size());
  const Clock::time_point start = Clock::now();
  const Clock::time_point phase_end = start + std::chrono::duration_cast<Clock::duration>(
                                                  std::chrono::duration<double>(a.duration_limit));
  std::atomic<size_t> next{0};
  auto worker = [&] {
    for (;;) {
      if (Clock::now() >= phase_end) return;
      const size_t i = next.fetch_add(1);
      if (i >= bodies.size()) return;
      out.requests[i] = run_request(a, address, bodies[i], phase_end);
    }
  };
  std::vector<std::thread> threads;
  const size_t n = std::min(static_cast<size_t>(concurrency), bodies.size());
  threads.reserve(n);
  for (size_t t = 0; t < n; ++t) threads.emplace_back(worker);
  for (std::thread& t : threads) t.join();
  out.seconds = seconds_between(start, Clock::now());
  return out;
}

// {"mean", "p50", "p90", "p99"} in milliseconds (null without samples).
nlohmann::json ms_summary(const std::vector<double>& seconds) {
  auto ms = [](double s) { return std::isnan(s) ? nlohmann::json() : nlohmann::json(1e3 * s); };
  return {{"mean", ms(mean(seconds))},
          {"p50", ms(percentile(seconds, 0.5))},
          {"p90", ms(percentile(seconds, 0.9))},
          {"p99", ms(percentile(seconds, 0.99))}};
}

struct PhaseSummary {
  int completed = 0, errors = 0, abandoned = 0, not_started = 0;
  int64_t output_tokens = 0;
  std::vector<double> ttft, tpot, itl, e2e, tau;
  std::map<std::string, int> errors_by_kind;
  std::map<std::string, std::string> first_error;  // by kind
};

PhaseSummary summarize(const PhaseResult& p) {
  PhaseSummary s;
  for (const RequestRecord& r : p.requests) {
    if (!r.started) {
      ++s.not_started;
    } else if (r.abandoned) {
      ++s.abandoned;
    } else if (!r.ok) {
      ++s.errors;
      if (s.errors_by_kind[r.error_kind]++ == 0) s.first_error[r.error_kind] = r.error_message;
    } else {
      ++s.completed;
      s.output_tokens += r.completion_tokens;
      s.ttft.push_back(r.ttft);
      s.e2e.push_back(r.e2e);
      if (!std::isnan(r.tpot)) s.tpot.push_back(r.tpot);
      s.itl.insert(s.itl.end(), r.itl.begin(), r.itl.end());
      if (!std::isnan(r.tau)) s.tau.push_back(r.tau);
    }
  }
  return s;
}

nlohmann::json phase_json(const PhaseResult& p, const PhaseSummary& s) {
  nlohmann::json requests = nlohmann::json::array();
  for (const RequestRecord& r : p.requests) {
    auto num = [](double x) { return std::isnan(x) ? nlohmann::json() : nlohmann::json(x); };
    nlohmann::json q = {{"started", r.started},
                        {"ok", r.ok},
                        {"abandoned", r.abandoned},
                        {"ttft_s", num(r.ttft)},
                        {"e2e_s", num(r.e2e)},
                        {"tpot_s", num(r.tpot)},
                        {"itl_s", r.itl},
                        {"content_events", r.content_events},
                        {"prompt_tokens", r.prompt_tokens},
                        {"completion_tokens", r.completion_tokens},
                        {"tau", num(r.tau)}};
    if (!r.error_kind.empty()) {
      q["error_kind"] = r.error_kind;
      q["error"] = r.error_message;
    }
    requests.push_back(std::move(q));
  }
  const double secs = p.seconds;
  return {{"concurrency", p.concurrency},
          {"num_prompts", p.requests.size()},
          {"completed", s.completed},
          {"errors", s.errors},
          {"errors_by_kind", s.errors_by_kind},
          {"first_error_by_kind", s.first_error},
          {"abandoned", s.abandoned},
          {"not_started", s.not_started},
          {"duration_s", secs},
          {"total_output_tokens", s.output_tokens},
          {"request_throughput", secs > 0 ? s.completed / secs : 0.0},
          {"output_throughput", secs > 0 ? static_cast<double>(s.output_tokens) / secs : 0.0},
          {"ttft_ms", ms_summary(s.ttft)},
          {"tpot_ms", ms_summary(s.tpot)},
          {"itl_ms", ms_summary(s.itl)},
          {"e2el_ms", ms_summary(s.e2e)},
          {"mean_tau", s.tau.empty() ? nlohmann::json() : nlohmann::json(mean(s.tau))},
          {"requests", requests}};
}

// "12.3" in milliseconds, or "-" without samples.
std::string ms_cell(const std::vector<double>& v, double p) {
  const double x = percentile(v, p);
  return std::isnan(x) ? "-" : fmt::format("{:.1f}", 1e3 * x);
}

void print_table(const BenchServeArgs& a, const std::vector<PhaseResult>& phases,
                 const std::vector<PhaseSummary>& sums) {
  fmt::print("bench-serve: {} on {}:{}, {} requests a phase, {} output tokens each{}\n", a.endpoint,
             a.host, a.port, a.num_prompts, a.max_tokens,
             a.no_speculation ? ", speculation off" : "");
  fmt::print("{:>46} | {:^26} | {:^20} | {:^20} |\n", "", "TTFT ms", "TPOT ms", "ITL ms");
  fmt::print(
      "{:>5} {:>6} {:>6} {:>8} {:>7} {:>9} | {:>8} {:>8} {:>8} | {:>6} {:>6} {:>6} | {:>6} {:>6} "
      "{:>6} | {:>5}\n",
      "conc", "done", "errors", "time s", "req/s", "out tok/s", "p50", "p90", "p99", "p50", "p90",
      "p99", "p50", "p90", "p99", "tau");
  for (size_t i = 0; i < phases.size(); ++i) {
    const PhaseResult& p = phases[i];
    const PhaseSummary& s = sums[i];
    const double secs = p.seconds;
    fmt::print(
        "{:>5} {:>6} {:>6} {:>8.2f} {:>7.2f} {:>9.1f} | {:>8} {:>8} {:>8} | {:>6} {:>6} {:>6} | "
        "{:>6} {:>6} {:>6} | {:>5}\n",
        p.concurrency, s.completed, s.errors, secs, secs > 0 ? s.completed / secs : 0.0,
        secs > 0 ? static_cast<double>(s.output_tokens) / secs : 0.0, ms_cell(s.ttft, 0.5),
        ms_cell(s.ttft, 0.9), ms_cell(s.ttft, 0.99), ms_cell(s.tpot, 0.5), ms_cell(s.tpot, 0.9),
        ms_cell(s.tpot, 0.99), ms_cell(s.itl, 0.5), ms_cell(s.itl, 0.9), ms_cell(s.itl, 0.99),
        s.tau.empty() ? "-" : fmt::format("{:.2f}", mean(s.tau)));
  }
  for (size_t i = 0; i < phases.size(); ++i) {
    const PhaseSummary& s = sums[i];
    if (s.abandoned > 0 || s.not_started > 0) {
      fmt::print(
          "  concurrency {}: --duration-limit {} s passed: {} requests abandoned, {} not "
          "started\n",
          phases[i].concurrency, a.duration_limit, s.abandoned, s.not_started);
    }
    for (const auto& [kind, count] : s.errors_by_kind) {
      fmt::print("  concurrency {}: {} x {} (first: {:.200})\n", phases[i].concurrency, count, kind,
                 s.first_error.at(kind));
    }
  }
}

void validate(const BenchServeArgs& a) {
  if (a.num_prompts < 1 || a.num_prompts > kMaxPrompts)
    fail("--num-prompts must be in [1, {}], got {}", kMaxPrompts, a.num_prompts);
  if (a.concurrency.empty()) fail("--max-concurrency needs at least one value");
  for (int c : a.concurrency)
    if (c < 1 || c > kMaxConcurrency)
      fail("--max-concurrency values must be in [1, {}], got {}", kMaxConcurrency, c);
  if (a.max_tokens < 1) fail("--max-tokens must be >= 1, got {}", a.max_tokens);
  if (a.random_input_len < 1 || a.random_input_len > 1000000)
    fail("--random-input-len must be in [1, 1000000], got {}", a.random_input_len);
  if (!(a.temperature >= 0) || !std::isfinite(a.temperature))
    fail("--temperature must be >= 0, got {}", a.temperature);
  if (!(a.timeout > 0) || !std::isfinite(a.timeout))
    fail("--timeout must be > 0 seconds, got {}", a.timeout);
  if (!(a.duration_limit > 0) || !std::isfinite(a.duration_limit))
    fail("--duration-limit must be > 0 seconds, got {}", a.duration_limit);
}

void run_bench_serve(const BenchServeArgs& a) {
  validate(a);
  const std::optional<http::Address> address = http::loopback_address(a.host, a.port);
  if (!address) {
    fail(
        "--host '{}': bench-serve only connects to this machine (127.0.0.0/8, ::1 or "
        "localhost); refusing to send load elsewhere",
        a.host);
  }
  const std::vector<std::string> prompts =
      a.dataset_path.empty() ? synthetic_prompts(a.num_prompts, a.random_input_len, a.seed)
                             : dataset_prompts(a.dataset_path);
  std::vector<std::string> bodies;
  bodies.reserve(static_cast<size_t>(a.num_prompts));
  for (int i = 0; i < a.num_prompts; ++i)
    bodies.push_back(request_body(a, prompts[static_cast<size_t>(i) % prompts.size()], i));

  std::vector<PhaseResult> phases;
  std::vector<PhaseSummary> sums;
  for (const int c : a.concurrency) {
    phases.push_back(run_phase(a, *address, bodies, c));
    sums.push_back(summarize(phases.back()));
    const PhaseSummary& s = sums.back();
    fmt::print(stderr,
               "bench-serve: concurrency {}: {}/{} completed, {} errors, {} abandoned, {} not "
               "started, {:.2f} s\n",
               c, s.completed, a.num_prompts, s.errors, s.abandoned, s.not_started,
               phases.back().seconds);
  }
  print_table(a, phases, sums);

  if (!a.json_path.empty()) {
    nlohmann::json config = {{"host", a.host},
                             {"port", a.port},
                             {"endpoint", a.endpoint},
                             {"model", a.model},
                             {"max_concurrency", a.concurrency},
                             {"num_prompts", a.num_prompts},
                             {"dataset_path", a.dataset_path},
                             {"random_input_len", a.random_input_len},
                             {"max_tokens", a.max_tokens},
                             {"temperature", a.temperature},
                             {"speculation", !a.no_speculation},
                             {"timeout_s", a.timeout},
                             {"duration_limit_s", a.duration_limit},
                             {"seed", a.seed}};
    nlohmann::json out = {{"config", config}, {"phases", nlohmann::json::array()}};
    for (size_t i = 0; i < phases.size(); ++i)
      out["phases"].push_back(phase_json(phases[i], sums[i]));
    std::ofstream f(a.json_path);
    if (!f) fail("--json {}: cannot open the file for writing", a.json_path);
    f << out.dump(1) << '\n';
    if (!f) fail("--json {}: write failed", a.json_path);
  }
}

}  // namespace

void register_bench_serve(CLI::App& app) {
  auto args = std::make_shared<BenchServeArgs>();
  CLI::App* cmd = app.add_subcommand(
      "bench-serve",
      "Load-test a running OpenAI-compatible server on this machine (e.g. `specula serve`): "
      "streaming requests at fixed concurrencies; TTFT, TPOT, ITL, throughput, tau");
  cmd->add_option("--host", args->host,
                  "Server address: loopback only (127.0.0.0/8, ::1, localhost = 127.0.0.1)")
      ->capture_default_str();
  cmd->add_option("--port", args->port, "Server port")
      ->check(CLI::Range(1, 65535))
      ->capture_default_str();
  cmd->add_option("--endpoint", args->endpoint, "API path")
      ->check(CLI::IsMember({"/v1/completions", "/v1/chat/completions"}))
      ->capture_default_str();
  cmd->add_option("--model", args->model, "Sent as \"model\" (omitted when empty)");
  cmd->add_option("--max-concurrency", args->concurrency,
                  fmt::format("Concurrencies, one phase each (comma-separated): worker threads "
                              "issuing requests back to back; at most {}",
                              kMaxConcurrency))
      ->delimiter(',')
      ->capture_default_str();
  cmd->add_option("--num-prompts", args->num_prompts,
                  fmt::format("Requests per phase, at most {}", kMaxPrompts))
      ->capture_default_str();
  cmd->add_option("--dataset-path", args->dataset_path,
                  "JSONL prompts in DeepSpec's layout ({\"turns\": [\"...\", ...]}, the first "
                  "turn is the prompt), used in file order and cycled; default: synthetic "
                  "prompts");
  cmd->add_option("--random-input-len", args->random_input_len,
                  "Words per synthetic prompt (random words from a fixed list, seeded by --seed)")
      ->capture_default_str();
  cmd->add_option("--max-tokens", args->max_tokens,
                  "Sent as max_tokens, with \"ignore_eos\": true so every request produces that "
                  "many tokens")
      ->capture_default_str();
  cmd->add_option("--temperature", args->temperature,
                  "Sent as temperature; above 0 each request also sends \"seed\": --seed + its "
                  "index")
      ->capture_default_str();
  cmd->add_flag("--no-speculation", args->no_speculation,
                "Send \"speculative\": {\"enabled\": false} (specula's extension)");
  cmd->add_option("--timeout", args->timeout,
                  "Seconds a request may take, connecting included, before it counts as a "
                  "timeout error")
      ->capture_default_str();
  cmd->add_option("--duration-limit", args->duration_limit,
                  "Seconds a phase may take: then requests in flight are abandoned (not errors) "
                  "and the rest are not started")
      ->capture_default_str();
  cmd->add_option("--json", args->json_path,
                  "Write every result (config, per-phase summaries, per-request records) to this "
                  "JSON file");
  cmd->add_option("--seed", args->seed, "Seed of the synthetic prompts (and of sampled requests)")
      ->capture_default_str();
  cmd->footer(
      "Each request streams (\"stream\": true, \"stream_options\": {\"include_usage\": true}). "
      "Times run from just before connecting. TTFT: until the first event with content. ITL: "
      "between successive content events (an event may carry several tokens under "
      "speculation). TPOT: (E2E - TTFT) / (usage.completion_tokens - 1), E2E until [DONE]. tau: "
      "the mean of the requests' usage.speculative.tau. Errors by kind: connect, timeout, http "
      "NNN, error event, protocol (malformed, no [DONE], no usage). Percentiles interpolate "
      "linearly between ranks.");
  cmd->callback([args] { run_bench_serve(*args); });
}

}  // namespace specula::cli
