// SPDX-License-Identifier: Apache-2.0
// The prefix scheduler of DSpark's Alg. 1 (engine/speculative/verify_scheduler.h):
// its outputs are prefixes chosen along the survival order, and the early
// break keeps speculative sampling exact, shown on the paper's Appendix A
// counterexample by simulating exact speculative sampling (verify_window, the
// engine's one definition) with and without the break.
#include "engine/speculative/verify_scheduler.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <fstream>

#include "engine/core/error.h"
#include "engine/sampling/speculative.h"
#include "tests/unit/lab/lab_test_util.h"

namespace specula::speculative {
namespace {

using lab::testing::Rng;
using ::testing::HasSubstr;

struct Cand {
  double survival;
  int row;
  int position;
};

// The admission order the scheduler documents: descending survival, ties to
// the lower row, then the lower position; only positive survivals.
std::vector<Cand> admission_order(const std::vector<std::vector<double>>& rows) {
  std::vector<Cand> c;
  for (int r = 0; r < static_cast<int>(rows.size()); ++r) {
    double a = 1.0;
    for (int j = 0; j < static_cast<int>(rows[r].size()); ++j) {
      a *= rows[r][j];
      if (a > 0.0) c.push_back({a, r, j + 1});
    }
  }
  std::sort(c.begin(), c.end(), [](const Cand& x, const Cand& y) {
    if (x.survival != y.survival) return x.survival > y.survival;
    if (x.row != y.row) return x.row < y.row;
    return x.position < y.position;
  });
  return c;
}

// TEST-ONLY: Alg. 1 without its break, i.e. the offline global search of the
// paper's Appendix A: evaluate Θ along the whole admission order and keep the
// best prefix of it. Not lossless; it exists to show why the break is there.
std::vector<int> global_search_without_break(const std::vector<std::vector<double>>& rows,
                                             const SpsTable& sps) {
  const int r_count = static_cast<int>(rows.size());
  std::vector<int> lengths(r_count, 0), best(r_count, 0);
  int64_t batch = r_count;
  double tau = r_count;
  double best_theta = r_count * sps.steps_per_sec(r_count);
  for (const Cand& c : admission_order(rows)) {
    lengths[c.row] = c.position;
    batch += 1;
    tau += c.survival;
    const double theta = tau * sps.steps_per_sec(batch);
    if (theta > best_theta) {
      best_theta = theta;
      best = lengths;
    }
  }
  return best;
}

// The paper's Appendix A: vocabulary {A = 0, B = 1}, target p = (0.7, 0.3) at
// every position (independent of the history), draft q = (0.5, 0.5), one
// request, γ = 2. The pre-token confidence of position 1 is 0.8 (its exact
// acceptance rate Σ min(p, q)); the Markov confidence of position 2 depends on
// the sampled x_1: 0.9 after A, 0 after B.
constexpr std::array<float, 2> kP = {0.7f, 0.3f};
constexpr std::array<float, 2> kQ = {0.5f, 0.5f};

std::vector<double> appendix_a_confidences(int32_t x1) {
  return {0.8, x1 == 0 ? 0.9 : 0.0};
}

enum class Search { kAlg1WithBreak, kGlobalWithoutBreak };

// One speculative round: draft x_1, x_2 ~ q, let the scheduler pick ℓ from
// their confidences, verify the first ℓ drafts exactly (verify_window) and
// return the emitted tokens (accepted drafts, then the replacement or bonus).
std::vector<int32_t> speculative_round(Rng& rng, const SpsTable& sps, Search search,
                                       VerifyScheduler& scheduler, int* length_out = nullptr) {
  const std::array<int32_t, 2> drafts = {rng.uniform() < kQ[0] ? 0 : 1,
                                         rng.uniform() < kQ[0] ? 0 : 1};
  const std::vector<std::vector<double>> rows = {appendix_a_confidences(drafts[0])};
  const int length = search == Search::kAlg1WithBreak ? scheduler.schedule(rows, sps).lengths[0]
                                                      : global_search_without_break(rows, sps)[0];
  if (length_out) *length_out = length;
  std::vector<double> u(length + 1);
  for (double& x : u) x = rng.uniform();
  std::array<float, 2> residual{};
  const DistributionAt p = [](int) { return std::span<const float>(kP); };
  const DistributionAt q = [](int) { return std::span<const float>(kQ); };
  const WindowVerdict v =
      verify_window(std::span<const int32_t>(drafts.data(), length), p, q, u, residual);
  std::vector<int32_t> out(drafts.begin(), drafts.begin() + v.accepted);
  out.push_back(v.next);
  return out;
}

// Pearson's χ² of observed counts against expected probabilities.
double chi_square(const std::vector<int64_t>& counts, const std::vector<double>& probs) {
  int64_t n = 0;
  for (int64_t c : counts) n += c;
  double chi = 0.0;
  for (size_t i = 0; i < counts.size(); ++i) {
    const double e = probs[i] * static_cast<double>(n);
    chi += (static_cast<double>(counts[i]) - e) * (static_cast<double>(counts[i]) - e) / e;
  }
  return chi;
}

SpsTable appendix_a_sps() {
  return SpsTable({{1, 1.0}, {2, 0.5}, {3, 0.45}});
}

TEST(VerifyScheduler, AppendixANumbers) {
  const SpsTable sps = appendix_a_sps();
  VerifyScheduler scheduler;
  for (int32_t x1 : {0, 1}) {
    const std::vector<std::vector<double>> rows = {appendix_a_confidences(x1)};
    // Θ_0 = 1.0, Θ_1 = 1.8 · 0.5 = 0.9: Alg. 1 stops before looking at c_2.
    const PrefixSchedule& s = scheduler.schedule(rows, sps);
    EXPECT_EQ(s.lengths, std::vector<int>{0}) << "x1 = " << x1;
    EXPECT_EQ(s.batch_tokens, 1);
    EXPECT_DOUBLE_EQ(s.throughput, 1.0);
  }
  // Without the break: Θ_2 = (1 + 0.8 + 0.72) · 0.45 = 1.134 after A, 0.81 after B.
  EXPECT_EQ(global_search_without_break({appendix_a_confidences(0)}, sps), std::vector<int>{2});
  EXPECT_EQ(global_search_without_break({appendix_a_confidences(1)}, sps), std::vector<int>{0});
}

TEST(VerifyScheduler, AppendixABreakKeepsTheTargetDistribution) {
  const SpsTable sps = appendix_a_sps();
  VerifyScheduler scheduler;
  constexpr int kTrials = 200000;
  for (Search search : {Search::kAlg1WithBreak, Search::kGlobalWithoutBreak}) {
    Rng rng(2026);
    std::vector<int64_t> first(2, 0);
    for (int t = 0; t < kTrials; ++t) {
      ++first[speculative_round(rng, sps, search, scheduler)[0]];
    }
    const double chi = chi_square(first, {0.7, 0.3});
    const double freq_a = static_cast<double>(first[0]) / kTrials;
    if (search == Search::kAlg1WithBreak) {
      // χ²(1 dof) at p = 0.001 is 10.83 (a fixed seed: this never flakes).
      EXPECT_LT(chi, 10.83) << "P(A) = " << freq_a;
      EXPECT_NEAR(freq_a, 0.7, 0.005);
    } else {
      // The global search verifies x_1 only when x_1 = A: 0.5 + 0.5 · 0.7 = 0.85.
      EXPECT_NEAR(freq_a, 0.85, 0.005);
      EXPECT_GT(chi, 1000.0) << "P(A) = " << freq_a;
    }
  }
}

TEST(VerifyScheduler, BreakIsExactWhenLengthsVary) {
  // SPS(1..3) = 1.0, 0.9, 0.7: Θ_1 = 1.8 · 0.9 = 1.62 > 1 admits x_1; Θ_2 =
  // (1.8 + 0.8 c_2) · 0.7 is 1.764 after A (admit x_2) and 1.26 after B (stop),
  // so ℓ depends on x_1 — which is allowed, because it decides x_2's fate, not
  // x_1's. The first two emitted tokens must be i.i.d. p.
  const SpsTable sps({{1, 1.0}, {2, 0.9}, {3, 0.7}});
  VerifyScheduler scheduler;
  Rng rng(77);
  std::vector<int64_t> pairs(4, 0);
  std::array<int64_t, 3> lengths{};
  constexpr int kTrials = 200000;
  for (int t = 0; t < kTrials; ++t) {
    std::vector<int32_t> tokens;
    while (tokens.size() < 2) {
      int length = 0;
      const std::vector<int32_t> round =
          speculative_round(rng, sps, Search::kAlg1WithBreak, scheduler, &length);
      ++lengths[length];
      tokens.insert(tokens.end(), round.begin(), round.end());
    }
    ++pairs[tokens[0] * 2 + tokens[1]];
  }
  EXPECT_EQ(lengths[0], 0);
  EXPECT_GT(lengths[1], kTrials / 4);
  EXPECT_GT(lengths[2], kTrials / 4);
  // χ²(3 dof) at p = 0.001 is 16.27.
  EXPECT_LT(chi_square(pairs, {0.49, 0.21, 0.21, 0.09}), 16.27);
}

TEST(VerifyScheduler, FlatAndSteepCostCurves) {
  VerifyScheduler scheduler;
  // Free extra tokens: every positive survival is admitted; a zero confidence
  // ends its row.
  const SpsTable flat({{1, 10.0}, {64, 10.0}});
  const std::vector<std::vector<double>> rows = {{0.9, 0.5, 0.8}, {0.7, 0.0, 0.9}, {}, {1.0}};
  const PrefixSchedule& s = scheduler.schedule(rows, flat);
  EXPECT_EQ(s.lengths, (std::vector<int>{3, 1, 0, 1}));
  EXPECT_EQ(s.batch_tokens, 4 + 5);
  EXPECT_DOUBLE_EQ(s.expected_tokens, 4 + (0.9 + 0.45 + 0.36) + 0.7 + 1.0);
  EXPECT_DOUBLE_EQ(s.throughput, s.expected_tokens * 10.0);
  // Every extra token halves the speed: nothing is worth verifying.
  const SpsTable steep({{4, 100.0}, {5, 50.0}, {64, 1.0}});
  EXPECT_EQ(scheduler.schedule(rows, steep).lengths, (std::vector<int>{0, 0, 0, 0}));
  // No rows: nothing to do.
  EXPECT_TRUE(scheduler.schedule(std::vector<std::vector<double>>{}, flat).lengths.empty());
}

TEST(VerifyScheduler, TiesGoToTheLowerRowThenPosition) {
  VerifyScheduler scheduler;
  // Room for exactly one more token: B = 2 -> 3 raises Θ, 3 -> 4 does not.
  const SpsTable sps({{2, 1.0}, {3, 0.9}, {4, 0.5}});
  const std::vector<std::vector<double>> rows = {{0.6, 1.0}, {0.6, 1.0}};
  EXPECT_EQ(scheduler.schedule(rows, sps).lengths, (std::vector<int>{1, 0}));
  // With room for two, row 0 takes its position 2 (same survival) before row 1.
  const SpsTable two({{2, 1.0}, {4, 0.9}, {5, 0.1}});
  EXPECT_EQ(scheduler.schedule(rows, two).lengths, (std::vector<int>{2, 0}));
}

TEST(VerifyScheduler, RandomCasesArePrefixesAlongTheSurvivalOrder) {
  Rng rng(123);
  VerifyScheduler scheduler;
  for (int trial = 0; trial < 400; ++trial) {
    const int r_count = 1 + static_cast<int>(rng.next() % 8);
    std::vector<std::vector<double>> rows(r_count);
    for (auto& row : rows) {
      const int k = static_cast<int>(rng.next() % 8);
      // Multiples of 1/8 make ties and zeros common.
      for (int j = 0; j < k; ++j) row.push_back(static_cast<double>(rng.next() % 9) / 8.0);
    }
    std::vector<SpsPoint> points;
    for (int b = 1; b <= 64; b += 1 + static_cast<int>(rng.next() % 4)) {
      points.push_back({b, rng.uniform(0.5, 2.0) / (1.0 + 0.05 * b)});
    }
    const SpsTable sps(points);
    const PrefixSchedule s = scheduler.schedule(rows, sps);
    ASSERT_EQ(s.lengths.size(), rows.size());
    int64_t admitted = 0;
    for (int r = 0; r < r_count; ++r) {
      EXPECT_GE(s.lengths[r], 0);
      EXPECT_LE(s.lengths[r], static_cast<int>(rows[r].size()));
      admitted += s.lengths[r];
    }
    EXPECT_EQ(s.batch_tokens, r_count + admitted);
    // The admitted positions are exactly the first `admitted` of the order,
    // each row's a prefix; Θ rose at every admission and not at the next.
    const std::vector<Cand> order = admission_order(rows);
    std::vector<int> seen(r_count, 0);
    double tau = r_count;
    double theta = r_count * sps.steps_per_sec(r_count);
    for (int64_t i = 0; i < admitted; ++i) {
      const Cand& c = order[i];
      EXPECT_EQ(c.position, seen[c.row] + 1) << "trial " << trial;
      seen[c.row] = c.position;
      tau += c.survival;
      const double next = tau * sps.steps_per_sec(r_count + i + 1);
      EXPECT_GT(next, theta) << "trial " << trial;
      theta = next;
    }
    EXPECT_EQ(seen, s.lengths) << "trial " << trial;
    EXPECT_DOUBLE_EQ(s.expected_tokens, tau);
    EXPECT_DOUBLE_EQ(s.throughput, theta);
    if (admitted < static_cast<int64_t>(order.size())) {
      EXPECT_LE((tau + order[admitted].survival) * sps.steps_per_sec(r_count + admitted + 1), theta)
          << "trial " << trial;
    }
    // The flat form gives the same answer.
    const int stride = 8;
    std::vector<double> flat(r_count * stride, -1.0);
    std::vector<int> k(r_count);
    for (int r = 0; r < r_count; ++r) {
      std::copy(rows[r].begin(), rows[r].end(), flat.begin() + r * stride);
      k[r] = static_cast<int>(rows[r].size());
    }
    EXPECT_EQ(scheduler.schedule(flat, stride, k, sps).lengths, s.lengths);
  }
}

TEST(VerifyScheduler, BadConfidencesNameRowAndPosition) {
  VerifyScheduler scheduler;
  const SpsTable sps({{1, 1.0}});
  for (double bad : {std::nan(""), -0.1, 1.5}) {
    try {
      scheduler.schedule({{0.5}, {0.9, bad}}, sps);
      FAIL() << "expected an Error for " << bad;
    } catch (const Error& e) {
      EXPECT_THAT(e.what(), HasSubstr("row 1 draft 1"));
    }
  }
  const std::vector<double> flat(4, 0.5);
  const std::vector<int> too_long = {3, 1};
  EXPECT_THROW(scheduler.schedule(flat, 2, too_long, sps), Error);
  const std::vector<int> three_rows = {1, 1, 1};
  EXPECT_THROW(scheduler.schedule(flat, 2, three_rows, sps), Error);
  EXPECT_THROW(scheduler.schedule({{0.5}}, SpsTable()), Error);
}

TEST(SpsTable, InterpolatesStepTimeAndClamps) {
  const SpsTable t({{2, 100.0}, {4, 50.0}, {8, 40.0}}, "cpu", "tiny");
  EXPECT_EQ(t.steps_per_sec(1), 100.0);  // below the first point: the first point's
  EXPECT_EQ(t.steps_per_sec(2), 100.0);
  // Between points the step time is linear: B = 3 is 15 ms, 66.7 steps/s.
  EXPECT_NEAR(t.steps_per_sec(3), 1.0 / 0.015, 1e-9);
  EXPECT_EQ(t.steps_per_sec(4), 50.0);
  EXPECT_NEAR(t.steps_per_sec(6), 1.0 / 0.0225, 1e-9);
  EXPECT_EQ(t.steps_per_sec(8), 40.0);
  // Past the last: tokens/s held at 8 · 40.
  EXPECT_DOUBLE_EQ(t.steps_per_sec(16), 20.0);
  EXPECT_THROW(t.steps_per_sec(0), Error);
  EXPECT_THROW(SpsTable().steps_per_sec(1), Error);
  EXPECT_THROW(SpsTable(std::vector<SpsPoint>{}), Error);
  EXPECT_THROW(SpsTable({{2, 1.0}, {2, 1.0}}), Error);
  EXPECT_THROW(SpsTable({{0, 1.0}}), Error);
  EXPECT_THROW(SpsTable({{1, 0.0}}), Error);
  EXPECT_THROW(SpsTable({{1, INFINITY}}), Error);
}

TEST(SpsTable, JsonRoundTripAndVerboseForm) {
  const SpsTable t({{1, 55.5}, {8, 50.25}, {64, 20.0}}, "NVIDIA H200", "gemma-4-31b");
  const SpsTable back = SpsTable::from_json(t.to_json(), "sps.json");
  ASSERT_EQ(back.points().size(), 3u);
  for (size_t i = 0; i < 3; ++i) {
    EXPECT_EQ(back.points()[i].tokens, t.points()[i].tokens);
    EXPECT_EQ(back.points()[i].steps_per_sec, t.points()[i].steps_per_sec);
  }
  EXPECT_EQ(back.device(), "NVIDIA H200");
  EXPECT_EQ(back.model(), "gemma-4-31b");
  const std::string text = t.describe();
  EXPECT_THAT(text, HasSubstr("NVIDIA H200"));
  EXPECT_THAT(text, HasSubstr("3 points"));
  EXPECT_THAT(text, HasSubstr("50.25"));
  EXPECT_THAT(text, HasSubstr("1280.0"));  // 64 · 20 tokens/s

  lab::testing::ScratchDir dir("sps");
  t.save(dir.file("sps.json"));
  EXPECT_EQ(SpsTable::load(dir.file("sps.json")).points().back().tokens, 64);
  try {
    t.save(dir.file("no/such/dir/sps.json"));
    FAIL() << "expected an Error";
  } catch (const Error& e) {
    EXPECT_THAT(e.what(), HasSubstr("no/such/dir/sps.json"));
  }
  EXPECT_THROW(SpsTable::load(dir.file("absent.json")), Error);
}

TEST(SpsTable, BadJsonNamesFieldAndValue) {
  auto expect_error = [](const std::string& text, const std::string& what) {
    try {
      SpsTable::from_json(text, "cache/sps.json");
      FAIL() << "expected an Error for " << text;
    } catch (const Error& e) {
      EXPECT_THAT(e.what(), HasSubstr("cache/sps.json"));
      EXPECT_THAT(e.what(), HasSubstr(what));
    }
  };
  const std::string head = R"({"kind": "specula-sps-table", "version": 1, )";
  expect_error("[]", "top level");
  expect_error(R"({"kind": "x", "version": 1, "points": []})", "kind");
  expect_error(R"({"kind": "specula-sps-table", "version": 2, "points": []})", "version");
  expect_error(head + R"("points": 3})", "points is");
  expect_error(head + R"("points": [{"tokens": 1}]})", "points[0]");
  expect_error(head + R"("points": [{"tokens": 1.5, "steps_per_sec": 1}]})", "points[0]");
  expect_error(
      head + R"("points": [{"tokens": 4, "steps_per_sec": 1}, {"tokens": 2, "steps_per_sec": 1}]})",
      "point 1");
  expect_error(head + R"("points": [{"tokens": 4, "steps_per_sec": -1}]})", "steps_per_sec");
  expect_error(head + R"("device": 3, "points": []})", "device");
  expect_error(head + R"("points": []})", "no points");
}

}  // namespace
}  // namespace specula::speculative
