// SPDX-License-Identifier: Apache-2.0
// A small Prometheus registry: counters, gauges and histograms (optionally
// with one label), rendered in the text exposition format (version 0.0.4).
// Thread-safe: every update and render may come from any thread.
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

namespace specula::metrics {

class Counter {
 public:
  void inc(double by = 1);  // by >= 0
  double value() const;

 private:
  mutable std::mutex mu_;
  double value_ = 0;
};

class Gauge {
 public:
  void set(double value);
  void inc(double by = 1);
  void dec(double by = 1);
  double value() const;

 private:
  mutable std::mutex mu_;
  double value_ = 0;
};

class Histogram {
 public:
  explicit Histogram(std::vector<double> upper_bounds);  // ascending; +Inf added
  void observe(double value);
  // Cumulative counts per bound (the last is +Inf), sum and count.
  struct Snapshot {
    std::vector<double> bounds;
    std::vector<uint64_t> cumulative;
    double sum = 0;
    uint64_t count = 0;
  };
  Snapshot snapshot() const;

 private:
  mutable std::mutex mu_;
  std::vector<double> bounds_;
  std::vector<uint64_t> counts_;  // per bucket, not cumulative; last is +Inf
  double sum_ = 0;
  uint64_t count_ = 0;
};

// Families are registered once (by name) and then updated through the
// returned references, which stay valid for the registry's life. Label values
// are escaped on render. A second registration of a name returns the same
// family's series when the type matches, and throws specula::Error otherwise.
class Registry {
 public:
  // `labels`: {"name", "value"} pairs of this series (empty for none).
  using Labels = std::vector<std::pair<std::string, std::string>>;
  Registry();
  ~Registry();  // defined where Family is complete
  Counter& counter(const std::string& name, const std::string& help, const Labels& labels = {});
  Gauge& gauge(const std::string& name, const std::string& help, const Labels& labels = {});
  Histogram& histogram(const std::string& name, const std::string& help,
                       const std::vector<double>& upper_bounds, const Labels& labels = {});
  // The text exposition: # HELP / # TYPE per family, then its series; counters
  // are named as registered (callers end them in _total).
  std::string render() const;

 private:
  struct Family;
  mutable std::mutex mu_;
  std::map<std::string, std::unique_ptr<Family>> families_;
};

}  // namespace specula::metrics
