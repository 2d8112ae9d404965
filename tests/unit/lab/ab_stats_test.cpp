// SPDX-License-Identifier: Apache-2.0
// Paired A/B statistics (engine/lab/ab_stats.h): the seed's §4.9 rule, with
// zero-drafted arms (no NaN), ragged by-position arrays and bad input.
#include "engine/lab/ab_stats.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cmath>

#include "engine/core/error.h"

namespace specula::lab {
namespace {

using ::testing::HasSubstr;
using ::testing::Not;

PromptRun run(int64_t gen, int64_t drafted, int64_t accepted, int64_t calls, double ms,
              std::vector<int64_t> dpos = {}, std::vector<int64_t> apos = {}) {
  return {.generated_tokens = gen,
          .drafted = drafted,
          .accepted = accepted,
          .target_calls = calls,
          .wall_ms = ms,
          .drafted_by_pos = std::move(dpos),
          .accepted_by_pos = std::move(apos)};
}

void expect_no_nan(const ArmSummary& s) {
  EXPECT_FALSE(std::isnan(s.acceptance));
  EXPECT_FALSE(std::isnan(s.tau));
  EXPECT_FALSE(std::isnan(s.tok_per_sec));
  for (double a : s.acceptance_by_pos) EXPECT_FALSE(std::isnan(a));
}

TEST(LabAbStats, ArmSummarySumsAndRaggedPositions) {
  const std::vector<PromptRun> runs = {
      run(100, 60, 30, 40, 500.0, {20, 20, 20}, {15, 10, 5}),
      run(50, 40, 30, 20, 500.0, {10, 10, 10, 5, 5}, {10, 8, 6, 4, 2}),
  };
  const ArmSummary s = summarize_arm(runs, "A");
  EXPECT_EQ(s.prompts, 2);
  EXPECT_EQ(s.generated_tokens, 150);
  EXPECT_EQ(s.drafted, 100);
  EXPECT_EQ(s.accepted, 60);
  EXPECT_EQ(s.target_calls, 60);
  EXPECT_DOUBLE_EQ(s.wall_ms, 1000.0);
  EXPECT_DOUBLE_EQ(s.acceptance, 0.6);
  EXPECT_DOUBLE_EQ(s.tau, 2.5);
  EXPECT_DOUBLE_EQ(s.tok_per_sec, 150.0);
  EXPECT_EQ(s.drafted_by_pos, (std::vector<int64_t>{30, 30, 30, 5, 5}));
  EXPECT_EQ(s.accepted_by_pos, (std::vector<int64_t>{25, 18, 11, 4, 2}));
  ASSERT_EQ(s.acceptance_by_pos.size(), 5u);
  EXPECT_DOUBLE_EQ(s.acceptance_by_pos[0], 25.0 / 30.0);
  EXPECT_DOUBLE_EQ(s.acceptance_by_pos[4], 0.4);
  // An accepted array shorter than the drafted one counts the rest as 0.
  const std::vector<PromptRun> shorter = {run(10, 4, 1, 5, 10.0, {2, 2}, {1})};
  const ArmSummary t = summarize_arm(shorter);
  EXPECT_EQ(t.accepted_by_pos, (std::vector<int64_t>{1, 0}));
  EXPECT_EQ(t.acceptance_by_pos[1], 0.0);
}

TEST(LabAbStats, ZeroDraftedIsZeroNotNan) {
  // A drafter that drafted nothing, and a position nobody reached.
  const std::vector<PromptRun> runs = {run(20, 0, 0, 20, 100.0, {0, 0}, {0, 0}),
                                       run(0, 0, 0, 0, 0.0)};
  const ArmSummary s = summarize_arm(runs);
  EXPECT_EQ(s.acceptance, 0.0);
  EXPECT_EQ(s.acceptance_by_pos, (std::vector<double>{0.0, 0.0}));
  EXPECT_DOUBLE_EQ(s.tau, 1.0);
  expect_no_nan(s);
  EXPECT_EQ(run_acceptance(runs[1]), 0.0);
  EXPECT_EQ(run_tok_per_sec(runs[1]), 0.0);
  const ArmSummary empty = summarize_arm({});
  EXPECT_EQ(empty.tau, 0.0);
  EXPECT_EQ(empty.tok_per_sec, 0.0);
  expect_no_nan(empty);

  // Both arms of zero-drafted, zero-time prompts: a FAIL with no NaN anywhere.
  const AbVerdict v = compare_arms(runs, runs);
  expect_no_nan(v.a);
  expect_no_nan(v.b);
  EXPECT_EQ(v.delta_acc_pts, 0.0);
  EXPECT_DOUBLE_EQ(v.speed_ratio, 1.0);
  EXPECT_FALSE(v.pass);  // equal speed is not an improvement
  for (const PromptDelta& d : v.per_prompt) {
    EXPECT_FALSE(std::isnan(d.delta_pts));
    EXPECT_FALSE(std::isnan(d.speed_ratio));
    EXPECT_TRUE(d.holds);
  }
  EXPECT_EQ(v.per_prompt[1].speed_ratio, 0.0);  // A's tok/s is 0 there
  const std::string report = format_ab_report(v, "a", "b");
  EXPECT_THAT(report, Not(HasSubstr("nan")));
  EXPECT_THAT(report, Not(HasSubstr("inf")));
}

TEST(LabAbStats, VerdictFollowsTheSeedRule) {
  // A: acceptance 0.60 at 100 tok/s. Per prompt 0.6 each.
  const std::vector<PromptRun> a = {run(100, 50, 30, 50, 1000.0), run(100, 50, 30, 50, 1000.0)};
  // B: acceptance 0.575 (−2.5 points) at 110 tok/s: PASS.
  const std::vector<PromptRun> pass = {run(110, 100, 59, 50, 1000.0),
                                       run(110, 100, 56, 50, 1000.0)};
  const AbVerdict v = compare_arms(a, pass);
  EXPECT_NEAR(v.delta_acc_pts, -2.5, 1e-9);
  EXPECT_DOUBLE_EQ(v.speed_ratio, 1.1);
  EXPECT_TRUE(v.pass);
  // Prompt 0: 0.59 >= 0.57 holds; prompt 1: 0.56 < 0.57 does not.
  EXPECT_TRUE(v.per_prompt[0].holds);
  EXPECT_FALSE(v.per_prompt[1].holds);
  EXPECT_EQ(v.paired_holds, 1);
  EXPECT_NEAR(v.per_prompt[1].delta_pts, -4.0, 1e-9);
  EXPECT_DOUBLE_EQ(v.per_prompt[0].speed_ratio, 1.1);
  const std::string report = format_ab_report(v, "bf16", "int8");
  EXPECT_THAT(report, HasSubstr("arm A (bf16)"));
  EXPECT_THAT(report, HasSubstr("arm B (int8)"));
  EXPECT_THAT(report, HasSubstr("1 of 2 prompts hold"));
  EXPECT_THAT(report, HasSubstr("verdict: PASS"));

  // −3.1 points: FAIL even though faster.
  const std::vector<PromptRun> drop = {run(110, 1000, 569, 50, 1000.0),
                                       run(110, 1000, 569, 50, 1000.0)};
  const AbVerdict d = compare_arms(a, drop);
  EXPECT_LT(d.delta_acc_pts, -3.0);
  EXPECT_FALSE(d.pass);
  EXPECT_THAT(format_ab_report(d, "a", "b"), HasSubstr("verdict: FAIL (acceptance dropped"));
  // Same acceptance, same speed: FAIL (the ratio must be strictly above 1).
  const AbVerdict same = compare_arms(a, a);
  EXPECT_EQ(same.delta_acc_pts, 0.0);
  EXPECT_EQ(same.speed_ratio, 1.0);
  EXPECT_FALSE(same.pass);
  EXPECT_EQ(same.paired_holds, 2);
  EXPECT_THAT(format_ab_report(same, "a", "b"), HasSubstr("tokens/s did not improve"));
  // Better acceptance but slower: FAIL; a looser max drop makes drop PASS.
  EXPECT_FALSE(compare_arms(pass, a).pass);
  EXPECT_TRUE(compare_arms(a, drop, {.max_drop_pts = 5.0}).pass);
}

TEST(LabAbStats, ArmsOfDifferentSizesNameBothSizes) {
  const std::vector<PromptRun> a(3, run(10, 5, 2, 5, 10.0));
  const std::vector<PromptRun> b(2, run(10, 5, 2, 5, 10.0));
  try {
    compare_arms(a, b);
    FAIL() << "expected an Error";
  } catch (const Error& e) {
    EXPECT_THAT(e.what(), HasSubstr("arm A has 3 prompts"));
    EXPECT_THAT(e.what(), HasSubstr("arm B has 2"));
  }
  EXPECT_THROW(compare_arms({}, {}), Error);
  EXPECT_THROW(compare_arms(a, a, {.max_drop_pts = -1.0}), Error);
  EXPECT_THROW(compare_arms(a, a, {.max_drop_pts = std::nan("")}), Error);
}

TEST(LabAbStats, BadCountsNameArmPromptAndField) {
  const std::vector<PromptRun> good(2, run(10, 5, 2, 5, 10.0));
  auto expect_error = [&](PromptRun bad, const std::string& what) {
    std::vector<PromptRun> b = good;
    b[1] = std::move(bad);
    try {
      compare_arms(good, b);
      FAIL() << "expected an Error for " << what;
    } catch (const Error& e) {
      EXPECT_THAT(e.what(), HasSubstr("arm B prompt 1"));
      EXPECT_THAT(e.what(), HasSubstr(what));
    }
  };
  expect_error(run(10, 5, 6, 5, 10.0), "accepted = 6 exceeds drafted = 5");
  expect_error(run(-1, 5, 2, 5, 10.0), "generated_tokens = -1");
  expect_error(run(10, 5, 2, -5, 10.0), "target_calls = -5");
  expect_error(run(10, 5, 2, 5, std::nan("")), "wall_ms");
  expect_error(run(10, 5, 2, 5, -1.0), "wall_ms");
  expect_error(run(10, 5, 2, 5, 10.0, {2, 1}, {1, 2}), "position 1");
}

}  // namespace
}  // namespace specula::lab
