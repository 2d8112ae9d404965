// SPDX-License-Identifier: Apache-2.0
#include "engine/speculative/verify_scheduler.h"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>

#include "engine/core/error.h"
#include "engine/io/json_util.h"

namespace specula::speculative {
namespace {

constexpr const char* kSpsKind = "specula-sps-table";
constexpr int kSpsVersion = 1;

}  // namespace

SpsTable::SpsTable(std::vector<SpsPoint> points, std::string device, std::string model)
    : points_(std::move(points)), device_(std::move(device)), model_(std::move(model)) {
  if (points_.empty()) fail("SPS table: no points");
  for (size_t i = 0; i < points_.size(); ++i) {
    const SpsPoint& p = points_[i];
    if (p.tokens < 1 || p.tokens > kMaxTokens) {
      fail("SPS table: point {} has tokens = {} (must be in [1, {}])", i, p.tokens, kMaxTokens);
    }
    if (i > 0 && p.tokens <= points_[i - 1].tokens) {
      fail("SPS table: point {} has tokens = {} after {} (must increase strictly)", i, p.tokens,
           points_[i - 1].tokens);
    }
    if (!std::isfinite(p.steps_per_sec) || p.steps_per_sec <= 0.0) {
      fail("SPS table: point {} (tokens {}) has steps_per_sec = {} (must be finite and > 0)", i,
           p.tokens, p.steps_per_sec);
    }
  }
  const int64_t last = points_.back().tokens;
  dense_.assign(static_cast<size_t>(last) + 1, 0.0);
  size_t seg = 0;  // points_[seg].tokens <= B < points_[seg + 1].tokens
  for (int64_t b = 1; b <= last; ++b) {
    if (b <= points_.front().tokens) {
      dense_[b] = points_.front().steps_per_sec;
      continue;
    }
    while (points_[seg + 1].tokens < b) ++seg;
    const SpsPoint& lo = points_[seg];
    const SpsPoint& hi = points_[seg + 1];
    if (b == hi.tokens) {  // a profiled size reads back exactly what was profiled
      dense_[b] = hi.steps_per_sec;
      continue;
    }
    const double f =
        static_cast<double>(b - lo.tokens) / static_cast<double>(hi.tokens - lo.tokens);
    const double time = (1.0 - f) / lo.steps_per_sec + f / hi.steps_per_sec;
    dense_[b] = 1.0 / time;
  }
}

double SpsTable::steps_per_sec(int64_t tokens) const {
  if (points_.empty()) fail("SPS table: lookup of B = {} in an empty table", tokens);
  if (tokens < 1) fail("SPS table: lookup of B = {} (must be >= 1)", tokens);
  const int64_t last = points_.back().tokens;
  if (tokens <= last) return dense_[tokens];
  return points_.back().steps_per_sec * static_cast<double>(last) / static_cast<double>(tokens);
}

std::string SpsTable::to_json() const {
  nlohmann::ordered_json doc;
  doc["kind"] = kSpsKind;
  doc["version"] = kSpsVersion;
  doc["device"] = device_;
  doc["model"] = model_;
  nlohmann::ordered_json pts = nlohmann::ordered_json::array();
  for (const SpsPoint& p : points_) {
    nlohmann::ordered_json e;
    e["tokens"] = p.tokens;
    e["steps_per_sec"] = p.steps_per_sec;
    pts.push_back(std::move(e));
  }
  doc["points"] = std::move(pts);
  return doc.dump(1) + "\n";
}

SpsTable SpsTable::from_json(const std::string& text, const std::string& origin) {
  const nlohmann::json doc = io::parse_json_text(text, origin);
  if (!doc.is_object())
    fail("{}: the top level is {} (expected an object)", origin, io::json_type_name(doc));
  auto field = [&](const char* name) -> const nlohmann::json& {
    if (!doc.contains(name)) fail("{}: missing field '{}'", origin, name);
    return doc[name];
  };
  const nlohmann::json& kind = field("kind");
  if (!kind.is_string() || kind.get<std::string>() != kSpsKind) {
    fail("{}: kind is {} (expected \"{}\")", origin, io::json_excerpt(kind), kSpsKind);
  }
  const nlohmann::json& version = field("version");
  if (!version.is_number_integer() || version.get<int64_t>() != kSpsVersion) {
    fail("{}: version is {} (this build reads version {})", origin, io::json_excerpt(version),
         kSpsVersion);
  }
  std::string names[2];
  const char* keys[2] = {"device", "model"};
  for (int i = 0; i < 2; ++i) {
    if (!doc.contains(keys[i])) continue;
    const nlohmann::json& v = doc[keys[i]];
    if (!v.is_string()) {
      fail("{}: {} is {} (expected a string)", origin, keys[i], io::json_type_name(v));
    }
    names[i] = v.get<std::string>();
  }
  const nlohmann::json& pts = field("points");
  if (!pts.is_array())
    fail("{}: points is {} (expected an array)", origin, io::json_type_name(pts));
  std::vector<SpsPoint> points;
  for (size_t i = 0; i < pts.size(); ++i) {
    const nlohmann::json& e = pts[i];
    if (!e.is_object() || !e.contains("tokens") || !e.contains("steps_per_sec") ||
        !e["tokens"].is_number_integer() || !e["steps_per_sec"].is_number()) {
      fail("{}: points[{}] is {} (expected {{\"tokens\": integer, \"steps_per_sec\": number}})",
           origin, i, io::json_excerpt(e));
    }
    points.push_back(
        {.tokens = e["tokens"].get<int64_t>(), .steps_per_sec = e["steps_per_sec"].get<double>()});
  }
  try {
    return SpsTable(std::move(points), names[0], names[1]);
  } catch (const Error& e) {
    fail("{}: {}", origin, e.what());
  }
}

void SpsTable::save(const std::string& path) const {
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  if (!out) fail("{}: cannot open the SPS table for writing", path);
  out << to_json();
  out.flush();
  if (!out) fail("{}: write error while saving the SPS table", path);
}

SpsTable SpsTable::load(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) fail("{}: cannot open the SPS table", path);
  std::stringstream text;
  text << in.rdbuf();
  return from_json(text.str(), path);
}

std::string SpsTable::describe() const {
  std::string out = fmt::format("SPS table: device \"{}\", model \"{}\", {} points\n", device_,
                                model_, points_.size());
  out += fmt::format("  {:>8}  {:>12}  {:>10}  {:>12}\n", "B", "steps/s", "ms/step", "tokens/s");
  for (const SpsPoint& p : points_) {
    out += fmt::format("  {:>8}  {:>12.2f}  {:>10.4f}  {:>12.1f}\n", p.tokens, p.steps_per_sec,
                       1000.0 / p.steps_per_sec, p.steps_per_sec * static_cast<double>(p.tokens));
  }
  return out;
}

std::optional<SpsTable> load_sps_cache(const std::string& path, const std::string& device,
                                       const std::string& model, int64_t max_tokens) {
  if (!std::filesystem::exists(path)) return std::nullopt;
  SpsTable t = SpsTable::load(path);
  if (t.device() != device || t.model() != model) {
    fail(
        "SPS cache {}: profiled on device \"{}\" for model \"{}\", but this run is device "
        "\"{}\" with model \"{}\"; remove the file or give another --sps-cache",
        path, t.device(), t.model(), device, model);
  }
  if (t.points().back().tokens < max_tokens) return std::nullopt;
  return t;
}

const PrefixSchedule& VerifyScheduler::schedule(std::span<const double> confidences, int stride,
                                                std::span<const int> draft_lengths,
                                                const SpsTable& sps) {
  const int rows = static_cast<int>(draft_lengths.size());
  if (stride < 0) fail("verify scheduler: stride {} must be >= 0", stride);
  if (confidences.size() < static_cast<size_t>(rows) * static_cast<size_t>(stride)) {
    fail("verify scheduler: {} confidences for {} rows of stride {}", confidences.size(), rows,
         stride);
  }
  candidates_.clear();
  for (int r = 0; r < rows; ++r) {
    const int k = draft_lengths[r];
    if (k < 0 || k > stride) {
      fail("verify scheduler: row {} has {} drafts (must be in [0, {}])", r, k, stride);
    }
    double survival = 1.0;
    for (int j = 0; j < k; ++j) {
      const double c = confidences[static_cast<size_t>(r) * stride + j];
      if (!std::isfinite(c) || c < 0.0 || c > 1.0) {
        fail("verify scheduler: row {} draft {} has confidence {} (must be finite, in [0, 1])", r,
             j, c);
      }
      survival *= c;  // c <= 1, so survival never rises along the row
      if (survival > 0.0) candidates_.push_back({survival, r, j + 1});
    }
  }
  std::sort(candidates_.begin(), candidates_.end(), [](const Candidate& a, const Candidate& b) {
    if (a.survival != b.survival) return a.survival > b.survival;
    if (a.row != b.row) return a.row < b.row;
    return a.position < b.position;
  });

  result_.lengths.assign(rows, 0);
  result_.batch_tokens = rows;
  result_.expected_tokens = rows;
  result_.throughput = rows > 0 ? rows * sps.steps_per_sec(rows) : 0.0;
  for (const Candidate& c : candidates_) {
    const int64_t batch = result_.batch_tokens + 1;
    const double tau = result_.expected_tokens + c.survival;
    const double theta = tau * sps.steps_per_sec(batch);
    if (!(theta > result_.throughput)) break;  // the first drop ends the scan (see header)
    // Descending survival with ties to the lower position admits a row's
    // positions in order.
    SPECULA_CHECK_EQ(c.position, result_.lengths[c.row] + 1, "row {} admitted out of order", c.row);
    result_.lengths[c.row] = c.position;
    result_.batch_tokens = batch;
    result_.expected_tokens = tau;
    result_.throughput = theta;
  }
  return result_;
}

const PrefixSchedule& VerifyScheduler::schedule(const std::vector<std::vector<double>>& rows,
                                                const SpsTable& sps) {
  int stride = 0;
  for (const auto& row : rows) stride = std::max(stride, static_cast<int>(row.size()));
  flat_.assign(rows.size() * static_cast<size_t>(stride), 0.0);
  lengths_.resize(rows.size());
  for (size_t r = 0; r < rows.size(); ++r) {
    std::copy(rows[r].begin(), rows[r].end(), flat_.begin() + r * stride);
    lengths_[r] = static_cast<int>(rows[r].size());
  }
  return schedule(flat_, stride, lengths_, sps);
}

}  // namespace specula::speculative
