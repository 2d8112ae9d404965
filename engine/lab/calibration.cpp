// SPDX-License-Identifier: Apache-2.0
#include "engine/lab/calibration.h"

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>

#include "engine/core/error.h"
#include "engine/io/json_util.h"

namespace specula::lab {
namespace {

void check_round(const DraftRound& round, size_t index) {
  if (round.accepted < 0 || static_cast<size_t>(round.accepted) > round.confidences.size()) {
    fail("calibration round {}: accepted = {} is outside [0, {}] (the drafts it holds)", index,
         round.accepted, round.confidences.size());
  }
}

// A round whose confidences are all finite probabilities; the others are
// dropped whole by STS (see fit_sts).
bool usable_round(const DraftRound& round) {
  return std::all_of(round.confidences.begin(), round.confidences.end(),
                     [](double c) { return std::isfinite(c) && c >= 0.0 && c <= 1.0; });
}

double logit(double c) {
  const double x = std::clamp(c, kStsClamp, 1.0 - kStsClamp);
  return std::log(x / (1.0 - x));
}

double sigmoid(double z) {
  return 1.0 / (1.0 + std::exp(-z));
}

int bin_of(double p, int bins) {
  const double x = std::clamp(p, 0.0, 1.0);
  return std::min(bins - 1, static_cast<int>(x * bins));
}

// The survival products at `position` (under `temperatures`) and the prefix
// labels of the usable rounds that drafted it.
void survival_at(std::span<const DraftRound> rounds, std::span<const double> temperatures,
                 int position, std::vector<double>& predicted, std::vector<uint8_t>& observed) {
  predicted.clear();
  observed.clear();
  std::vector<double> products;
  for (size_t r = 0; r < rounds.size(); ++r) {
    const DraftRound& round = rounds[r];
    check_round(round, r);
    if (static_cast<size_t>(position) >= round.confidences.size() || !usable_round(round)) {
      continue;
    }
    products.resize(round.confidences.size());
    survival_products(round.confidences, temperatures, products);
    predicted.push_back(products[position]);
    observed.push_back(position < round.accepted ? 1 : 0);
  }
}

}  // namespace

std::vector<CalibrationSample> samples_from_rounds(std::span<const DraftRound> rounds) {
  std::vector<CalibrationSample> samples;
  for (size_t r = 0; r < rounds.size(); ++r) {
    check_round(rounds[r], r);
    for (size_t k = 0; k < rounds[r].confidences.size(); ++k) {
      samples.push_back({.position = static_cast<int>(k),
                         .confidence = rounds[r].confidences[k],
                         .accepted = static_cast<int>(k) < rounds[r].accepted});
    }
  }
  return samples;
}

ThresholdFit fit_thresholds(std::span<const CalibrationSample> samples,
                            const ThresholdFitOptions& options) {
  if (options.block_size < 1)
    fail("fit_thresholds: block_size {} must be >= 1", options.block_size);
  if (!(options.target > 0.0 && options.target <= 1.0)) {
    fail("fit_thresholds: target {} must be in (0, 1]", options.target);
  }
  if (options.min_samples < 0) {
    fail("fit_thresholds: min_samples {} must be >= 0", options.min_samples);
  }
  const int gamma = options.block_size;
  // (confidence, accepted) per position, after the seed's filter.
  std::vector<std::vector<std::pair<double, bool>>> by_pos(gamma);
  ThresholdFit fit{.thresholds = std::vector<double>(gamma, 0.0), .target = options.target};
  for (const CalibrationSample& s : samples) {
    if (!std::isfinite(s.confidence) || s.position < 0 || s.position >= gamma) continue;
    by_pos[s.position].emplace_back(s.confidence, s.accepted);
    ++fit.samples;
  }
  for (int k = 1; k < gamma; ++k) {
    auto& obs = by_pos[k];
    const int64_t n = static_cast<int64_t>(obs.size());
    if (n < options.min_samples) continue;  // too little evidence: never prune
    // Ascending confidence; the order among equal confidences does not matter
    // because only counts at or above each distinct value are used.
    std::sort(obs.begin(), obs.end(),
              [](const auto& a, const auto& b) { return a.first < b.first; });
    int64_t accepted_at_or_above = 0;
    for (const auto& o : obs) accepted_at_or_above += o.second ? 1 : 0;
    double threshold = 1.0;  // nothing qualifies: prune unconditionally
    for (int64_t i = 0; i < n;) {
      const double tau = obs[i].first;
      const int64_t count_at_or_above = n - i;
      const double precision = static_cast<double>(accepted_at_or_above + 1) /
                               static_cast<double>(count_at_or_above + 2);
      if (precision >= options.target) {
        threshold = tau;
        break;
      }
      for (; i < n && obs[i].first == tau; ++i) accepted_at_or_above -= obs[i].second ? 1 : 0;
    }
    fit.thresholds[k] = threshold;
  }
  return fit;
}

std::vector<ReliabilityBin> reliability_bins(std::span<const double> predicted,
                                             std::span<const uint8_t> observed, int bins) {
  if (bins < 1) fail("reliability_bins: bins {} must be >= 1", bins);
  if (predicted.size() != observed.size()) {
    fail("reliability_bins: {} predictions but {} outcomes", predicted.size(), observed.size());
  }
  std::vector<ReliabilityBin> out(bins);
  std::vector<double> sum_pred(bins, 0.0);
  std::vector<int64_t> sum_obs(bins, 0);
  for (int b = 0; b < bins; ++b) {
    out[b].lo = static_cast<double>(b) / bins;
    out[b].hi = static_cast<double>(b + 1) / bins;
  }
  for (size_t i = 0; i < predicted.size(); ++i) {
    if (!std::isfinite(predicted[i])) {
      fail("reliability_bins: prediction {} is {} (must be finite)", i, predicted[i]);
    }
    const int b = bin_of(predicted[i], bins);
    sum_pred[b] += predicted[i];
    sum_obs[b] += observed[i] ? 1 : 0;
    ++out[b].count;
  }
  for (int b = 0; b < bins; ++b) {
    if (out[b].count == 0) continue;
    out[b].mean_predicted = sum_pred[b] / static_cast<double>(out[b].count);
    out[b].observed_rate = static_cast<double>(sum_obs[b]) / static_cast<double>(out[b].count);
  }
  return out;
}

double ece(std::span<const ReliabilityBin> bins) {
  int64_t total = 0;
  for (const ReliabilityBin& b : bins) total += b.count;
  if (total == 0) return 0.0;
  double sum = 0.0;
  for (const ReliabilityBin& b : bins) {
    sum += static_cast<double>(b.count) * std::abs(b.mean_predicted - b.observed_rate);
  }
  return sum / static_cast<double>(total);
}

double ece(std::span<const double> predicted, std::span<const uint8_t> observed, int bins) {
  const std::vector<ReliabilityBin> binned = reliability_bins(predicted, observed, bins);
  return ece(binned);
}

double temperature_scale(double confidence, double temperature) {
  SPECULA_CHECK(temperature > 0.0, "temperature {} must be > 0", temperature);
  return sigmoid(logit(confidence) / temperature);
}

void apply_temperatures(std::span<const double> confidences, std::span<const double> temperatures,
                        std::span<double> out) {
  SPECULA_CHECK(out.size() >= confidences.size(), "apply_temperatures: out holds {} of {}",
                out.size(), confidences.size());
  for (size_t k = 0; k < confidences.size(); ++k) {
    const double t = k < temperatures.size() ? temperatures[k] : 1.0;
    out[k] = t == 1.0 ? confidences[k] : temperature_scale(confidences[k], t);
  }
}

void survival_products(std::span<const double> confidences, std::span<const double> temperatures,
                       std::span<double> out) {
  apply_temperatures(confidences, temperatures, out);
  double product = 1.0;
  for (size_t k = 0; k < confidences.size(); ++k) {
    product *= out[k];
    out[k] = product;
  }
}

StsFit fit_sts(std::span<const DraftRound> rounds, const StsOptions& options) {
  if (options.block_size < 1) fail("fit_sts: block_size {} must be >= 1", options.block_size);
  if (!(options.t_min > 0.0) || !(options.t_step > 0.0) || !(options.t_max >= options.t_min)) {
    fail(
        "fit_sts: bad temperature grid t_min {} t_max {} t_step {} (need 0 < t_min <= t_max, "
        "t_step > 0)",
        options.t_min, options.t_max, options.t_step);
  }
  if (options.bins < 1) fail("fit_sts: bins {} must be >= 1", options.bins);
  const int gamma = options.block_size;
  // Grid points by index, not by repeated addition, so the grid is exact to
  // one rounding and the same on every machine.
  const int64_t grid_size =
      static_cast<int64_t>(std::floor((options.t_max - options.t_min) / options.t_step + 1e-9)) + 1;

  // The usable rounds, each with its running product of the positions fitted so far.
  std::vector<const DraftRound*> kept;
  for (size_t r = 0; r < rounds.size(); ++r) {
    check_round(rounds[r], r);
    if (usable_round(rounds[r])) kept.push_back(&rounds[r]);
  }
  StsFit fit{.temperatures = std::vector<double>(gamma, 1.0),
             .ece_before = std::vector<double>(gamma, 0.0),
             .ece_after = std::vector<double>(gamma, 0.0),
             .counts = std::vector<int64_t>(gamma, 0),
             .rounds = static_cast<int64_t>(kept.size())};
  std::vector<double> prefix_raw(kept.size(), 1.0);  // Π raw c_i, i < k
  std::vector<double> prefix_cal(kept.size(), 1.0);  // Π calibrated c'_i, i < k
  std::vector<size_t> at_k;                          // indices into kept drafting position k
  std::vector<double> logits, prev, predicted;
  std::vector<uint8_t> observed;
  for (int k = 0; k < gamma; ++k) {
    at_k.clear();
    logits.clear();
    prev.clear();
    observed.clear();
    predicted.clear();
    for (size_t i = 0; i < kept.size(); ++i) {
      if (static_cast<size_t>(k) >= kept[i]->confidences.size()) continue;
      at_k.push_back(i);
      logits.push_back(logit(kept[i]->confidences[k]));
      prev.push_back(prefix_cal[i]);
      observed.push_back(k < kept[i]->accepted ? 1 : 0);
      predicted.push_back(prefix_raw[i] * kept[i]->confidences[k]);
    }
    fit.counts[k] = static_cast<int64_t>(at_k.size());
    fit.ece_before[k] = ece(predicted, observed, options.bins);
    double best_t = 1.0;
    double best_ece = 0.0;
    bool have_best = false;
    if (!at_k.empty()) {
      for (int64_t g = 0; g < grid_size; ++g) {
        const double t = options.t_min + static_cast<double>(g) * options.t_step;
        for (size_t j = 0; j < at_k.size(); ++j) predicted[j] = prev[j] * sigmoid(logits[j] / t);
        const double e = ece(predicted, observed, options.bins);
        const bool better = !have_best || e < best_ece ||
                            (e == best_ece && std::abs(t - 1.0) < std::abs(best_t - 1.0));
        if (better) {
          best_t = t;
          best_ece = e;
          have_best = true;
        }
      }
    }
    fit.temperatures[k] = best_t;
    fit.ece_after[k] = have_best ? best_ece : 0.0;
    for (size_t j = 0; j < at_k.size(); ++j) {
      const size_t i = at_k[j];
      prefix_raw[i] *= kept[i]->confidences[k];
      prefix_cal[i] = prev[j] * sigmoid(logits[j] / best_t);
    }
  }
  return fit;
}

std::vector<double> survival_ece(std::span<const DraftRound> rounds,
                                 std::span<const double> temperatures, int block_size, int bins) {
  if (block_size < 1) fail("survival_ece: block_size {} must be >= 1", block_size);
  std::vector<double> out(block_size, 0.0);
  std::vector<double> predicted;
  std::vector<uint8_t> observed;
  for (int k = 0; k < block_size; ++k) {
    survival_at(rounds, temperatures, k, predicted, observed);
    out[k] = ece(predicted, observed, bins);
  }
  return out;
}

std::vector<ReliabilityBin> survival_reliability(std::span<const DraftRound> rounds,
                                                 std::span<const double> temperatures, int position,
                                                 int bins) {
  if (position < 0) fail("survival_reliability: position {} must be >= 0", position);
  std::vector<double> predicted;
  std::vector<uint8_t> observed;
  survival_at(rounds, temperatures, position, predicted, observed);
  return reliability_bins(predicted, observed, bins);
}

std::string with_calibration(const std::string& dspark_json, const std::string& origin,
                             const ThresholdFit& thresholds, const StsFit& sts) {
  // The unordered parse checks nesting depth and reports errors the way every
  // other JSON file is reported; the ordered one keeps the file's key order.
  const nlohmann::json checked = io::parse_json_text(dspark_json, origin);
  if (!checked.is_object()) {
    fail("{}: the top level is {} (a dspark.json is an object)", origin,
         io::json_type_name(checked));
  }
  nlohmann::ordered_json doc = nlohmann::ordered_json::parse(dspark_json);
  if (thresholds.thresholds.size() != sts.temperatures.size()) {
    fail("{}: the threshold fit has {} positions but the STS fit has {}", origin,
         thresholds.thresholds.size(), sts.temperatures.size());
  }
  if (doc.contains("config") && doc["config"].is_object() && doc["config"].contains("block_size")) {
    const auto& gamma = doc["config"]["block_size"];
    if (!gamma.is_number_integer() ||
        gamma.get<int64_t>() != static_cast<int64_t>(thresholds.thresholds.size())) {
      fail("{}: config.block_size is {} but the calibration fits have {} positions", origin,
           gamma.dump(), thresholds.thresholds.size());
    }
  }
  if (doc.contains("calibration") && !doc["calibration"].is_object()) {
    fail("{}: calibration is {} (expected an object)", origin,
         io::json_type_name(checked["calibration"]));
  }
  nlohmann::ordered_json& cal = doc["calibration"];
  if (cal.is_null()) cal = nlohmann::ordered_json::object();
  cal["thresholds"] = thresholds.thresholds;
  cal["target"] = thresholds.target;
  cal["samples"] = thresholds.samples;
  cal["sts_temperatures"] = sts.temperatures;
  return doc.dump(1) + "\n";
}

void write_calibration_file(const std::string& path, const ThresholdFit& thresholds,
                            const StsFit& sts) {
  std::ifstream in(path, std::ios::binary);
  if (!in) fail("{}: cannot open the drafter's dspark.json for reading", path);
  std::stringstream text;
  text << in.rdbuf();
  if (in.bad()) fail("{}: read error", path);
  const std::string updated = with_calibration(text.str(), path, thresholds, sts);
  const std::string tmp = path + ".tmp";
  {
    std::ofstream out(tmp, std::ios::binary | std::ios::trunc);
    if (!out) fail("{}: cannot open for writing (next to {})", tmp, path);
    out << updated;
    out.flush();
    if (!out) fail("{}: write error", tmp);
  }
  std::error_code ec;
  std::filesystem::rename(tmp, path, ec);
  if (ec) {
    std::filesystem::remove(tmp);
    fail("{}: cannot replace it with {}: {}", path, tmp, ec.message());
  }
}

}  // namespace specula::lab
