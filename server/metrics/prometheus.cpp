// SPDX-License-Identifier: Apache-2.0
#include "server/metrics/prometheus.h"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <variant>

#include "engine/core/error.h"

namespace specula::metrics {

namespace {

// Metric names: [a-zA-Z_:][a-zA-Z0-9_:]*; label names the same without ':'.
bool valid_name(const std::string& name, bool allow_colon) {
  if (name.empty()) return false;
  for (size_t i = 0; i < name.size(); ++i) {
    const char c = name[i];
    const bool alpha = (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || c == '_';
    const bool digit = c >= '0' && c <= '9';
    if (alpha || (c == ':' && allow_colon) || (digit && i > 0)) continue;
    return false;
  }
  return true;
}

// A sample value as Prometheus parses it: integers without an exponent where
// they are exact, otherwise the shortest text that reads back as the same
// double; +Inf, -Inf and NaN spelled the way the format wants them.
std::string format_value(double v) {
  if (std::isnan(v)) return "NaN";
  if (std::isinf(v)) return v > 0 ? "+Inf" : "-Inf";
  constexpr double kExactIntegers = 9007199254740992.0;  // 2^53
  if (v == std::trunc(v) && std::fabs(v) <= kExactIntegers) {
    return fmt::format("{}", static_cast<int64_t>(v));  // also turns -0 into "0"
  }
  return fmt::format("{}", v);  // shortest round-trip representation
}

std::string escape_label_value(const std::string& s) {
  std::string out;
  out.reserve(s.size());
  for (const char c : s) {
    if (c == '\\') {
      out += "\\\\";
    } else if (c == '"') {
      out += "\\\"";
    } else if (c == '\n') {
      out += "\\n";
    } else {
      out += c;
    }
  }
  return out;
}

// HELP text escapes backslash and newline (not quotes).
std::string escape_help(const std::string& s) {
  std::string out;
  out.reserve(s.size());
  for (const char c : s) {
    if (c == '\\') {
      out += "\\\\";
    } else if (c == '\n') {
      out += "\\n";
    } else {
      out += c;
    }
  }
  return out;
}

// `{a="x",b="y"}` with an optional trailing le label; "" when there are none.
std::string label_text(const Registry::Labels& labels, const std::string* le = nullptr) {
  if (labels.empty() && le == nullptr) return "";
  std::string out = "{";
  bool first = true;
  for (const auto& [name, value] : labels) {
    if (!first) out += ',';
    first = false;
    out += name;
    out += "=\"";
    out += escape_label_value(value);
    out += '"';
  }
  if (le != nullptr) {
    if (!first) out += ',';
    out += "le=\"";
    out += *le;
    out += '"';
  }
  out += '}';
  return out;
}

std::vector<double> checked_bounds(std::vector<double> bounds) {
  // A trailing +Inf is implied; accept it written out too.
  if (!bounds.empty() && std::isinf(bounds.back()) && bounds.back() > 0) bounds.pop_back();
  for (size_t i = 0; i < bounds.size(); ++i) {
    if (!std::isfinite(bounds[i])) {
      fail("histogram bucket bound {} is {}; bounds must be finite (+Inf is added)", i, bounds[i]);
    }
    if (i > 0 && !(bounds[i - 1] < bounds[i])) {
      fail("histogram bucket bounds must ascend strictly, but bound {} ({}) follows {}", i,
           bounds[i], bounds[i - 1]);
    }
  }
  return bounds;
}

}  // namespace

// ---- Counter ----

void Counter::inc(double by) {
  if (!(by >= 0)) fail("a counter only goes up, but was incremented by {}", by);
  std::lock_guard lock(mu_);
  value_ += by;
}

double Counter::value() const {
  std::lock_guard lock(mu_);
  return value_;
}

// ---- Gauge ----

void Gauge::set(double value) {
  std::lock_guard lock(mu_);
  value_ = value;
}

void Gauge::inc(double by) {
  std::lock_guard lock(mu_);
  value_ += by;
}

void Gauge::dec(double by) {
  std::lock_guard lock(mu_);
  value_ -= by;
}

double Gauge::value() const {
  std::lock_guard lock(mu_);
  return value_;
}

// ---- Histogram ----

Histogram::Histogram(std::vector<double> upper_bounds)
    : bounds_(checked_bounds(std::move(upper_bounds))), counts_(bounds_.size() + 1, 0) {}

void Histogram::observe(double value) {
  // The first bucket whose bound is >= value (le is inclusive); NaN and values
  // above every bound land in +Inf.
  size_t bucket = bounds_.size();
  if (!std::isnan(value)) {
    bucket = static_cast<size_t>(std::lower_bound(bounds_.begin(), bounds_.end(), value) -
                                 bounds_.begin());
  }
  std::lock_guard lock(mu_);
  ++counts_[bucket];
  sum_ += value;
  ++count_;
}

Histogram::Snapshot Histogram::snapshot() const {
  Snapshot s;
  s.bounds = bounds_;
  s.bounds.push_back(std::numeric_limits<double>::infinity());
  std::lock_guard lock(mu_);
  s.cumulative.reserve(counts_.size());
  uint64_t running = 0;
  for (const uint64_t c : counts_) {
    running += c;
    s.cumulative.push_back(running);
  }
  s.sum = sum_;
  s.count = count_;
  return s;
}

// ---- Registry ----

enum class Type { kCounter, kGauge, kHistogram };

namespace {
const char* type_name(Type t) {
  switch (t) {
    case Type::kCounter:
      return "counter";
    case Type::kGauge:
      return "gauge";
    case Type::kHistogram:
      return "histogram";
  }
  return "untyped";
}
}  // namespace

struct Registry::Family {
  Type type;
  std::string help;
  std::vector<double> bounds;  // histograms: as checked, without +Inf
  struct Series {
    Labels labels;
    std::variant<std::unique_ptr<Counter>, std::unique_ptr<Gauge>, std::unique_ptr<Histogram>>
        metric;
  };
  std::vector<Series> series;  // in registration order
};

Registry::Registry() = default;
Registry::~Registry() = default;

namespace {

void check_labels(const std::string& family, const Registry::Labels& labels, bool histogram) {
  for (size_t i = 0; i < labels.size(); ++i) {
    const std::string& name = labels[i].first;
    if (!valid_name(name, /*allow_colon=*/false) || name.rfind("__", 0) == 0) {
      fail("metric {}: label name '{}' is not a valid Prometheus label name", family, name);
    }
    if (histogram && name == "le") {
      fail("metric {}: a histogram cannot have a label named 'le' (the bucket label)", family);
    }
    for (size_t j = 0; j < i; ++j) {
      if (labels[j].first == name) fail("metric {}: label '{}' is given twice", family, name);
    }
  }
}

}  // namespace

// Finds or creates the family `name` of type `type` and its series `labels`;
// `make` builds a new series' metric. Callers hold mu_.
// (Generic in the map so that it need not name the private Registry::Family.)
template <typename Metric, typename Families, typename Make>
static Metric& find_or_add(Families& families, const std::string& name, const std::string& help,
                           Type type, const Registry::Labels& labels,
                           const std::vector<double>* bounds, Make make) {
  using Family = typename Families::mapped_type::element_type;
  if (!valid_name(name, /*allow_colon=*/true)) {
    fail("'{}' is not a valid Prometheus metric name ([a-zA-Z_:][a-zA-Z0-9_:]*)", name);
  }
  check_labels(name, labels, type == Type::kHistogram);
  auto it = families.find(name);
  if (it == families.end()) {
    auto family = std::make_unique<Family>();
    family->type = type;
    family->help = help;
    if (bounds != nullptr) family->bounds = *bounds;
    it = families.emplace(name, std::move(family)).first;
  }
  Family& family = *it->second;
  if (family.type != type) {
    fail("metric {} is registered as a {} and cannot be registered again as a {}", name,
         type_name(family.type), type_name(type));
  }
  if (bounds != nullptr && family.bounds != *bounds) {
    fail("histogram {} is registered with other bucket bounds", name);
  }
  for (auto& series : family.series) {
    if (series.labels == labels) return *std::get<std::unique_ptr<Metric>>(series.metric);
  }
  family.series.push_back({labels, make()});
  return *std::get<std::unique_ptr<Metric>>(family.series.back().metric);
}

Counter& Registry::counter(const std::string& name, const std::string& help, const Labels& labels) {
  std::lock_guard lock(mu_);
  return find_or_add<Counter>(families_, name, help, Type::kCounter, labels, nullptr,
                              [] { return std::make_unique<Counter>(); });
}

Gauge& Registry::gauge(const std::string& name, const std::string& help, const Labels& labels) {
  std::lock_guard lock(mu_);
  return find_or_add<Gauge>(families_, name, help, Type::kGauge, labels, nullptr,
                            [] { return std::make_unique<Gauge>(); });
}

Histogram& Registry::histogram(const std::string& name, const std::string& help,
                               const std::vector<double>& upper_bounds, const Labels& labels) {
  const std::vector<double> bounds = checked_bounds(upper_bounds);
  std::lock_guard lock(mu_);
  return find_or_add<Histogram>(families_, name, help, Type::kHistogram, labels, &bounds,
                                [&] { return std::make_unique<Histogram>(bounds); });
}

std::string Registry::render() const {
  std::string out;
  std::lock_guard lock(mu_);
  for (const auto& [name, family] : families_) {
    out += "# HELP " + name + " " + escape_help(family->help) + "\n";
    out += "# TYPE " + name + " " + type_name(family->type) + "\n";
    for (const auto& series : family->series) {
      switch (family->type) {
        case Type::kCounter: {
          const double v = std::get<std::unique_ptr<Counter>>(series.metric)->value();
          out += name + label_text(series.labels) + " " + format_value(v) + "\n";
          break;
        }
        case Type::kGauge: {
          const double v = std::get<std::unique_ptr<Gauge>>(series.metric)->value();
          out += name + label_text(series.labels) + " " + format_value(v) + "\n";
          break;
        }
        case Type::kHistogram: {
          const Histogram::Snapshot s =
              std::get<std::unique_ptr<Histogram>>(series.metric)->snapshot();
          for (size_t i = 0; i < s.bounds.size(); ++i) {
            const std::string le = format_value(s.bounds[i]);
            out += name + "_bucket" + label_text(series.labels, &le) + " " +
                   format_value(static_cast<double>(s.cumulative[i])) + "\n";
          }
          out += name + "_sum" + label_text(series.labels) + " " + format_value(s.sum) + "\n";
          out +=
              name + "_count" + label_text(series.labels) + " " + fmt::format("{}", s.count) + "\n";
          break;
        }
      }
    }
  }
  return out;
}

}  // namespace specula::metrics
