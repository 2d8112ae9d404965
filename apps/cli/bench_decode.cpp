// SPDX-License-Identifier: Apache-2.0
// `specula bench`: plain vs speculative decoding on the same prompts, per batch
// size and draft length, through the engine.
#include <fmt/format.h>
#include <fmt/ranges.h>
#include <nlohmann/json.hpp>

#include <algorithm>
#include <charconv>
#include <chrono>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <memory>
#include <optional>
#include <span>
#include <sstream>

#include <unistd.h>

#include "apps/cli/bench.h"
#include "apps/cli/commands.h"
#include "apps/cli/setup.h"
#include "engine/backend/backends.h"
#include "engine/model/gemma4/presets.h"
#include "engine/speculative/engine.h"

namespace specula::cli {
// ---------------------------------------------------------------------------- decode loop

nlohmann::json acceptance_by_position(const speculative::DecodeStats& s) {
  nlohmann::json by_pos = nlohmann::json::array();
  for (size_t i = 0; i < s.drafted_at.size(); ++i) {
    by_pos.push_back(s.drafted_at[i] ? static_cast<double>(s.accepted_at[i]) / s.drafted_at[i]
                                     : 0.0);
  }
  return by_pos;
}

namespace {

// "0.84 0.60 0.39" (the table's last column); "-" for none.
std::string by_position_text(const speculative::DecodeStats& s) {
  if (s.drafted_at.empty()) return "-";
  std::string out;
  for (size_t i = 0; i < s.drafted_at.size(); ++i) {
    const double rate =
        s.drafted_at[i] ? static_cast<double>(s.accepted_at[i]) / s.drafted_at[i] : 0.0;
    out += fmt::format("{}{:.2f}", i ? " " : "", rate);
  }
  return out;
}

}  // namespace

nlohmann::json decode_table(const BenchArgs& a, const LoadedModels& m,
                            const std::vector<int>& batches, const BenchPromptSet* prompt_set) {
  nlohmann::json rows = nlohmann::json::array();
  if (!a.json) {
    fmt::print("{:<12} {:>5} {:>3} {:>12} {:>12} {:>8} {:>8} {:>8}  {}\n", "mode", "batch", "k",
               "prefill t/s", "decode t/s", "tau", "accept", "speedup", "accept by position");
  }
  for (int batch : batches) {
    std::vector<speculative::DecodeRequest> reqs;
    for (auto& p : prompt_set ? prompt_set->ids : make_prompts(a, m, batch)) {
      speculative::DecodeRequest r{.prompt = p, .params = {}};
      r.params.temperature = a.temperature;
      r.params.top_p = a.top_p;
      r.params.top_k = a.top_k;
      r.params.min_p = a.min_p;
      r.params.repetition_penalty = a.repetition_penalty;
      r.params.presence_penalty = a.presence_penalty;
      r.params.frequency_penalty = a.frequency_penalty;
      r.params.seed = reqs.size();
      r.params.max_tokens = a.gen_tokens;
      reqs.push_back(std::move(r));
    }
    // The requests decode in groups of `batch`, in order, each group as one
    // batch (a prompt set has more prompts than rows; without one there is
    // one group). Every request generates --gen-tokens (no stop tokens), so a
    // group's rows finish together and its prefill and decode times add up.
    std::vector<std::pair<size_t, size_t>> groups;
    for (size_t g = 0; g < reqs.size(); g += static_cast<size_t>(batch))
      groups.emplace_back(g, std::min(reqs.size(), g + static_cast<size_t>(batch)));
    // Each mode runs twice on one Engine and the second run counts: the first
    // records the step graphs of its shapes (a cost of the first requests,
    // not of decoding), which the second replays. The first runs the first
    // group and a last, smaller one (the shapes there are). Also counted in
    // the second run: its rounds (of whole batches, summed over the groups)
    // and target forwards replayed.
    std::vector<std::pair<size_t, size_t>> warmup = {groups.front()};
    const auto group_size = [](const std::pair<size_t, size_t>& g) { return g.second - g.first; };
    if (groups.size() > 1 && group_size(groups.back()) != group_size(groups.front()))
      warmup.push_back(groups.back());
    struct Measured {
      speculative::DecodeStats stats;
      int64_t rounds = 0, target_replays = 0;
      std::vector<speculative::DecodeResult> results;  // of the counted run, per request
    };
    auto measure = [&](Drafter* drafter, int k, bool sched = false) {
      Measured out;
      speculative::Engine engine(
          *m.target, drafter,
          {.schedule = {.draft_tokens = std::max(k, 1)},
           .max_rows = batch,
           .modes = {.host_rounds = a.host_rounds, .host_sampling = a.host_sampling},
           .scheduler = sched ? a.scheduler_resolved : speculative::VerifySchedulerOptions{}});
      if (sched && !a.json) {
        if (const std::string note = unscheduled_note(a.scheduler, engine, drafter); !note.empty())
          fmt::print(stderr, "{}\n", note);
      }
      for (int run = 0; run < 2; ++run) {
        out = {};
        const int64_t target_replays = m.target->graph_replays();
        for (const auto& [begin, end] : run == 0 ? warmup : groups) {
          std::vector<speculative::DecodeResult> results = speculative::decode(
              engine,
              std::span<const speculative::DecodeRequest>(reqs).subspan(begin, end - begin));
          speculative::DecodeStats group;
          int64_t rounds = 0;
          for (auto& r : results) {
            group.merge(r.stats);
            rounds = std::max(rounds, r.stats.rounds);
            out.results.push_back(std::move(r));
          }
          // merge() keeps the longest request's times: a group's wall times, which add up.
          const double prefill = out.stats.prefill_seconds + group.prefill_seconds;
          const double decode = out.stats.decode_seconds + group.decode_seconds;
          out.stats.merge(group);
          out.stats.prefill_seconds = prefill;
          out.stats.decode_seconds = decode;
          out.rounds += rounds;
        }
        out.target_replays = m.target->graph_replays() - target_replays;
      }
      return out;
    };
    const Measured plain_run = measure(nullptr, 0);
    const speculative::DecodeStats& plain = plain_run.stats;
    if (m.replay) {
      // The replay proposes the target's greedy output of these very requests.
      m.replay->clear_references();
      for (size_t i = 0; i < reqs.size(); ++i) {
        std::vector<int32_t> seq = reqs[i].prompt;
        seq.insert(seq.end(), plain_run.results[i].tokens.begin(),
                   plain_run.results[i].tokens.end());
        m.replay->add_reference(std::move(seq));
      }
    }
    // Tokens after each request's first (which comes with its prefill) per
    // second of decoding.
    const auto requests = static_cast<int64_t>(reqs.size());
    auto decode_tps = [&](const speculative::DecodeStats& s) {
      return s.decode_seconds > 0 ? (s.generated_tokens - requests) / s.decode_seconds : 0.0;
    };
    const double plain_tps = decode_tps(plain);
    auto report = [&](const char* mode, int k, const Measured& measured) {
      const speculative::DecodeStats& s = measured.stats;
      const double tps = decode_tps(s);
      const double prefill_tps = s.prefill_seconds > 0 ? s.prompt_tokens / s.prefill_seconds : 0;
      const double speedup = plain_tps > 0 ? tps / plain_tps : 0;
      rows.push_back({{"mode", mode},
                      {"batch", batch},
                      {"draft_tokens", k},
                      {"prompts", requests},
                      {"prompt_tokens", s.prompt_tokens},
                      {"generated_tokens", s.generated_tokens},
                      {"prefill_tokens_per_second", prefill_tps},
                      {"decode_tokens_per_second", tps},
                      {"plain_decode_tokens_per_second", plain_tps},
                      {"tau", s.mean_accepted_length()},
                      {"acceptance_rate", s.acceptance_rate()},
                      {"speedup", speedup},
                      {"drafted", s.drafted},
                      {"accepted", s.accepted},
                      {"acceptance_by_position", acceptance_by_position(s)},
                      {"drafted_at", s.drafted_at},
                      {"accepted_at", s.accepted_at},
                      {"rounds", measured.rounds},
                      {"target_graph_replays", measured.target_replays}});
      if (!a.json) {
        fmt::print("{:<12} {:>5} {:>3} {:>12.1f} {:>12.1f} {:>8.2f} {:>7.1f}% {:>7.2f}x  {}\n",
                   mode, batch, k, prefill_tps, tps, s.mean_accepted_length(),
                   100 * s.acceptance_rate(), speedup, by_position_text(s));
      }
    };
    report("plain", 0, plain_run);
    if (m.draft_source) {
      const char* mode = m.replay ? "replay(sim)" : "speculative";
      const bool sched = a.scheduler_resolved.mode != speculative::SchedulerMode::kOff;
      for (int k : a.draft_tokens) {
        const Measured unscheduled = measure(m.draft_source.get(), k);
        report(mode, k, unscheduled);
        if (!sched) continue;
        // The same rows with the verify scheduler: what it cut, and that
        // the tokens did not change (greedy rows: never; sampled rows may
        // differ, in distribution they do not).
        const Measured scheduled = measure(m.draft_source.get(), k, true);
        report(m.replay ? "replay+sched" : "spec+sched", k, scheduled);
        int64_t differ = 0;
        for (size_t i = 0; i < reqs.size(); ++i) {
          differ += scheduled.results[i].tokens != unscheduled.results[i].tokens;
        }
        const speculative::DecodeStats& s = scheduled.stats;
        rows.back()["scheduled_cut"] = s.scheduled_cut;
        rows.back()["scheduled_rounds"] = s.scheduled_rounds;
        rows.back()["pruned"] = s.pruned;
        rows.back()["requests_differing_from_unscheduled"] = differ;
        if (!a.json) {
          fmt::print(
              "  scheduler: cut {} drafts ({} verified, {} pruned) in {} row-rounds; {} of "
              "{} requests differ from the unscheduled run\n",
              s.scheduled_cut, s.drafted, s.pruned, s.scheduled_rounds, differ, reqs.size());
        }
      }
    }
  }
  return rows;
}

}  // namespace specula::cli
