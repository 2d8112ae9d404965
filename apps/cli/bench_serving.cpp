// SPDX-License-Identifier: Apache-2.0
// `specula bench --serving`: a continuous-arrival workload on the engine.
// Requests arrive as a Poisson process (--request-rate per second; 0: all at
// once) with prompt and output lengths spread around --prompt-tokens and
// --gen-tokens (uniform within ± --range-ratio), and the engine serves them
// with continuous batching (--max-num-seqs rows, --max-batch-tokens per step).
// Reported per mode (plain, then speculative or replay): output tokens/s,
// requests/s, time to first token and inter-token latency (mean, p50, p99),
// time per output token, τ, and the speedup over plain. The same arrival
// times, prompts and lengths serve every mode.
#include <fmt/format.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <random>
#include <thread>
#include <unordered_map>

#include "apps/cli/bench.h"
#include "engine/speculative/engine.h"

namespace specula::cli {
namespace {

struct Workload {
  std::vector<speculative::DecodeRequest> requests;
  std::vector<double> arrival;  // seconds after the start, non-decreasing
};

Workload make_workload(const BenchArgs& a, const LoadedModels& m) {
  Workload w;
  std::mt19937_64 rng(a.seed);
  auto spread = [&](int mean) {
    const int lo = std::max(1, static_cast<int>(std::lround(mean * (1.0 - a.range_ratio))));
    const int hi = std::max(lo, static_cast<int>(std::lround(mean * (1.0 + a.range_ratio))));
    return std::uniform_int_distribution<int>(lo, hi)(rng);
  };
  // Prompts of the longest length, cut per request.
  BenchArgs longest = a;
  longest.prompt_tokens =
      std::max(16, static_cast<int>(std::lround(a.prompt_tokens * (1.0 + a.range_ratio))));
  const auto prompts = make_prompts(longest, m, a.num_prompts);
  std::exponential_distribution<double> gap(a.request_rate > 0 ? a.request_rate : 1.0);
  double t = 0;
  for (int i = 0; i < a.num_prompts; ++i) {
    speculative::DecodeRequest r;
    const int len = std::max(16, spread(a.prompt_tokens));
    r.prompt.assign(prompts[static_cast<size_t>(i)].begin(),
                    prompts[static_cast<size_t>(i)].begin() + len);
    r.params.temperature = 0.0f;
    r.params.max_tokens = spread(a.gen_tokens);
    w.requests.push_back(std::move(r));
    if (a.request_rate > 0) t += gap(rng);
    w.arrival.push_back(t);
  }
  return w;
}

struct ServingResult {
  double seconds = 0;
  int64_t output_tokens = 0;
  std::vector<double> ttft, itl, tpot;
  speculative::DecodeStats stats;  // merged over the requests
  std::vector<std::vector<int32_t>> tokens;
};

// Serves the workload in real time: requests are submitted when their
// arrival time has passed, and the engine steps while it has work.
ServingResult serve(const Workload& w, speculative::Engine& engine) {
  using Clock = std::chrono::steady_clock;
  ServingResult out;
  const size_t n = w.requests.size();
  out.tokens.resize(n);
  std::unordered_map<int64_t, size_t> index;
  std::vector<double> submitted(n, 0), last(n, -1), first(n, -1);
  const auto t0 = Clock::now();
  auto now = [&] { return std::chrono::duration<double>(Clock::now() - t0).count(); };
  size_t next = 0, finished = 0;
  while (finished < n) {
    const double t = now();
    for (; next < n && w.arrival[next] <= t; ++next) {
      const speculative::Submission s = engine.submit(w.requests[next]);
      if (!s.accepted()) fail("bench --serving: request {} refused: {}", next, s.error);
      index[s.id] = next;
      submitted[next] = t;
    }
    if (!engine.has_work()) {
      std::this_thread::sleep_for(std::chrono::duration<double>(w.arrival[next] - t));
      continue;
    }
    const auto updates = engine.step();
    const double at = now();
    for (const speculative::RequestUpdate& u : updates) {
      const size_t i = index.at(u.id);
      if (!u.tokens.empty()) {
        if (first[i] < 0) {
          first[i] = at;
          out.ttft.push_back(at - submitted[i]);
        } else {
          out.itl.push_back(at - last[i]);
        }
        last[i] = at;
        out.output_tokens += static_cast<int64_t>(u.tokens.size());
        out.tokens[i].insert(out.tokens[i].end(), u.tokens.begin(), u.tokens.end());
      }
      if (u.finished) {
        ++finished;
        out.stats.merge(*u.stats);
        const auto generated = static_cast<double>(out.tokens[i].size());
        if (generated > 1) out.tpot.push_back((last[i] - first[i]) / (generated - 1));
      }
    }
  }
  out.seconds = now();
  return out;
}

}  // namespace

nlohmann::json serving_table(const BenchArgs& a, LoadedModels& m) {
  const Workload w = make_workload(a, m);
  const int rows = a.max_num_seqs;
  auto options = [&](int k, bool sched) {
    return speculative::EngineOptions{
        .schedule = {.draft_tokens = std::max(k, 1)},
        .max_rows = rows,
        .max_batch_tokens = a.max_batch_tokens,
        .kv_memory = a.kv_memory,
        .max_waiting = a.num_prompts + 1,
        .modes = {},
        .scheduler = sched ? a.scheduler_resolved : speculative::VerifySchedulerOptions{}};
  };
  // Each engine first serves a warm-up of the first `rows` requests at once
  // (it records the step graphs of the common shapes), then the workload.
  auto run = [&](Drafter* drafter, int k, bool sched = false) {
    speculative::Engine engine(*m.target, drafter, options(k, sched));
    if (sched && !a.json) {
      if (const std::string note = unscheduled_note(a.scheduler, engine, drafter); !note.empty())
        fmt::print(stderr, "{}\n", note);
    }
    Workload warm;
    for (int i = 0; i < std::min(rows, a.num_prompts); ++i) {
      warm.requests.push_back(w.requests[static_cast<size_t>(i)]);
      warm.arrival.push_back(0);
    }
    serve(warm, engine);
    return serve(w, engine);
  };
  nlohmann::json out = nlohmann::json::array();
  if (!a.json) {
    fmt::print(
        "serving {} requests, {} req/s, prompts ~{} and outputs ~{} tokens (±{:.0f}%), {} rows, "
        "{} tokens a step\n",
        a.num_prompts, a.request_rate > 0 ? fmt::format("{:.2f}", a.request_rate) : "all at once",
        a.prompt_tokens, a.gen_tokens, 100 * a.range_ratio, rows,
        a.max_batch_tokens > 0 ? std::to_string(a.max_batch_tokens) : "unlimited");
    fmt::print("{:<12} {:>3} {:>9} {:>7} {:>9} {:>9} {:>9} {:>9} {:>9} {:>6} {:>8}\n", "mode", "k",
               "out t/s", "req/s", "ttft p50", "ttft p99", "itl p50", "itl p99", "tpot", "tau",
               "speedup");
  }
  double plain_tps = 0;
  auto report = [&](const char* mode, int k, const ServingResult& r) {
    const double tps = r.seconds > 0 ? r.output_tokens / r.seconds : 0;
    if (k == 0) plain_tps = tps;
    const double speedup = plain_tps > 0 ? tps / plain_tps : 0;
    out.push_back({{"mode", mode},
                   {"draft_tokens", k},
                   {"seconds", r.seconds},
                   {"output_tokens_per_second", tps},
                   {"requests_per_second", r.seconds > 0 ? a.num_prompts / r.seconds : 0},
                   {"ttft_mean_ms", 1e3 * mean(r.ttft)},
                   {"ttft_p50_ms", 1e3 * percentile(r.ttft, 0.5)},
                   {"ttft_p99_ms", 1e3 * percentile(r.ttft, 0.99)},
                   {"itl_mean_ms", 1e3 * mean(r.itl)},
                   {"itl_p50_ms", 1e3 * percentile(r.itl, 0.5)},
                   {"itl_p99_ms", 1e3 * percentile(r.itl, 0.99)},
                   {"tpot_mean_ms", 1e3 * mean(r.tpot)},
                   {"tau", r.stats.mean_accepted_length()},
                   {"acceptance_by_position", acceptance_by_position(r.stats)},
                   {"speedup", speedup}});
    if (!a.json) {
      fmt::print(
          "{:<12} {:>3} {:>9.1f} {:>7.2f} {:>7.1f}ms {:>7.1f}ms {:>7.1f}ms {:>7.1f}ms {:>7.2f}ms "
          "{:>6.2f} {:>7.2f}x\n",
          mode, k, tps, r.seconds > 0 ? a.num_prompts / r.seconds : 0,
          1e3 * percentile(r.ttft, 0.5), 1e3 * percentile(r.ttft, 0.99),
          1e3 * percentile(r.itl, 0.5), 1e3 * percentile(r.itl, 0.99), 1e3 * mean(r.tpot),
          r.stats.mean_accepted_length(), speedup);
    }
  };
  const ServingResult plain = run(nullptr, 0);
  report("plain", 0, plain);
  if (m.draft_source) {
    if (m.replay) {
      m.replay->clear_references();
      for (size_t i = 0; i < w.requests.size(); ++i) {
        std::vector<int32_t> seq = w.requests[i].prompt;
        seq.insert(seq.end(), plain.tokens[i].begin(), plain.tokens[i].end());
        m.replay->add_reference(std::move(seq));
      }
    }
    for (int k : a.draft_tokens) {
      const ServingResult r = run(m.draft_source.get(), k);
      report(m.replay ? "replay(sim)" : "speculative", k, r);
      // Speculation never changes greedy output; prefill on CUDA may still
      // depend on which prompts were prefilled together (arrivals are real
      // time), so a difference is reported rather than fatal.
      int64_t differ = 0;
      for (size_t i = 0; i < r.tokens.size(); ++i) differ += r.tokens[i] != plain.tokens[i];
      out.back()["requests_differing_from_plain"] = differ;
      if (differ > 0 && !a.json) {
        fmt::print("  note: {} of {} requests differ from the plain run\n", differ,
                   r.tokens.size());
      }
      if (a.scheduler_resolved.mode == speculative::SchedulerMode::kOff) continue;
      const ServingResult rs = run(m.draft_source.get(), k, true);
      report(m.replay ? "replay+sched" : "spec+sched", k, rs);
      int64_t differ_s = 0;
      for (size_t i = 0; i < rs.tokens.size(); ++i) differ_s += rs.tokens[i] != plain.tokens[i];
      out.back()["requests_differing_from_plain"] = differ_s;
      out.back()["scheduled_cut"] = rs.stats.scheduled_cut;
      out.back()["scheduled_rounds"] = rs.stats.scheduled_rounds;
      if (!a.json) {
        fmt::print(
            "  scheduler: cut {} drafts ({} verified) in {} row-rounds; {} of {} requests "
            "differ from the plain run\n",
            rs.stats.scheduled_cut, rs.stats.drafted, rs.stats.scheduled_rounds, differ_s,
            rs.tokens.size());
      }
    }
  }
  return out;
}

}  // namespace specula::cli
