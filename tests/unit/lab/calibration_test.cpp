// SPDX-License-Identifier: Apache-2.0
// Calibration fits (engine/lab/calibration.h): the seed's threshold rule on
// its own synthetic case, ECE and reliability bins, STS recovering known
// temperatures, and the dspark.json round trip.
#include "engine/lab/calibration.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <fstream>
#include <nlohmann/json.hpp>

#include "engine/core/error.h"
#include "tests/unit/lab/lab_test_util.h"

namespace specula::lab {
namespace {

using ::testing::HasSubstr;
using testing::Rng;

// The seed's step-at-0.6 case (seed-system.md §4.8): at positions 1 and 2,
// 400 confidences evenly spread over (0, 1), accepted exactly when >= 0.6;
// position 3 under-sampled (10 samples); position 4 always rejected.
std::vector<CalibrationSample> step_at_06_samples() {
  std::vector<CalibrationSample> s;
  for (int pos : {1, 2}) {
    for (int i = 0; i < 400; ++i) {
      const double c = (i + 0.5) / 400.0;
      s.push_back({.position = pos, .confidence = c, .accepted = c >= 0.6});
    }
  }
  for (int i = 0; i < 10; ++i) s.push_back({.position = 3, .confidence = 0.9, .accepted = false});
  Rng rng(7);
  for (int i = 0; i < 100; ++i) {
    s.push_back({.position = 4, .confidence = rng.uniform(), .accepted = false});
  }
  // Position 0 is never pruned, whatever its samples say.
  for (int i = 0; i < 100; ++i) s.push_back({.position = 0, .confidence = 0.1, .accepted = false});
  return s;
}

TEST(LabThresholds, SeedStepAt06Case) {
  const std::vector<CalibrationSample> samples = step_at_06_samples();
  const ThresholdFit fit =
      fit_thresholds(samples, {.block_size = 5, .target = 0.9, .min_samples = 50});
  ASSERT_EQ(fit.thresholds.size(), 5u);
  EXPECT_EQ(fit.thresholds[0], 0.0);
  for (int k : {1, 2}) {
    EXPECT_GT(fit.thresholds[k], 0.5) << "position " << k;
    EXPECT_LT(fit.thresholds[k], 0.65) << "position " << k;
    // By hand: 160 accepted at or above every τ <= 0.6; (161) / (402 − i) >= 0.9
    // first holds at i = 224, τ = 224.5 / 400.
    EXPECT_DOUBLE_EQ(fit.thresholds[k], 224.5 / 400.0) << "position " << k;
  }
  EXPECT_EQ(fit.thresholds[3], 0.0);  // 10 < 50 samples: don't prune
  EXPECT_EQ(fit.thresholds[4], 1.0);  // never accepted: prune always
  EXPECT_EQ(fit.target, 0.9);
  EXPECT_EQ(fit.samples, static_cast<int64_t>(samples.size()));
}

TEST(LabThresholds, DropsBadSamplesAndIsOrderIndependent) {
  std::vector<CalibrationSample> samples = step_at_06_samples();
  const ThresholdFit clean =
      fit_thresholds(samples, {.block_size = 5, .target = 0.9, .min_samples = 50});
  const size_t kept = samples.size();
  samples.push_back({.position = 1, .confidence = std::nan(""), .accepted = true});
  samples.push_back({.position = 2, .confidence = INFINITY, .accepted = true});
  samples.push_back({.position = -1, .confidence = 0.2, .accepted = true});
  samples.push_back({.position = 5, .confidence = 0.2, .accepted = true});
  std::reverse(samples.begin(), samples.end());
  Rng rng(3);
  for (size_t i = samples.size() - 1; i > 0; --i) {
    std::swap(samples[i], samples[rng.next() % (i + 1)]);
  }
  const ThresholdFit fit =
      fit_thresholds(samples, {.block_size = 5, .target = 0.9, .min_samples = 50});
  EXPECT_EQ(fit.thresholds, clean.thresholds);
  EXPECT_EQ(fit.samples, static_cast<int64_t>(kept));
}

TEST(LabThresholds, LaplacePrecisionWithTiedConfidences) {
  // τ = 0.2: (2 + 1) / (4 + 2) = 0.5; τ = 0.5 (two samples tie): (2 + 1) / (3 + 2) = 0.6.
  const std::vector<CalibrationSample> s = {
      {1, 0.2, false}, {1, 0.5, true}, {1, 0.5, false}, {1, 0.8, true}};
  EXPECT_EQ(fit_thresholds(s, {.block_size = 2, .target = 0.6, .min_samples = 1}).thresholds[1],
            0.5);
  EXPECT_EQ(fit_thresholds(s, {.block_size = 2, .target = 0.5, .min_samples = 1}).thresholds[1],
            0.2);
  // τ = 0.8: (1 + 1) / (1 + 2) = 0.667 is the best precision there is.
  EXPECT_EQ(fit_thresholds(s, {.block_size = 2, .target = 0.66, .min_samples = 1}).thresholds[1],
            0.8);
  EXPECT_EQ(fit_thresholds(s, {.block_size = 2, .target = 0.7, .min_samples = 1}).thresholds[1],
            1.0);
  EXPECT_EQ(fit_thresholds(s, {.block_size = 2, .target = 0.6, .min_samples = 5}).thresholds[1],
            0.0);
}

TEST(LabThresholds, RejectsBadOptions) {
  const std::vector<CalibrationSample> s;
  EXPECT_THROW(fit_thresholds(s, {.block_size = 0}), Error);
  EXPECT_THROW(fit_thresholds(s, {.block_size = 2, .target = 0.0}), Error);
  EXPECT_THROW(fit_thresholds(s, {.block_size = 2, .target = 1.5}), Error);
  EXPECT_THROW(fit_thresholds(s, {.block_size = 2, .target = std::nan("")}), Error);
  EXPECT_THROW(fit_thresholds(s, {.block_size = 2, .min_samples = -1}), Error);
}

TEST(LabCalibration, SamplesFromRoundsUseThePrefixLabel) {
  const std::vector<DraftRound> rounds = {{{0.9, 0.8, 0.7}, 2}, {{0.5}, 0}};
  const std::vector<CalibrationSample> s = samples_from_rounds(rounds);
  ASSERT_EQ(s.size(), 4u);
  EXPECT_TRUE(s[0].accepted);
  EXPECT_TRUE(s[1].accepted);
  EXPECT_FALSE(s[2].accepted);
  EXPECT_EQ(s[2].position, 2);
  EXPECT_EQ(s[2].confidence, 0.7);
  EXPECT_FALSE(s[3].accepted);
  const std::vector<DraftRound> bad = {{{0.9}, 2}};
  try {
    samples_from_rounds(bad);
    FAIL() << "expected an Error";
  } catch (const Error& e) {
    EXPECT_THAT(e.what(), HasSubstr("round 0"));
    EXPECT_THAT(e.what(), HasSubstr("accepted = 2"));
  }
}

TEST(LabCalibration, EceAndReliabilityBins) {
  // 10 predictions of 0.3 (3 hits) and 10 of 0.95 (9 hits): calibrated within 0.05.
  std::vector<double> pred;
  std::vector<uint8_t> obs;
  for (int i = 0; i < 10; ++i) {
    pred.push_back(0.3);
    obs.push_back(i < 3);
    pred.push_back(0.95);
    obs.push_back(i < 9);
  }
  const std::vector<ReliabilityBin> bins = reliability_bins(pred, obs, 10);
  ASSERT_EQ(bins.size(), 10u);
  EXPECT_EQ(bins[3].count, 10);
  EXPECT_DOUBLE_EQ(bins[3].mean_predicted, 0.3);
  EXPECT_DOUBLE_EQ(bins[3].observed_rate, 0.3);
  EXPECT_EQ(bins[9].count, 10);
  EXPECT_DOUBLE_EQ(bins[9].observed_rate, 0.9);
  EXPECT_EQ(bins[0].count, 0);
  EXPECT_EQ(bins[0].mean_predicted, 0.0);
  EXPECT_DOUBLE_EQ(bins[9].lo, 0.9);
  EXPECT_DOUBLE_EQ(bins[9].hi, 1.0);
  EXPECT_NEAR(ece(pred, obs, 10), 0.5 * 0.05, 1e-12);
  EXPECT_NEAR(ece(bins), 0.5 * 0.05, 1e-12);
  // 1.0 falls in the last bin; all wrong is ECE 1.
  const std::vector<double> ones(4, 1.0);
  const std::vector<uint8_t> zeros(4, 0);
  EXPECT_EQ(reliability_bins(ones, zeros).back().count, 4);
  EXPECT_DOUBLE_EQ(ece(ones, zeros), 1.0);
  EXPECT_EQ(ece(std::span<const double>{}, std::span<const uint8_t>{}), 0.0);
  EXPECT_THROW(reliability_bins(ones, std::vector<uint8_t>(3, 0)), Error);
  EXPECT_THROW(reliability_bins(std::vector<double>{std::nan("")}, std::vector<uint8_t>{1}), Error);
  EXPECT_THROW(reliability_bins(ones, zeros, 0), Error);
}

TEST(LabCalibration, TemperatureScalingAndSurvival) {
  EXPECT_DOUBLE_EQ(temperature_scale(0.5, 3.0), 0.5);
  EXPECT_NEAR(temperature_scale(1.0 / (1.0 + std::exp(-4.0)), 2.0), 1.0 / (1.0 + std::exp(-2.0)),
              1e-12);
  EXPECT_TRUE(std::isfinite(temperature_scale(1.0, 2.0)));
  EXPECT_TRUE(std::isfinite(temperature_scale(0.0, 0.5)));
  const std::vector<double> c = {0.9, 0.5, 0.8};
  std::vector<double> a(3);
  survival_products(c, std::vector<double>{}, a);
  EXPECT_DOUBLE_EQ(a[0], 0.9);
  EXPECT_DOUBLE_EQ(a[1], 0.45);
  EXPECT_DOUBLE_EQ(a[2], 0.36);
}

TEST(LabSts, RecoversKnownTemperaturesAndLowersEce) {
  // T > 1: the head is overconfident (the paper's case), T < 1 underconfident.
  const std::vector<double> truth = {1.0, 1.8, 0.7, 2.5};
  const std::vector<DraftRound> fit_set = testing::miscalibrated_rounds(200000, truth, 11);
  const StsOptions options{.block_size = 4, .t_min = 0.1, .t_max = 4.0, .t_step = 0.1};
  const StsFit fit = fit_sts(fit_set, options);
  ASSERT_EQ(fit.temperatures.size(), 4u);
  EXPECT_EQ(fit.rounds, 200000);
  for (int k = 0; k < 4; ++k) {
    EXPECT_NEAR(fit.temperatures[k], truth[k], options.t_step + 1e-9) << "position " << k;
    EXPECT_EQ(fit.counts[k], 200000);
    EXPECT_LE(fit.ece_after[k], fit.ece_before[k]) << "position " << k;
  }
  for (int k = 1; k < 4; ++k) {
    EXPECT_LT(fit.ece_after[k], 0.5 * fit.ece_before[k]) << "position " << k;
    EXPECT_LT(fit.ece_after[k], 0.01) << "position " << k;
  }
  // Held out: the fitted temperatures calibrate fresh rounds too.
  const std::vector<DraftRound> held_out = testing::miscalibrated_rounds(20000, truth, 12);
  const std::vector<double> raw = survival_ece(held_out, std::vector<double>(4, 1.0), 4);
  const std::vector<double> cal = survival_ece(held_out, fit.temperatures, 4);
  for (int k = 1; k < 4; ++k) {
    EXPECT_LT(cal[k], raw[k]) << "position " << k;
    EXPECT_LT(cal[k], 0.015) << "position " << k;
  }
  // Deterministic.
  const StsFit again = fit_sts(fit_set, options);
  EXPECT_EQ(again.temperatures, fit.temperatures);
  EXPECT_EQ(again.ece_after, fit.ece_after);
}

TEST(LabSts, FineGridRecoversWithinItsStep) {
  const std::vector<double> truth = {1.5, 2.0};
  const std::vector<DraftRound> rounds = testing::miscalibrated_rounds(200000, truth, 21);
  const StsFit fit = fit_sts(rounds, {.block_size = 2, .t_step = 0.05});
  for (int k = 0; k < 2; ++k) {
    EXPECT_NEAR(fit.temperatures[k], truth[k], 0.05 + 1e-9) << "position " << k;
  }
}

TEST(LabSts, DropsBadRoundsAndHandlesUnreachedPositions) {
  std::vector<DraftRound> rounds = testing::miscalibrated_rounds(2000, {1.0, 1.0}, 5);
  rounds.push_back({{std::nan(""), 0.5}, 0});
  rounds.push_back({{1.5, 0.5}, 1});
  const StsFit fit = fit_sts(rounds, {.block_size = 3});
  EXPECT_EQ(fit.rounds, 2000);
  EXPECT_EQ(fit.counts[2], 0);
  EXPECT_EQ(fit.temperatures[2], 1.0);  // no round drafted it: left alone
  EXPECT_EQ(fit.ece_after[2], 0.0);
  rounds.push_back({{0.5}, 3});
  EXPECT_THROW(fit_sts(rounds, {.block_size = 3}), Error);
  EXPECT_THROW(fit_sts({}, {.block_size = 0}), Error);
  EXPECT_THROW(fit_sts({}, {.block_size = 2, .t_min = 0.0}), Error);
  EXPECT_THROW(fit_sts({}, {.block_size = 2, .t_min = 2.0, .t_max = 1.0}), Error);
  EXPECT_THROW(fit_sts({}, {.block_size = 2, .t_step = 0.0}), Error);
}

TEST(LabSts, SurvivalReliabilityMatchesSurvivalEce) {
  const std::vector<DraftRound> rounds = testing::miscalibrated_rounds(3000, {2.0, 2.0}, 9);
  const std::vector<double> temps = {1.0, 1.0};
  const std::vector<double> e = survival_ece(rounds, temps, 2);
  for (int k = 0; k < 2; ++k) {
    const std::vector<ReliabilityBin> bins = survival_reliability(rounds, temps, k);
    ASSERT_EQ(bins.size(), static_cast<size_t>(kDefaultEceBins));
    int64_t total = 0;
    for (const ReliabilityBin& b : bins) total += b.count;
    EXPECT_EQ(total, 3000);
    EXPECT_DOUBLE_EQ(ece(bins), e[k]);
  }
}

constexpr const char* kDsparkJson = R"({
 "kind": "dspark-drafter",
 "variant": "dspark",
 "version": 1,
 "target": {"hidden_size": 64, "vocab_size": 512, "num_hidden_layers": 4, "config_hash": "abc"},
 "config": {"block_size": 3, "hidden_size": 32, "tap_layers": [1, 2, 4], "rms_norm_eps": 1e-06},
 "calibration": {"thresholds": [0.0, 0.5, 0.5], "target": 0.5, "samples": 0, "note": "kept"},
 "extra": {"nested": [1, {"a": null}]}
})";

TEST(LabCalibrationJson, RoundTripKeepsEveryOtherField) {
  const ThresholdFit thr{.thresholds = {0.0, 0.56125, 1.0}, .target = 0.9, .samples = 910};
  StsFit sts;
  sts.temperatures = {1.0, 1.8, 2.5};
  const std::string out = with_calibration(kDsparkJson, "dspark.json", thr, sts);
  const nlohmann::json before = nlohmann::json::parse(kDsparkJson);
  const nlohmann::json after = nlohmann::json::parse(out);
  for (const auto& [key, value] : before.items()) {
    if (key != "calibration") {
      EXPECT_EQ(after[key], value) << key;
    }
  }
  EXPECT_EQ(after.size(), before.size());
  const nlohmann::json& cal = after["calibration"];
  EXPECT_EQ(cal["thresholds"].get<std::vector<double>>(), thr.thresholds);
  EXPECT_EQ(cal["target"].get<double>(), 0.9);
  EXPECT_EQ(cal["samples"].get<int64_t>(), 910);
  EXPECT_EQ(cal["sts_temperatures"].get<std::vector<double>>(), sts.temperatures);
  EXPECT_EQ(cal["note"], "kept");
  // The file's key order is kept.
  const nlohmann::ordered_json ordered = nlohmann::ordered_json::parse(out);
  std::vector<std::string> keys;
  for (const auto& [key, value] : ordered.items()) keys.push_back(key);
  EXPECT_EQ(keys, (std::vector<std::string>{"kind", "variant", "version", "target", "config",
                                            "calibration", "extra"}));
  // Applying it again changes nothing.
  EXPECT_EQ(with_calibration(out, "dspark.json", thr, sts), out);
}

TEST(LabCalibrationJson, Errors) {
  const ThresholdFit thr{.thresholds = {0.0, 0.5}, .target = 0.5, .samples = 1};
  StsFit sts;
  sts.temperatures = {1.0, 1.0};
  try {
    with_calibration(kDsparkJson, "d/dspark.json", thr, sts);
    FAIL() << "expected an Error";
  } catch (const Error& e) {
    EXPECT_THAT(e.what(), HasSubstr("d/dspark.json"));
    EXPECT_THAT(e.what(), HasSubstr("block_size is 3"));
    EXPECT_THAT(e.what(), HasSubstr("2 positions"));
  }
  EXPECT_THROW(with_calibration("[1, 2]", "x.json", thr, sts), Error);
  EXPECT_THROW(with_calibration("{\"calibration\": 3}", "x.json", thr, sts), Error);
  EXPECT_THROW(with_calibration("{not json", "x.json", thr, sts), Error);
  StsFit short_sts;
  short_sts.temperatures = {1.0};
  EXPECT_THROW(with_calibration("{}", "x.json", thr, short_sts), Error);
  // No calibration yet: one is added.
  const nlohmann::json added = nlohmann::json::parse(with_calibration("{}", "x.json", thr, sts));
  EXPECT_EQ(added["calibration"]["samples"], 1);
}

TEST(LabCalibrationJson, WritesTheFileInPlace) {
  testing::ScratchDir dir("calib");
  const std::string path = dir.file("dspark.json");
  {
    std::ofstream f(path);
    f << kDsparkJson;
  }
  const ThresholdFit thr{.thresholds = {0.0, 0.25, 0.75}, .target = 0.5, .samples = 7};
  StsFit sts;
  sts.temperatures = {1.1, 1.2, 1.3};
  write_calibration_file(path, thr, sts);
  std::ifstream in(path);
  const nlohmann::json doc = nlohmann::json::parse(in);
  EXPECT_EQ(doc["calibration"]["thresholds"].get<std::vector<double>>(), thr.thresholds);
  EXPECT_EQ(doc["target"]["config_hash"], "abc");
  EXPECT_FALSE(std::filesystem::exists(path + ".tmp"));
  try {
    write_calibration_file(dir.file("missing/dspark.json"), thr, sts);
    FAIL() << "expected an Error";
  } catch (const Error& e) {
    EXPECT_THAT(e.what(), HasSubstr("missing/dspark.json"));
  }
}

}  // namespace
}  // namespace specula::lab
