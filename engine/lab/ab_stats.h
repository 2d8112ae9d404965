// SPDX-License-Identifier: Apache-2.0
// Paired A/B statistics of two drafters over the same prompts (issue #33):
// the seed's `ab-stats.ts` rule exactly (../shared/reference/seed-system.md
// §4.9). A is the reference drafter, B the candidate; the prompt is the
// pairing unit, so per-prompt deltas cancel prompt difficulty and drift in
// machine load. Pure arithmetic: the runs come from `specula ab`.
#pragma once

#include <cstdint>
#include <span>
#include <string>
#include <vector>

namespace specula::lab {

// One prompt's run under one arm. by-position arrays may be of any length
// (ragged across prompts); a missing entry counts as 0. Counts >= 0,
// accepted <= drafted (in total and per position), wall_ms finite and >= 0.
struct PromptRun {
  int64_t generated_tokens = 0;
  int64_t drafted = 0;
  int64_t accepted = 0;
  int64_t target_calls = 0;
  double wall_ms = 0.0;
  std::vector<int64_t> drafted_by_pos;
  std::vector<int64_t> accepted_by_pos;
};

// Sums over an arm's prompts and the rates the seed reports. Every rate whose
// denominator is 0 is 0, never NaN or infinite.
struct ArmSummary {
  int64_t prompts = 0;
  int64_t generated_tokens = 0;
  int64_t drafted = 0;
  int64_t accepted = 0;
  int64_t target_calls = 0;
  double wall_ms = 0.0;
  double acceptance = 0.0;   // Σaccepted / Σdrafted
  double tau = 0.0;          // Σgenerated_tokens / Σtarget_calls
  double tok_per_sec = 0.0;  // Σgenerated_tokens / Σwall_ms · 1000
  // Aligned by index over the longest array of any prompt.
  std::vector<int64_t> drafted_by_pos;
  std::vector<int64_t> accepted_by_pos;
  std::vector<double> acceptance_by_pos;  // Σaccepted_i / Σdrafted_i
};

// Per-prompt rates of one run (acceptance and tok/s, 0 on a 0 denominator).
double run_acceptance(const PromptRun& run);
double run_tok_per_sec(const PromptRun& run);

// Sums `runs` (one per prompt). `arm` names the arm in errors ("A", "B").
// Throws Error naming the arm, the prompt index and the field on bad counts.
ArmSummary summarize_arm(std::span<const PromptRun> runs, const std::string& arm = "arm");

struct AbOptions {
  double max_drop_pts = 3.0;  // acceptance may drop by at most this many points
};

// One prompt's pairing.
struct PromptDelta {
  double acceptance_a = 0.0;
  double acceptance_b = 0.0;
  double delta_pts = 0.0;  // (acceptance_b − acceptance_a) · 100
  double tok_per_sec_a = 0.0;
  double tok_per_sec_b = 0.0;
  double speed_ratio = 0.0;  // tok_per_sec_b / tok_per_sec_a; 0 when A's is 0
  bool holds = false;        // acceptance_b >= acceptance_a − max_drop_pts / 100
};

struct AbVerdict {
  ArmSummary a;
  ArmSummary b;
  double max_drop_pts = 3.0;
  double delta_acc_pts = 0.0;  // (a.acceptance → b.acceptance) · 100
  double speed_ratio = 0.0;    // b.tok_per_sec / a.tok_per_sec; 0 when A's is 0
  int64_t paired_holds = 0;    // prompts whose delta holds
  bool pass = false;           // delta_acc_pts >= −max_drop_pts AND speed_ratio > 1
  std::vector<PromptDelta> per_prompt;
};

// The paired verdict of §4.9. `a` and `b` are the same prompts in the same
// order: arms of different sizes throw an Error naming both sizes; an empty
// pair throws too (nothing to compare); max_drop_pts must be finite and >= 0.
AbVerdict compare_arms(std::span<const PromptRun> a, std::span<const PromptRun> b,
                       const AbOptions& options = {});

// The report a person reads: both arms (acceptance %, τ, tok/s, token and
// prompt counts), acceptance by position side by side, the paired hold count
// and the verdict line ("verdict: PASS ..." or "verdict: FAIL ..." with the
// reason). `name_a` / `name_b` label the arms (e.g. the drafter folders).
std::string format_ab_report(const AbVerdict& verdict, const std::string& name_a,
                             const std::string& name_b);

}  // namespace specula::lab
