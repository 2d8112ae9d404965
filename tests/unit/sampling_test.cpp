// SPDX-License-Identifier: Apache-2.0
// Sampling: parameter validation, the RNG, the logits pipeline (penalties,
// temperature, top-k, top-p, min-p) on crafted and random inputs, seeded
// reproducibility, chi-square checks of sampled frequencies, speculative
// sampling exactness and the stop-string matcher.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <functional>
#include <limits>
#include <numeric>
#include <string>
#include <vector>

#include "engine/core/error.h"
#include "engine/sampling/rng.h"
#include "engine/sampling/sampler.h"
#include "engine/sampling/sampling_params.h"
#include "engine/sampling/speculative.h"
#include "engine/sampling/stop_matcher.h"
#include "tests/unit/test_util.h"

namespace specula {
namespace {

constexpr float kInf = std::numeric_limits<float>::infinity();

// Upper 0.1% points of the chi-square distribution by degrees of freedom: a
// correct sampler exceeds them with probability 0.001 (the seeds are fixed, so
// each test is deterministic; these seeds pass).
double chi_square_critical_001(int dof) {
  static const double kTable[] = {0,      10.828, 13.816, 16.266, 18.467, 20.515,
                                  22.458, 24.322, 26.124, 27.877, 29.588};
  if (dof < 1 || dof > 10) throw std::runtime_error("no table entry");
  return kTable[dof];
}

// Pearson chi-square of observed counts against probabilities over the bins
// with p > 0; *dof receives (bins - 1). Counts in bins with p == 0 are returned
// through *impossible.
double chi_square(const std::vector<int64_t>& counts, const std::vector<double>& p, int64_t n,
                  int* dof, int64_t* impossible) {
  double chi2 = 0.0;
  int bins = 0;
  *impossible = 0;
  for (size_t i = 0; i < p.size(); ++i) {
    if (p[i] <= 0.0) {
      *impossible += counts[i];
      continue;
    }
    const double expected = static_cast<double>(n) * p[i];
    const double d = static_cast<double>(counts[i]) - expected;
    chi2 += d * d / expected;
    ++bins;
  }
  *dof = bins - 1;
  return chi2;
}

std::vector<double> to_double(std::span<const float> x) {
  return {x.begin(), x.end()};
}

using testing::error_of;

// ---------------------------------------------------------------- params

TEST(SamplingParams, DefaultsAreValid) {
  SamplingParams p;
  EXPECT_NO_THROW(p.validate());
  EXPECT_FALSE(p.greedy());
  p.temperature = 0.0f;
  EXPECT_TRUE(p.greedy());
}

TEST(SamplingParams, RejectsOutOfRangeFieldsByName) {
  struct Case {
    std::function<void(SamplingParams&)> set;
    const char* needle;
  };
  const std::vector<Case> cases = {
      {[](SamplingParams& p) { p.temperature = -0.5f; }, "temperature = -0.5"},
      {[](SamplingParams& p) { p.temperature = std::nanf(""); }, "temperature = nan"},
      {[](SamplingParams& p) { p.temperature = kInf; }, "temperature = inf"},
      {[](SamplingParams& p) { p.top_k = -2; }, "top_k = -2"},
      {[](SamplingParams& p) { p.top_p = 0.0f; }, "top_p = 0"},
      {[](SamplingParams& p) { p.top_p = 1.5f; }, "top_p = 1.5"},
      {[](SamplingParams& p) { p.min_p = -0.1f; }, "min_p = -0.1"},
      {[](SamplingParams& p) { p.min_p = 2.0f; }, "min_p = 2"},
      {[](SamplingParams& p) { p.repetition_penalty = 0.0f; }, "repetition_penalty = 0"},
      {[](SamplingParams& p) { p.presence_penalty = 2.5f; }, "presence_penalty = 2.5"},
      {[](SamplingParams& p) { p.frequency_penalty = -3.0f; }, "frequency_penalty = -3"},
      {[](SamplingParams& p) { p.max_tokens = 0; }, "max_tokens = 0"},
      {[](SamplingParams& p) {
         p.stop = {"a", ""};
       },
       "stop[1]"},
      {[](SamplingParams& p) {
         p.stop_token_ids = {5, -1};
       },
       "stop_token_ids[1] = -1"},
  };
  for (const Case& c : cases) {
    SamplingParams p;
    c.set(p);
    const std::string what = error_of([&] { p.validate(); });
    EXPECT_NE(what.find(c.needle), std::string::npos)
        << "expected '" << c.needle << "' in '" << what << "'";
  }
  SamplingParams p;
  p.stop_token_ids = {10};
  EXPECT_NO_THROW(p.validate());
  EXPECT_NE(error_of([&] { p.validate(10); }).find("stop_token_ids[0] = 10"), std::string::npos);
  EXPECT_TRUE(p.is_stop_token(10));
  EXPECT_FALSE(p.is_stop_token(9));
  p.stop_token_ids.clear();
  p.top_k = -1;  // vLLM's spelling of "off"
  EXPECT_NO_THROW(p.validate());
}

// ---------------------------------------------------------------- rng

TEST(Rng, MatchesReferenceVectors) {
  // splitmix64 from state 0 (reference output of Vigna's splitmix64.c).
  uint64_t sm = 0;
  EXPECT_EQ(splitmix64_next(&sm), 0xe220a8397b1dcdafull);
  EXPECT_EQ(splitmix64_next(&sm), 0x6e789e6aa1b965f4ull);
  // xoshiro256** from the state {1, 2, 3, 4} (reference xoshiro256starstar.c).
  Rng rng = Rng::from_state({1, 2, 3, 4});
  EXPECT_EQ(rng.next_u64(), 11520ull);
  EXPECT_EQ(rng.next_u64(), 0ull);
  EXPECT_EQ(rng.next_u64(), 1509978240ull);
  EXPECT_EQ(rng.next_u64(), 1215971899390074240ull);
  EXPECT_THROW(Rng::from_state({0, 0, 0, 0}), Error);
}

TEST(Rng, SeededStreamsAreReproducibleAndUniform) {
  Rng a(42), b(42), c(43);
  bool differs = false;
  double sum = 0.0;
  double lo = 1.0, hi = 0.0;
  constexpr int kN = 100000;
  for (int i = 0; i < kN; ++i) {
    const double u = a.uniform();
    EXPECT_EQ(u, b.uniform());
    differs |= (u != c.uniform());
    sum += u;
    lo = std::min(lo, u);
    hi = std::max(hi, u);
  }
  EXPECT_TRUE(differs);
  EXPECT_GE(lo, 0.0);
  EXPECT_LT(hi, 1.0);
  // Mean of 1e5 uniforms: standard error 0.0009; 0.005 is > 5 sigma.
  EXPECT_NEAR(sum / kN, 0.5, 0.005);
}

// ---------------------------------------------------------------- pipeline, crafted

std::vector<float> probs_for(const std::vector<float>& logits, const SamplingParams& params,
                             const TokenHistory& history = {}) {
  SamplingWorkspace ws(static_cast<int64_t>(logits.size()));
  auto p = process_logits(logits, history, params, ws);
  return {p.begin(), p.end()};
}

void expect_probs(const std::vector<float>& got, const std::vector<double>& want) {
  ASSERT_EQ(got.size(), want.size());
  for (size_t i = 0; i < want.size(); ++i) {
    if (want[i] == 0.0) {
      EXPECT_EQ(got[i], 0.0f) << "token " << i;
    } else {
      EXPECT_NEAR(got[i], want[i], 1e-6) << "token " << i;
    }
  }
}

std::vector<double> softmax(const std::vector<double>& x) {
  const double m = *std::max_element(x.begin(), x.end());
  std::vector<double> e(x.size());
  double z = 0.0;
  for (size_t i = 0; i < x.size(); ++i) z += (e[i] = std::exp(x[i] - m));
  for (double& v : e) v /= z;
  return e;
}

TEST(Sampler, PlainSoftmaxWithTemperature) {
  SamplingParams params;
  params.temperature = 0.5f;
  expect_probs(probs_for({1.0f, 2.0f, -1.0f}, params), softmax({2.0, 4.0, -2.0}));
  params.temperature = 1.0f;
  expect_probs(probs_for({1.0f, 2.0f, -kInf}, params),
               {std::exp(-1.0) / (1 + std::exp(-1.0)), 1.0 / (1 + std::exp(-1.0)), 0.0});
}

TEST(Sampler, GreedyIsArgmaxWithLowestIndexTieBreak) {
  SamplingParams params;
  params.temperature = 0.0f;
  SamplingWorkspace ws(4);
  const std::vector<float> logits = {1.0f, 3.0f, 3.0f, -kInf};
  EXPECT_EQ(greedy_token(logits, {}, params, ws), 1);
  expect_probs(probs_for(logits, params), {0, 1, 0, 0});
  Rng rng(7);
  EXPECT_EQ(sample_token(logits, {}, params, ws, rng), 1);
}

TEST(Sampler, TopKKeepsTiesAtTheBoundary) {
  SamplingParams params;
  params.top_k = 2;
  // The 2nd largest logit (2) is shared by tokens 1 and 2: both stay.
  const std::vector<float> logits = {3.0f, 2.0f, 2.0f, 1.0f};
  auto want = softmax({3.0, 2.0, 2.0});
  expect_probs(probs_for(logits, params), {want[0], want[1], want[2], 0.0});
  params.top_k = 1;
  expect_probs(probs_for(logits, params), {1, 0, 0, 0});
  params.top_k = 4;  // == V: off
  expect_probs(probs_for(logits, params), softmax({3, 2, 2, 1}));
  params.top_k = 100;  // > V: off
  expect_probs(probs_for(logits, params), softmax({3, 2, 2, 1}));
  // k larger than the number of unmasked tokens keeps just the unmasked ones.
  params.top_k = 3;
  expect_probs(probs_for({0.0f, -kInf, 1.0f, -kInf}, params),
               {softmax({0, 1})[0], 0, softmax({0, 1})[1], 0});
}

TEST(Sampler, TopPBoundaryWhenTheCumulativeSumHitsExactly) {
  // Four equal logits: every probability is exactly 0.25, so the cumulative
  // sums 0.25, 0.5, 0.75 are exact and the boundary is sharp.
  const std::vector<float> logits = {0.0f, 0.0f, 0.0f, 0.0f};
  SamplingParams params;
  params.top_p = 0.5f;  // reached exactly by two tokens: keep two (lowest ids)
  expect_probs(probs_for(logits, params), {0.5, 0.5, 0, 0});
  params.top_p = 0.25f;
  expect_probs(probs_for(logits, params), {1, 0, 0, 0});
  params.top_p = std::nextafter(0.5f, 1.0f);  // just above: a third token is needed
  expect_probs(probs_for(logits, params), {1.0 / 3, 1.0 / 3, 1.0 / 3, 0});
  params.top_p = std::nextafter(0.25f, 0.0f);  // tiny nucleus: the top token alone
  expect_probs(probs_for(logits, params), {1, 0, 0, 0});
}

TEST(Sampler, TopPOnUnequalProbabilitiesAndTies) {
  // p proportional to 4 : 2 : 1 : 1, i.e. 0.5, 0.25, 0.125, 0.125.
  const std::vector<float> logits = {std::log(4.0f), std::log(2.0f), 0.0f, 0.0f};
  SamplingParams params;
  params.top_p = 0.7f;  // 0.5 < 0.7 <= 0.75: two tokens
  expect_probs(probs_for(logits, params), {2.0 / 3, 1.0 / 3, 0, 0});
  params.top_p = 0.8f;  // 0.75 < 0.8: three tokens; token 2 beats tied token 3 by id
  expect_probs(probs_for(logits, params), {0.5 / 0.875, 0.25 / 0.875, 0.125 / 0.875, 0});
  params.top_p = 0.3f;
  expect_probs(probs_for(logits, params), {1, 0, 0, 0});
  // Ties ranked by id: tokens 1 and 3 share the top probability (0.366 each).
  params.top_p = 0.5f;
  expect_probs(probs_for({0.0f, 1.0f, 0.0f, 1.0f}, params), {0, 0.5, 0, 0.5});
}

TEST(Sampler, TopPAppliesToTheTopKRenormalisedDistribution) {
  // After top-k = 2 the survivors are 0.8 / 0.2 (logits ln 4, 0): top_p 0.75
  // then keeps one token. Without top-k the top token has only ~0.67 and top_p
  // 0.75 keeps two.
  const std::vector<float> logits = {std::log(4.0f), 0.0f, -0.5f, -1.0f};
  SamplingParams params;
  params.top_p = 0.75f;
  params.top_k = 2;
  expect_probs(probs_for(logits, params), {1, 0, 0, 0});
  params.top_k = 0;
  const auto p = probs_for(logits, params);
  EXPECT_GT(p[1], 0.0f);
  EXPECT_EQ(p[2], 0.0f);
  EXPECT_EQ(p[3], 0.0f);
}

TEST(Sampler, MinPKeepsTokensAboveAFractionOfTheMax) {
  // Relative probabilities 1, 0.5, 0.2, 0.05.
  const std::vector<float> logits = {0.0f, std::log(0.5f), std::log(0.2f), std::log(0.05f)};
  SamplingParams params;
  params.min_p = 0.3f;
  expect_probs(probs_for(logits, params), {1 / 1.5, 0.5 / 1.5, 0, 0});
  params.min_p = 0.1f;
  expect_probs(probs_for(logits, params), {1 / 1.7, 0.5 / 1.7, 0.2 / 1.7, 0});
  // min_p = 1 keeps exactly the tokens tied with the maximum.
  params.min_p = 1.0f;
  expect_probs(probs_for({2.0f, 1.0f, 2.0f}, params), {0.5, 0, 0.5});
}

TEST(Sampler, PenaltiesOnCraftedLogits) {
  const std::vector<float> logits = {2.0f, -2.0f, 1.0f, 0.5f, 3.0f};
  // Prompt: token 0. Generated: 1, 1, 3.
  const std::vector<int32_t> tokens = {0, 1, 1, 3};
  const TokenHistory history{tokens, 1};
  SamplingParams params;
  params.repetition_penalty = 2.0f;
  params.presence_penalty = 0.5f;
  params.frequency_penalty = 0.25f;
  SamplingWorkspace ws(5);
  process_logits(logits, history, params, ws);
  const auto pl = ws.penalised_logits();
  EXPECT_FLOAT_EQ(pl[0], 1.0f);   // prompt only: 2 / 2, no presence/frequency
  EXPECT_FLOAT_EQ(pl[1], -5.0f);  // -2 * 2 - (0.5 + 0.25 * 2)
  EXPECT_FLOAT_EQ(pl[2], 1.0f);   // unseen
  EXPECT_FLOAT_EQ(pl[3], -0.5f);  // 0.5 / 2 - (0.5 + 0.25 * 1)
  EXPECT_FLOAT_EQ(pl[4], 3.0f);   // unseen
  // The workspace's marks are cleared: the next call without history is clean.
  process_logits(logits, {}, params, ws);
  for (size_t i = 0; i < logits.size(); ++i) EXPECT_EQ(ws.penalised_logits()[i], logits[i]);

  // A penalty can change the greedy choice.
  SamplingParams greedy;
  greedy.temperature = 0.0f;
  greedy.repetition_penalty = 2.0f;
  const std::vector<int32_t> gen = {0};
  SamplingWorkspace ws2(2);
  EXPECT_EQ(greedy_token(std::vector<float>{5.0f, 4.0f}, {gen, 0}, greedy, ws2), 1);
  greedy.repetition_penalty = 1.0f;
  EXPECT_EQ(greedy_token(std::vector<float>{5.0f, 4.0f}, {gen, 0}, greedy, ws2), 0);
}

TEST(Sampler, RejectsBadInputsAndStaysUsable) {
  SamplingParams params;
  params.repetition_penalty = 1.5f;
  SamplingWorkspace ws(3);
  EXPECT_NE(error_of([&] {
              process_logits(std::vector<float>{0, 1}, {}, params, ws);
            }).find("logits have 2 entries but the vocabulary has 3"),
            std::string::npos);
  EXPECT_NE(error_of([&] {
              process_logits(std::vector<float>{0, std::nanf(""), 1}, {}, params, ws);
            }).find("logits[1] = nan"),
            std::string::npos);
  EXPECT_NE(error_of([&] {
              process_logits(std::vector<float>{-kInf, -kInf, -kInf}, {}, params, ws);
            }).find("all 3 logits are -inf"),
            std::string::npos);
  const std::vector<int32_t> bad = {1, 2, 7};
  EXPECT_NE(error_of([&] {
              process_logits(std::vector<float>{0, 1, 2}, {bad, 0}, params, ws);
            }).find("history[2] = 7"),
            std::string::npos);
  // The failed call left no marks behind.
  process_logits(std::vector<float>{1, 1, 1}, {}, params, ws);
  for (float x : ws.penalised_logits()) EXPECT_EQ(x, 1.0f);
  EXPECT_THROW(SamplingWorkspace(0), Error);
}

// ---------------------------------------------------------------- pipeline vs reference

// A direct transcription of the documented pipeline: doubles, full sorts.
std::vector<double> reference_probs(const std::vector<float>& logits, const TokenHistory& h,
                                    const SamplingParams& p) {
  std::vector<float> l = logits;
  std::vector<int> count(l.size(), 0);
  std::vector<bool> seen(l.size(), false);
  for (size_t i = 0; i < h.tokens.size(); ++i) {
    seen[h.tokens[i]] = true;
    if (i >= h.num_prompt) ++count[h.tokens[i]];
  }
  for (size_t t = 0; t < l.size(); ++t) {
    if (!seen[t]) continue;
    l[t] = l[t] > 0 ? l[t] / p.repetition_penalty : l[t] * p.repetition_penalty;
    if (count[t] > 0)
      l[t] -= p.presence_penalty + p.frequency_penalty * static_cast<float>(count[t]);
  }
  const size_t v = l.size();
  std::vector<float> sorted_l = l;
  std::sort(sorted_l.begin(), sorted_l.end(), std::greater<float>());
  const float kth =
      (p.top_k > 0 && static_cast<size_t>(p.top_k) < v) ? sorted_l[p.top_k - 1] : -kInf;
  const double m = sorted_l[0];
  std::vector<double> w(v, 0.0);
  for (size_t i = 0; i < v; ++i) {
    if (l[i] >= kth) w[i] = std::exp((l[i] - m) / p.temperature);
  }
  std::vector<size_t> order(v);
  std::iota(order.begin(), order.end(), 0);
  std::stable_sort(order.begin(), order.end(), [&](size_t a, size_t b) { return w[a] > w[b]; });
  const double total = std::accumulate(w.begin(), w.end(), 0.0);
  double before = 0.0;
  for (size_t j = 0; j < v && p.top_p < 1.0f; ++j) {
    if (j > 0 && before >= p.top_p * total) w[order[j]] = 0.0;
    before += w[order[j]];
  }
  for (double& x : w) {
    if (x < p.min_p * 1.0) x = 0.0;
  }
  const double kept = std::accumulate(w.begin(), w.end(), 0.0);
  for (double& x : w) x /= kept;
  return w;
}

TEST(Sampler, MatchesReferenceOnRandomInputs) {
  Rng rng(2024);
  SamplingWorkspace ws(5000);
  int truncated_runs = 0;
  for (int trial = 0; trial < 40; ++trial) {
    std::vector<float> logits(5000);
    for (float& x : logits) x = static_cast<float>(8.0 * rng.uniform() - 4.0);
    std::vector<int32_t> hist(50);
    for (int32_t& t : hist) t = static_cast<int32_t>(rng.uniform() * 5000);
    SamplingParams p;
    p.temperature = static_cast<float>(0.3 + 1.2 * rng.uniform());
    p.top_k = (trial % 3 == 0) ? 0 : static_cast<int32_t>(1 + rng.uniform() * 3000);
    p.top_p = (trial % 4 == 1) ? 1.0f : static_cast<float>(0.05 + 0.9 * rng.uniform());
    p.min_p = (trial % 5 == 2) ? static_cast<float>(0.3 * rng.uniform()) : 0.0f;
    p.repetition_penalty = (trial % 2) ? 1.3f : 1.0f;
    p.presence_penalty = (trial % 3 == 1) ? 0.4f : 0.0f;
    p.frequency_penalty = (trial % 3 == 2) ? 0.2f : 0.0f;
    const TokenHistory h{hist, 20};
    const auto got = process_logits(logits, h, p, ws);
    const auto want = reference_probs(logits, h, p);
    int kept = 0;
    double sum = 0.0;
    for (size_t i = 0; i < want.size(); ++i) {
      ASSERT_EQ(got[i] > 0.0f, want[i] > 0.0) << "trial " << trial << " token " << i;
      ASSERT_NEAR(got[i], want[i], 1e-6 + 1e-4 * want[i]) << "trial " << trial << " token " << i;
      kept += got[i] > 0.0f;
      sum += got[i];
    }
    EXPECT_NEAR(sum, 1.0, 1e-5);
    EXPECT_EQ(static_cast<size_t>(kept), ws.support().size());
    truncated_runs += kept < 5000;
  }
  EXPECT_GT(truncated_runs, 20);  // the random settings really truncate
}

TEST(Sampler, SteadyStateStepsDoNotGrowTheWorkspace) {
  SamplingWorkspace ws(1000);
  std::vector<float> logits(1000);
  for (size_t i = 0; i < logits.size(); ++i) logits[i] = std::sin(static_cast<float>(i));
  std::vector<int32_t> hist = {1, 2, 3, 4, 5, 6, 7, 8};
  SamplingParams p;
  p.top_p = 0.9f;
  p.top_k = 50;
  p.repetition_penalty = 1.2f;
  process_logits(logits, {hist, 2}, p, ws);
  const size_t bytes = ws.capacity_bytes();
  const float* probs_data = ws.probs().data();
  for (int step = 0; step < 20; ++step) {
    hist[static_cast<size_t>(step) % hist.size()] = step;
    process_logits(logits, {hist, 2}, p, ws);
    EXPECT_EQ(ws.capacity_bytes(), bytes);
    EXPECT_EQ(ws.probs().data(), probs_data);
  }
}

// ---------------------------------------------------------------- sampling

TEST(Sampler, SeededRunsAreReproducible) {
  std::vector<float> logits(64);
  for (size_t i = 0; i < logits.size(); ++i) logits[i] = std::cos(0.7f * static_cast<float>(i));
  SamplingParams p;
  p.top_p = 0.95f;
  auto run = [&](uint64_t seed) {
    SamplingWorkspace ws(64);
    Rng rng(seed);
    std::vector<int32_t> out;
    for (int i = 0; i < 500; ++i) out.push_back(sample_token(logits, {out, 0}, p, ws, rng));
    return out;
  };
  EXPECT_EQ(run(11), run(11));
  EXPECT_NE(run(11), run(12));
}

TEST(Sampler, EmpiricalFrequenciesMatchTheDistribution) {
  // 8 tokens, T = 0.7, top-k 6: six tokens have mass (dof 5). 200k draws.
  const std::vector<float> logits = {1.0f, 0.5f, 2.0f, -1.0f, 0.0f, 1.5f, -3.0f, 0.2f};
  SamplingParams params;
  params.temperature = 0.7f;
  params.top_k = 6;
  SamplingWorkspace ws(8);
  const auto probs = to_double(process_logits(logits, {}, params, ws));
  Rng rng(123456789);
  constexpr int64_t kDraws = 200000;
  std::vector<int64_t> counts(8, 0);
  for (int64_t i = 0; i < kDraws; ++i) ++counts[static_cast<size_t>(sample(ws.probs(), rng))];
  int dof = 0;
  int64_t impossible = 0;
  const double chi2 = chi_square(counts, probs, kDraws, &dof, &impossible);
  EXPECT_EQ(dof, 5);
  EXPECT_EQ(impossible, 0);
  EXPECT_LT(chi2, chi_square_critical_001(dof)) << "chi2 " << chi2;
  RecordProperty("chi2", std::to_string(chi2));

  // The same counts are clearly rejected against a slightly different
  // distribution (T = 0.8), so the test has the power to fail.
  params.temperature = 0.8f;
  SamplingWorkspace ws2(8);
  const auto other = to_double(process_logits(logits, {}, params, ws2));
  EXPECT_GT(chi_square(counts, other, kDraws, &dof, &impossible), 10 * chi_square_critical_001(5));
}

// ---------------------------------------------------------------- speculative

TEST(Speculative, AcceptRuleEdgeCases) {
  const std::vector<float> p = {0.5f, 0.25f, 0.25f, 0.0f};
  const std::vector<float> q = {0.25f, 0.5f, 0.0f, 0.25f};
  EXPECT_TRUE(accept_draft(p, q, 0, 0.999999));  // p >= q: always
  EXPECT_TRUE(accept_draft(p, q, 1, 0.49));      // ratio 0.5
  EXPECT_FALSE(accept_draft(p, q, 1, 0.5));
  EXPECT_TRUE(accept_draft(p, q, 2, 0.999999));  // q = 0: ratio taken as 1
  EXPECT_FALSE(accept_draft(p, q, 3, 0.0));      // p = 0: never
  EXPECT_THROW(accept_draft(p, q, 4, 0.1), Error);
  EXPECT_THROW(accept_draft(p, std::vector<float>{1.0f}, 0, 0.1), Error);
}

TEST(Speculative, ResidualDistribution) {
  std::vector<float> out(3);
  residual_distribution(std::vector<float>{0.5f, 0.5f, 0.0f}, std::vector<float>{1.0f, 0.0f, 0.0f},
                        out);
  expect_probs(out, {0.0, 1.0, 0.0});
  residual_distribution(std::vector<float>{0.6f, 0.3f, 0.1f}, std::vector<float>{0.2f, 0.5f, 0.3f},
                        out);
  expect_probs(out, {1.0, 0.0, 0.0});
  // p == q: no residual mass, fall back to p.
  residual_distribution(std::vector<float>{0.6f, 0.3f, 0.1f}, std::vector<float>{0.6f, 0.3f, 0.1f},
                        out);
  expect_probs(out, {0.6, 0.3, 0.1});
  EXPECT_THROW(residual_distribution(std::vector<float>{1.0f}, std::vector<float>{1.0f, 0.0f}, out),
               Error);
}

// Draws a Dirichlet(1) distribution over v tokens with the listed tokens zeroed.
std::vector<float> random_distribution(Rng& rng, size_t v, const std::vector<size_t>& zeros) {
  std::vector<float> d(v);
  double z = 0.0;
  for (size_t i = 0; i < v; ++i) {
    d[i] = static_cast<float>(-std::log(1.0 - rng.uniform()));
    if (std::find(zeros.begin(), zeros.end(), i) != zeros.end()) d[i] = 0.0f;
    z += d[i];
  }
  for (float& x : d) x = static_cast<float>(x / z);
  return d;
}

TEST(Speculative, DraftThenVerifyEmitsTheTargetDistribution) {
  // For random p, q on 6 tokens (with supports that differ), emit a token the
  // speculative way 200k times and compare the frequencies with p.
  Rng rng(31337);
  const std::vector<std::vector<size_t>> p_zeros = {{}, {5}, {0, 3}};
  const std::vector<std::vector<size_t>> q_zeros = {{}, {0}, {1}};
  for (size_t pair = 0; pair < p_zeros.size(); ++pair) {
    const auto p = random_distribution(rng, 6, p_zeros[pair]);
    const auto q = random_distribution(rng, 6, q_zeros[pair]);
    std::vector<float> residual(6);
    residual_distribution(p, q, residual);
    constexpr int64_t kDraws = 200000;
    std::vector<int64_t> spec(6, 0), naive(6, 0);
    for (int64_t i = 0; i < kDraws; ++i) {
      const int32_t x = sample(q, rng);
      ++naive[static_cast<size_t>(x)];
      const int32_t emitted = accept_draft(p, q, x, rng.uniform()) ? x : sample(residual, rng);
      ++spec[static_cast<size_t>(emitted)];
    }
    const auto pd = to_double(p);
    int dof = 0;
    int64_t impossible = 0;
    const double chi2 = chi_square(spec, pd, kDraws, &dof, &impossible);
    EXPECT_EQ(impossible, 0) << "pair " << pair;
    EXPECT_LT(chi2, chi_square_critical_001(dof)) << "pair " << pair << " chi2 " << chi2;
    RecordProperty("chi2_pair" + std::to_string(pair), std::to_string(chi2));
    // Without the accept/residual step the draft's own distribution shows.
    EXPECT_GT(chi_square(naive, pd, kDraws, &dof, &impossible), 100 * chi_square_critical_001(dof))
        << "pair " << pair;
  }
}

// ---------------------------------------------------------------- stop strings

std::string feed_all(StopMatcher& m, const std::vector<std::string>& pieces, bool* stopped) {
  std::string out;
  *stopped = false;
  for (const std::string& piece : pieces) {
    auto step = m.feed(piece);
    out += step.emit;
    if (step.stopped) {
      *stopped = true;
      return out;
    }
  }
  return out + m.flush();
}

TEST(StopMatcher, HoldsBackPartialMatchesAcrossPieces) {
  StopMatcher m({"STOP"});
  auto s1 = m.feed("Hello S");
  EXPECT_EQ(s1.emit, "Hello ");
  EXPECT_FALSE(s1.stopped);
  EXPECT_EQ(m.held(), 1u);
  auto s2 = m.feed("TO");
  EXPECT_EQ(s2.emit, "");
  EXPECT_EQ(m.held(), 3u);
  auto s3 = m.feed("P and more");
  EXPECT_TRUE(s3.stopped);
  EXPECT_EQ(s3.emit, "");
  EXPECT_EQ(s3.stop_index, 0);
  EXPECT_THROW(m.feed("x"), Error);
}

TEST(StopMatcher, ReleasesFalseStartsAndFlushes) {
  StopMatcher m({"abc"});
  EXPECT_EQ(m.feed("ab").emit, "");
  EXPECT_EQ(m.feed("d").emit, "abd");
  EXPECT_EQ(m.feed("xa").emit, "x");
  EXPECT_EQ(m.flush(), "a");
}

TEST(StopMatcher, EarliestMatchWinsAndOverlapsAreFound) {
  bool stopped = false;
  StopMatcher a({"world", "lo w"});
  EXPECT_EQ(feed_all(a, {"hello world"}, &stopped), "hel");
  EXPECT_TRUE(stopped);
  // "aab" inside "aaab": the held prefix must shift by one, not reset.
  StopMatcher b({"aab"});
  EXPECT_EQ(feed_all(b, {"a", "a", "a", "b", "zzz"}, &stopped), "a");
  EXPECT_TRUE(stopped);
  // No stop strings: everything passes straight through.
  StopMatcher c({});
  EXPECT_EQ(feed_all(c, {"x", "y"}, &stopped), "xy");
  EXPECT_FALSE(stopped);
  // A multi-byte stop string split across pieces.
  StopMatcher d({"\xE2\x80\x94"});  // U+2014 EM DASH
  EXPECT_EQ(feed_all(d, {"a\xE2", "\x80", "\x94z"}, &stopped), "a");
  EXPECT_TRUE(stopped);
  StopMatcher e({"###"});
  EXPECT_EQ(feed_all(e, {"x##"}, &stopped), "x##");
  EXPECT_FALSE(stopped);
  EXPECT_THROW(StopMatcher({"ok", ""}), Error);
}

}  // namespace
}  // namespace specula
