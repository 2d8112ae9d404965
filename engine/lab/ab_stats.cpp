// SPDX-License-Identifier: Apache-2.0
#include "engine/lab/ab_stats.h"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>

#include "engine/core/error.h"

namespace specula::lab {
namespace {

// a / b, or 0 when b is 0: the seed's rule for every rate (no NaN reaches a
// report or a plot).
double ratio_or_zero(double a, double b) {
  return b == 0.0 ? 0.0 : a / b;
}

int64_t at(const std::vector<int64_t>& v, size_t i) {
  return i < v.size() ? v[i] : 0;
}

void check_run(const PromptRun& run, const std::string& arm, size_t prompt) {
  auto bad_count = [&](const char* field, int64_t value) {
    fail("A/B arm {} prompt {}: {} = {} must be >= 0", arm, prompt, field, value);
  };
  if (run.generated_tokens < 0) bad_count("generated_tokens", run.generated_tokens);
  if (run.drafted < 0) bad_count("drafted", run.drafted);
  if (run.accepted < 0) bad_count("accepted", run.accepted);
  if (run.target_calls < 0) bad_count("target_calls", run.target_calls);
  if (run.accepted > run.drafted) {
    fail("A/B arm {} prompt {}: accepted = {} exceeds drafted = {}", arm, prompt, run.accepted,
         run.drafted);
  }
  if (!std::isfinite(run.wall_ms) || run.wall_ms < 0.0) {
    fail("A/B arm {} prompt {}: wall_ms = {} must be finite and >= 0", arm, prompt, run.wall_ms);
  }
  const size_t n = std::max(run.drafted_by_pos.size(), run.accepted_by_pos.size());
  for (size_t i = 0; i < n; ++i) {
    const int64_t d = at(run.drafted_by_pos, i);
    const int64_t a = at(run.accepted_by_pos, i);
    if (d < 0 || a < 0 || a > d) {
      fail(
          "A/B arm {} prompt {}: position {} has drafted {} and accepted {} (need 0 <= accepted "
          "<= drafted)",
          arm, prompt, i, d, a);
    }
  }
}

}  // namespace

double run_acceptance(const PromptRun& run) {
  return ratio_or_zero(static_cast<double>(run.accepted), static_cast<double>(run.drafted));
}

double run_tok_per_sec(const PromptRun& run) {
  return ratio_or_zero(static_cast<double>(run.generated_tokens), run.wall_ms) * 1000.0;
}

ArmSummary summarize_arm(std::span<const PromptRun> runs, const std::string& arm) {
  ArmSummary s;
  s.prompts = static_cast<int64_t>(runs.size());
  for (size_t p = 0; p < runs.size(); ++p) {
    const PromptRun& run = runs[p];
    check_run(run, arm, p);
    s.generated_tokens += run.generated_tokens;
    s.drafted += run.drafted;
    s.accepted += run.accepted;
    s.target_calls += run.target_calls;
    s.wall_ms += run.wall_ms;
    const size_t n = std::max(run.drafted_by_pos.size(), run.accepted_by_pos.size());
    if (n > s.drafted_by_pos.size()) {
      s.drafted_by_pos.resize(n, 0);
      s.accepted_by_pos.resize(n, 0);
    }
    for (size_t i = 0; i < n; ++i) {
      s.drafted_by_pos[i] += at(run.drafted_by_pos, i);
      s.accepted_by_pos[i] += at(run.accepted_by_pos, i);
    }
  }
  s.acceptance = ratio_or_zero(static_cast<double>(s.accepted), static_cast<double>(s.drafted));
  s.tau =
      ratio_or_zero(static_cast<double>(s.generated_tokens), static_cast<double>(s.target_calls));
  s.tok_per_sec = ratio_or_zero(static_cast<double>(s.generated_tokens), s.wall_ms) * 1000.0;
  s.acceptance_by_pos.resize(s.drafted_by_pos.size());
  for (size_t i = 0; i < s.drafted_by_pos.size(); ++i) {
    s.acceptance_by_pos[i] = ratio_or_zero(static_cast<double>(s.accepted_by_pos[i]),
                                           static_cast<double>(s.drafted_by_pos[i]));
  }
  return s;
}

AbVerdict compare_arms(std::span<const PromptRun> a, std::span<const PromptRun> b,
                       const AbOptions& options) {
  if (a.size() != b.size()) {
    fail(
        "A/B arms differ in size: arm A has {} prompts and arm B has {} (the arms must run the "
        "same prompts in the same order)",
        a.size(), b.size());
  }
  if (a.empty()) fail("A/B: both arms are empty (no prompts to compare)");
  if (!std::isfinite(options.max_drop_pts) || options.max_drop_pts < 0.0) {
    fail("A/B: max_drop_pts = {} must be finite and >= 0", options.max_drop_pts);
  }
  AbVerdict v;
  v.a = summarize_arm(a, "A");
  v.b = summarize_arm(b, "B");
  v.max_drop_pts = options.max_drop_pts;
  v.delta_acc_pts = (v.b.acceptance - v.a.acceptance) * 100.0;
  v.speed_ratio = ratio_or_zero(v.b.tok_per_sec, v.a.tok_per_sec);
  v.per_prompt.resize(a.size());
  for (size_t i = 0; i < a.size(); ++i) {
    PromptDelta& d = v.per_prompt[i];
    d.acceptance_a = run_acceptance(a[i]);
    d.acceptance_b = run_acceptance(b[i]);
    d.delta_pts = (d.acceptance_b - d.acceptance_a) * 100.0;
    d.tok_per_sec_a = run_tok_per_sec(a[i]);
    d.tok_per_sec_b = run_tok_per_sec(b[i]);
    d.speed_ratio = ratio_or_zero(d.tok_per_sec_b, d.tok_per_sec_a);
    d.holds = d.acceptance_b >= d.acceptance_a - options.max_drop_pts / 100.0;
    v.paired_holds += d.holds ? 1 : 0;
  }
  v.pass = v.delta_acc_pts >= -options.max_drop_pts && v.speed_ratio > 1.0;
  return v;
}

std::string format_ab_report(const AbVerdict& v, const std::string& name_a,
                             const std::string& name_b) {
  std::string out;
  auto arm_line = [&](const char* tag, const std::string& name, const ArmSummary& s) {
    out += fmt::format(
        "arm {} ({}): acceptance {:.2f}% ({}/{}), tau {:.3f} ({} tokens / {} target calls), "
        "{:.2f} tok/s ({:.1f} ms), {} prompts\n",
        tag, name, s.acceptance * 100.0, s.accepted, s.drafted, s.tau, s.generated_tokens,
        s.target_calls, s.tok_per_sec, s.wall_ms, s.prompts);
  };
  arm_line("A", name_a, v.a);
  arm_line("B", name_b, v.b);
  const size_t positions = std::max(v.a.acceptance_by_pos.size(), v.b.acceptance_by_pos.size());
  if (positions > 0) out += "acceptance by position:\n  pos        A          B\n";
  for (size_t i = 0; i < positions; ++i) {
    auto cell = [&](const ArmSummary& s) {
      if (i >= s.acceptance_by_pos.size()) return std::string("-");
      return fmt::format("{:.2f}% ({}/{})", s.acceptance_by_pos[i] * 100.0, s.accepted_by_pos[i],
                         s.drafted_by_pos[i]);
    };
    out += fmt::format("  {:>3}  {:>20}  {:>20}\n", i, cell(v.a), cell(v.b));
  }
  out += fmt::format("delta acceptance {:+.2f} points, speed ratio {:.4f} (B/A tok/s)\n",
                     v.delta_acc_pts, v.speed_ratio);
  out += fmt::format("paired: {} of {} prompts hold (acceptance B >= A - {:g} points)\n",
                     v.paired_holds, v.per_prompt.size(), v.max_drop_pts);
  if (v.pass) {
    out += fmt::format("verdict: PASS (acceptance within {:g} points and tokens/s improved)\n",
                       v.max_drop_pts);
  } else {
    std::string why;
    if (v.delta_acc_pts < -v.max_drop_pts) {
      why = fmt::format("acceptance dropped {:.2f} points, more than {:g}", -v.delta_acc_pts,
                        v.max_drop_pts);
    }
    if (!(v.speed_ratio > 1.0)) {
      if (!why.empty()) why += "; ";
      why += fmt::format("tokens/s did not improve (ratio {:.4f})", v.speed_ratio);
    }
    out += fmt::format("verdict: FAIL ({})\n", why);
  }
  return out;
}

}  // namespace specula::lab
