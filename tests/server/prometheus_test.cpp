// SPDX-License-Identifier: Apache-2.0
// The Prometheus registry (server/metrics/prometheus.h): exact text exposition,
// histogram buckets, label escaping, thread safety and type checks.
#include "server/metrics/prometheus.h"

#include <gtest/gtest.h>

#include <cmath>
#include <limits>
#include <thread>
#include <vector>

#include "engine/core/error.h"

namespace specula::metrics {
namespace {

TEST(PrometheusRegistry, RendersSmallRegistryExactly) {
  Registry r;
  r.counter("specula:prompt_tokens_total", "Prompt tokens processed.").inc(12);
  r.gauge("specula:num_requests_running", "Requests being decoded.").set(3);
  r.counter("specula:requests_total", "Finished requests.", {{"finish_reason", "stop"}}).inc(2);
  r.counter("specula:requests_total", "Finished requests.", {{"finish_reason", "length"}}).inc();
  r.gauge("specula:tau", "Mean accepted length.").set(2.5);
  Histogram& h =
      r.histogram("specula:e2e_request_latency_seconds", "Request latency.", {0.005, 0.5, 10});
  h.observe(0.001);
  h.observe(0.25);
  h.observe(20);

  EXPECT_EQ(r.render(),
            "# HELP specula:e2e_request_latency_seconds Request latency.\n"
            "# TYPE specula:e2e_request_latency_seconds histogram\n"
            "specula:e2e_request_latency_seconds_bucket{le=\"0.005\"} 1\n"
            "specula:e2e_request_latency_seconds_bucket{le=\"0.5\"} 2\n"
            "specula:e2e_request_latency_seconds_bucket{le=\"10\"} 2\n"
            "specula:e2e_request_latency_seconds_bucket{le=\"+Inf\"} 3\n"
            "specula:e2e_request_latency_seconds_sum 20.251\n"
            "specula:e2e_request_latency_seconds_count 3\n"
            "# HELP specula:num_requests_running Requests being decoded.\n"
            "# TYPE specula:num_requests_running gauge\n"
            "specula:num_requests_running 3\n"
            "# HELP specula:prompt_tokens_total Prompt tokens processed.\n"
            "# TYPE specula:prompt_tokens_total counter\n"
            "specula:prompt_tokens_total 12\n"
            "# HELP specula:requests_total Finished requests.\n"
            "# TYPE specula:requests_total counter\n"
            "specula:requests_total{finish_reason=\"stop\"} 2\n"
            "specula:requests_total{finish_reason=\"length\"} 1\n"
            "# HELP specula:tau Mean accepted length.\n"
            "# TYPE specula:tau gauge\n"
            "specula:tau 2.5\n");
}

TEST(PrometheusRegistry, ReRegistrationReturnsTheSameSeries) {
  Registry r;
  Counter& a = r.counter("x_total", "help");
  Counter& b = r.counter("x_total", "other help");
  EXPECT_EQ(&a, &b);
  Counter& c = r.counter("x_total", "help", {{"k", "v"}});
  EXPECT_NE(&a, &c);
  EXPECT_EQ(&c, &r.counter("x_total", "help", {{"k", "v"}}));
  Histogram& h1 = r.histogram("h", "help", {1, 2});
  EXPECT_EQ(&h1, &r.histogram("h", "help", {1, 2}));
  EXPECT_THROW(r.histogram("h", "help", {1, 3}), Error);
}

TEST(PrometheusRegistry, TypeMismatchReRegistrationThrows) {
  Registry r;
  r.counter("specula:things", "help");
  EXPECT_THROW(r.gauge("specula:things", "help"), Error);
  EXPECT_THROW(r.histogram("specula:things", "help", {1}), Error);
  r.gauge("g", "help");
  EXPECT_THROW(r.counter("g", "help"), Error);
  r.histogram("h", "help", {1});
  EXPECT_THROW(r.counter("h", "help", {{"a", "b"}}), Error);
  try {
    r.gauge("specula:things", "help");
    ADD_FAILURE() << "no throw";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("specula:things"), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("counter"), std::string::npos) << e.what();
  }
}

TEST(PrometheusRegistry, InvalidNamesThrow) {
  Registry r;
  EXPECT_THROW(r.counter("1abc", "help"), Error);
  EXPECT_THROW(r.counter("a-b", "help"), Error);
  EXPECT_THROW(r.counter("", "help"), Error);
  EXPECT_THROW(r.counter("ok", "help", {{"bad:label", "v"}}), Error);
  EXPECT_THROW(r.counter("ok", "help", {{"a", "1"}, {"a", "2"}}), Error);
  EXPECT_THROW(r.histogram("hist", "help", {1}, {{"le", "1"}}), Error);
  EXPECT_THROW(r.histogram("hist", "help", {2, 1}), Error);
  EXPECT_THROW(r.histogram("hist", "help", {1, 1}), Error);
  EXPECT_NO_THROW(r.counter("a:b_c:d", "help", {{"_x9", "v"}}));
}

TEST(PrometheusHistogram, ValueOnABoundGoesIntoThatBucket) {
  Histogram h({0.1, 1, 5});
  h.observe(0.1);  // == bound: le="0.1"
  h.observe(1);    // == bound: le="1"
  h.observe(1.0000001);
  h.observe(5);
  h.observe(5.5);
  h.observe(-3);  // below every bound: first bucket
  const Histogram::Snapshot s = h.snapshot();
  ASSERT_EQ(s.bounds.size(), 4u);
  EXPECT_EQ(s.bounds[0], 0.1);
  EXPECT_TRUE(std::isinf(s.bounds[3]));
  EXPECT_EQ(s.cumulative, (std::vector<uint64_t>{2, 3, 5, 6}));
  EXPECT_EQ(s.count, 6u);
  EXPECT_DOUBLE_EQ(s.sum, 0.1 + 1 + 1.0000001 + 5 + 5.5 - 3);
}

TEST(PrometheusHistogram, ExplicitInfBoundIsAcceptedOnce) {
  Histogram h({1, std::numeric_limits<double>::infinity()});
  h.observe(2);
  const Histogram::Snapshot s = h.snapshot();
  ASSERT_EQ(s.bounds.size(), 2u);
  EXPECT_EQ(s.cumulative, (std::vector<uint64_t>{0, 1}));
}

TEST(PrometheusHistogram, LabelledSeriesRenderWithLeLast) {
  Registry r;
  r.histogram("lat", "Latency.", {1}, {{"model", "gemma"}}).observe(0.5);
  EXPECT_EQ(r.render(),
            "# HELP lat Latency.\n"
            "# TYPE lat histogram\n"
            "lat_bucket{model=\"gemma\",le=\"1\"} 1\n"
            "lat_bucket{model=\"gemma\",le=\"+Inf\"} 1\n"
            "lat_sum{model=\"gemma\"} 0.5\n"
            "lat_count{model=\"gemma\"} 1\n");
}

TEST(PrometheusRegistry, EscapesLabelValuesAndHelp) {
  Registry r;
  r.gauge("g", "line one\nback\\slash \"quoted\"", {{"path", "C:\\dir \"x\"\nnext"}}).set(1);
  EXPECT_EQ(r.render(),
            "# HELP g line one\\nback\\\\slash \"quoted\"\n"
            "# TYPE g gauge\n"
            "g{path=\"C:\\\\dir \\\"x\\\"\\nnext\"} 1\n");
}

TEST(PrometheusRegistry, FormatsNumbersSoPrometheusParsesThem) {
  Registry r;
  r.gauge("v", "h", {{"k", "int"}}).set(42);
  r.gauge("v", "h", {{"k", "big"}}).set(1e15);
  r.gauge("v", "h", {{"k", "neg"}}).set(-7);
  r.gauge("v", "h", {{"k", "negzero"}}).set(-0.0);
  r.gauge("v", "h", {{"k", "frac"}}).set(0.1);
  r.gauge("v", "h", {{"k", "third"}}).set(1.0 / 3);
  r.gauge("v", "h", {{"k", "huge"}}).set(1e300);
  r.gauge("v", "h", {{"k", "inf"}}).set(std::numeric_limits<double>::infinity());
  r.gauge("v", "h", {{"k", "ninf"}}).set(-std::numeric_limits<double>::infinity());
  r.gauge("v", "h", {{"k", "nan"}}).set(std::numeric_limits<double>::quiet_NaN());
  EXPECT_EQ(r.render(),
            "# HELP v h\n"
            "# TYPE v gauge\n"
            "v{k=\"int\"} 42\n"
            "v{k=\"big\"} 1000000000000000\n"
            "v{k=\"neg\"} -7\n"
            "v{k=\"negzero\"} 0\n"
            "v{k=\"frac\"} 0.1\n"
            "v{k=\"third\"} 0.3333333333333333\n"
            "v{k=\"huge\"} 1e+300\n"
            "v{k=\"inf\"} +Inf\n"
            "v{k=\"ninf\"} -Inf\n"
            "v{k=\"nan\"} NaN\n");
  // Every printed value reads back as the same double.
  for (const double x : {0.1, 1.0 / 3, 2.0 / 7 * 1e-9, 123456.789, 1e300}) {
    Registry one;
    one.gauge("x", "h").set(x);
    const std::string text = one.render();
    const std::string value = text.substr(text.rfind(' ') + 1);
    EXPECT_EQ(std::stod(value), x) << value;
  }
}

TEST(PrometheusRegistry, CounterRejectsNegativeIncrements) {
  Counter c;
  EXPECT_THROW(c.inc(-1), Error);
  EXPECT_EQ(c.value(), 0);
}

TEST(PrometheusRegistry, ConcurrentUpdatesSumCorrectly) {
  Registry r;
  constexpr int kThreads = 8;
  constexpr int kPerThread = 20000;
  std::vector<std::thread> threads;
  for (int t = 0; t < kThreads; ++t) {
    threads.emplace_back([&r, t] {
      // Registration races too: every thread looks the same series up.
      Counter& total = r.counter("specula:ops_total", "ops");
      Counter& mine =
          r.counter("specula:ops_by_thread_total", "ops", {{"thread", std::to_string(t % 2)}});
      Gauge& g = r.gauge("specula:level", "level");
      Histogram& h = r.histogram("specula:sizes", "sizes", {1, 10});
      for (int i = 0; i < kPerThread; ++i) {
        total.inc();
        mine.inc(2);
        g.inc();
        h.observe(i % 20);
        if (i % 1000 == 0) (void)r.render();  // renders interleave with updates
      }
    });
  }
  for (auto& th : threads) th.join();
  EXPECT_EQ(r.counter("specula:ops_total", "ops").value(), kThreads * kPerThread);
  EXPECT_EQ(r.counter("specula:ops_by_thread_total", "ops", {{"thread", "0"}}).value(),
            kThreads / 2 * kPerThread * 2);
  EXPECT_EQ(r.gauge("specula:level", "level").value(), kThreads * kPerThread);
  const auto s = r.histogram("specula:sizes", "sizes", {1, 10}).snapshot();
  EXPECT_EQ(s.count, static_cast<uint64_t>(kThreads * kPerThread));
  // i % 20 in 0..19: 2 of 20 values <= 1, 11 of 20 <= 10.
  EXPECT_EQ(s.cumulative[0], static_cast<uint64_t>(kThreads * kPerThread / 10));
  EXPECT_EQ(s.cumulative[1], static_cast<uint64_t>(kThreads * kPerThread / 20 * 11));
  EXPECT_EQ(s.cumulative[2], s.count);
}

}  // namespace
}  // namespace specula::metrics
