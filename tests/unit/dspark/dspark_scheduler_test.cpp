// SPDX-License-Identifier: Apache-2.0
// The verify scheduler (DSpark Alg. 1) inside the engine, on the CPU with
// random DSpark drafters over the dense_kev target: with an SPS table that
// makes large verify forwards slow, it really cuts drafts, and greedy output
// stays that of plain decoding (device and host rounds, batch 1, 3 and 8,
// with and without confidence pruning); a flat table never cuts; auto mode
// schedules only rounds of enough rows; sampled rows run and a seeded batch
// repeats itself; drafters without confidences are not scheduled; bad
// options are Errors; STS temperatures scale the confidences; SPS(B)
// profiles on the device. (That scheduled sampled
// rows follow the target's distribution: chain_sampling_test.cpp.)
#include <gtest/gtest.h>

#include <cmath>
#include <filesystem>
#include <fstream>
#include <functional>
#include <nlohmann/json.hpp>
#include <random>

#include "engine/draft/dspark/dspark_drafter.h"
#include "engine/speculative/decoder.h"
#include "engine/speculative/engine.h"
#include "engine/speculative/sps_profile.h"
#include "tests/unit/dspark/dspark_test_util.h"
#include "tests/unit/model/golden_util.h"

namespace specula {
namespace {

using dspark::DSparkDrafter;
using dspark::DSparkLayout;
using dspark::DSparkModel;
using speculative::DecodeRequest;
using speculative::DecodeResult;
using speculative::Engine;
using speculative::EngineOptions;
using speculative::SchedulerMode;

std::string error_of(const std::function<void()>& f) {
  try {
    f();
  } catch (const Error& e) {
    return e.what();
  }
  return "(no error)";
}

// Steps per second falling steeply past a few tokens: the scheduler must
// cut (at B = 8 a token more costs more than any draft can bring).
std::shared_ptr<const speculative::SpsTable> slow_large_b() {
  return std::make_shared<const speculative::SpsTable>(
      std::vector<speculative::SpsPoint>{{1, 1000.0}, {4, 800.0}, {8, 300.0}, {64, 20.0}}, "test",
      "test");
}
// The same cost at every B: every draft with a survival above 0 pays.
std::shared_ptr<const speculative::SpsTable> flat() {
  return std::make_shared<const speculative::SpsTable>(
      std::vector<speculative::SpsPoint>{{1, 500.0}, {4096, 500.0}}, "test", "test");
}

std::vector<DecodeRequest> requests(int n, uint32_t seed, int max_tokens, float temperature = 0) {
  std::mt19937 rng(seed);
  std::vector<DecodeRequest> reqs;
  for (int i = 0; i < n; ++i) {
    DecodeRequest r;
    const int len = std::uniform_int_distribution<int>(6, 20)(rng);
    for (int j = 0; j < len; ++j)
      r.prompt.push_back(std::uniform_int_distribution<int>(3, 127)(rng));
    r.params.temperature = temperature;
    r.params.max_tokens = max_tokens;
    r.params.stop_token_ids.clear();
    r.params.seed = 70 + static_cast<uint64_t>(i);
    reqs.push_back(std::move(r));
  }
  return reqs;
}

class DSparkSchedulerTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    target_ = gemma4::Gemma4Model::load(testing::golden_dir("dense_kev")).release();
  }
  static void TearDownTestSuite() {
    delete target_;
    target_ = nullptr;
  }
  static std::unique_ptr<DSparkModel> random_model(DSparkLayout layout, int gamma, uint64_t seed) {
    return DSparkModel::random(testing::small_dspark(layout, target_->config(), gamma), *target_,
                               target_->backend(), seed, DType::kF32);
  }
  // decode() on an engine of one row per request with the scheduler options.
  static std::vector<DecodeResult> run(Drafter* drafter, const std::vector<DecodeRequest>& reqs,
                                       int k, bool host, speculative::VerifySchedulerOptions s) {
    Engine engine(*target_, drafter,
                  {.schedule = {.draft_tokens = k},
                   .max_rows = static_cast<int>(reqs.size()),
                   .modes = {.host_rounds = host},
                   .scheduler = std::move(s)});
    return speculative::decode(engine, reqs);
  }
  static inline gemma4::Gemma4Model* target_ = nullptr;
};

TEST_F(DSparkSchedulerTest, GreedyOutputIsUnchangedAndDraftsAreCut) {
  for (DSparkLayout layout : {DSparkLayout::kSpecula, DSparkLayout::kDeepSpec}) {
    const int gamma = layout == DSparkLayout::kSpecula ? 6 : 4;
    auto model = random_model(layout, gamma, 11);
    DSparkDrafter drafter(*target_, *model);
    ASSERT_TRUE(drafter.has_confidences());
    for (bool prune : {false, true}) {
      drafter.set_thresholds(prune ? std::vector<float>(static_cast<size_t>(gamma), 0.4f)
                                   : std::vector<float>());
      int64_t cut = 0, drafted = 0;
      for (int batch : {1, 3, 8}) {
        const auto reqs = requests(batch, 500 + static_cast<uint32_t>(batch), 14);
        const auto plain = speculative::decode(*target_, nullptr, reqs, {.draft_tokens = 1});
        for (bool host : {false, true}) {
          const auto got =
              run(&drafter, reqs, gamma, host, {.mode = SchedulerMode::kOn, .sps = slow_large_b()});
          for (size_t i = 0; i < reqs.size(); ++i) {
            EXPECT_EQ(got[i].tokens, plain[i].tokens)
                << testing::layout_name(layout) << " batch " << batch << " request " << i
                << (host ? " host" : "") << (prune ? " pruned" : "");
            cut += got[i].stats.scheduled_cut;
            drafted += got[i].stats.drafted;
            EXPECT_LE(got[i].stats.scheduled_rounds, got[i].stats.rounds);
            EXPECT_EQ(got[i].stats.scheduled_cut > 0, got[i].stats.scheduled_rounds > 0);
          }
          EXPECT_EQ(drafter.live_sequences(), 0);
        }
      }
      EXPECT_GT(cut, 0) << testing::layout_name(layout) << ": the scheduler never cut a draft";
      EXPECT_GT(drafted, 0) << testing::layout_name(layout) << ": it cut every draft";
    }
  }
}

TEST_F(DSparkSchedulerTest, AFlatTableNeverCutsAndOffChangesNothing) {
  auto model = random_model(DSparkLayout::kSpecula, 5, 13);
  DSparkDrafter drafter(*target_, *model);
  const auto reqs = requests(8, 41, 12);
  const auto off = run(&drafter, reqs, 5, false, {});
  const auto on = run(&drafter, reqs, 5, false, {.mode = SchedulerMode::kOn, .sps = flat()});
  for (size_t i = 0; i < reqs.size(); ++i) {
    EXPECT_EQ(on[i].tokens, off[i].tokens) << i;
    EXPECT_EQ(on[i].stats.scheduled_cut, 0) << i;
    EXPECT_EQ(off[i].stats.scheduled_cut, 0) << i;
    // Nothing cut: the very same rounds.
    EXPECT_EQ(on[i].stats.round_drafted, off[i].stats.round_drafted) << i;
  }
}

TEST_F(DSparkSchedulerTest, AutoSchedulesOnlyRoundsOfEnoughRows) {
  auto model = random_model(DSparkLayout::kSpecula, 5, 11);
  DSparkDrafter drafter(*target_, *model);
  const speculative::VerifySchedulerOptions autos{
      .mode = SchedulerMode::kAuto, .sps = slow_large_b(), .auto_min_rows = 3};
  const auto one = run(&drafter, requests(1, 7, 12), 5, false, autos);
  EXPECT_EQ(one[0].stats.scheduled_cut, 0) << "one row is below auto_min_rows";
  const auto eight = run(&drafter, requests(8, 7, 12), 5, false, autos);
  int64_t cut = 0;
  for (const auto& r : eight) cut += r.stats.scheduled_cut;
  EXPECT_GT(cut, 0) << "eight rows are scheduled";
}

TEST_F(DSparkSchedulerTest, SampledRowsRunAndASeededBatchRepeatsItself) {
  auto model = random_model(DSparkLayout::kSpecula, 5, 3);
  DSparkDrafter drafter(*target_, *model);
  auto reqs = requests(6, 9, 16, 0.9f);
  for (bool host : {false, true}) {
    const speculative::VerifySchedulerOptions on{.mode = SchedulerMode::kOn, .sps = slow_large_b()};
    const auto a = run(&drafter, reqs, 5, host, on);
    const auto b = run(&drafter, reqs, 5, host, on);
    int64_t cut = 0;
    for (size_t i = 0; i < reqs.size(); ++i) {
      EXPECT_EQ(a[i].tokens.size(), 16u) << i;
      EXPECT_EQ(a[i].tokens, b[i].tokens) << i << (host ? " host" : "");
      for (int32_t t : a[i].tokens) EXPECT_TRUE(t >= 0 && t < 128) << t;
      cut += a[i].stats.scheduled_cut;
    }
    EXPECT_GT(cut, 0);
    EXPECT_EQ(drafter.live_sequences(), 0);
  }
}

TEST_F(DSparkSchedulerTest, DraftersWithoutConfidencesAreNotScheduledAndBadOptionsAreErrors) {
  auto model = random_model(DSparkLayout::kSpecula, 5, 11);
  DSparkDrafter drafter(*target_, *model);
  {
    Engine engine(*target_, &drafter,
                  {.schedule = {.draft_tokens = 4},
                   .scheduler = {.mode = SchedulerMode::kOn, .sps = flat()}});
    EXPECT_TRUE(engine.schedules());
  }
  {
    Engine engine(*target_, &drafter, {.schedule = {.draft_tokens = 4}});
    EXPECT_FALSE(engine.schedules()) << "off by default";
  }
  {
    // A DeepSpec-layout drafter without its confidence head.
    dspark::DSparkConfig c = testing::small_deepspec_dspark(target_->config(), 4);
    c.confidence_head = false;
    auto bare = DSparkModel::random(c, *target_, target_->backend(), 5, DType::kF32);
    DSparkDrafter no_conf(*target_, *bare);
    EXPECT_FALSE(no_conf.has_confidences());
    Engine engine(*target_, &no_conf,
                  {.schedule = {.draft_tokens = 4},
                   .scheduler = {.mode = SchedulerMode::kOn, .sps = slow_large_b()}});
    EXPECT_FALSE(engine.schedules());
    const auto reqs = requests(3, 5, 10);
    const auto plain = speculative::decode(*target_, nullptr, reqs, {.draft_tokens = 1});
    const auto got = speculative::decode(engine, reqs);
    for (size_t i = 0; i < reqs.size(); ++i) {
      EXPECT_EQ(got[i].tokens, plain[i].tokens);
      EXPECT_EQ(got[i].stats.scheduled_cut, 0);
    }
  }
  EXPECT_NE(error_of([&] {
              Engine e(
                  *target_, &drafter,
                  {.schedule = {.draft_tokens = 4}, .scheduler = {.mode = SchedulerMode::kOn}});
            }).find("no SPS table"),
            std::string::npos);
  EXPECT_NE(error_of([&] {
              Engine e(
                  *target_, &drafter,
                  {.schedule = {.draft_tokens = 4},
                   .scheduler = {.mode = SchedulerMode::kAuto, .sps = flat(), .auto_min_rows = 0}});
            }).find("auto_min_rows"),
            std::string::npos);
}

// The scheduler reads σ(c_k), scaled by the checkpoint's STS temperatures
// when the drafter has them: σ(logit(c_k) / T_k).
TEST_F(DSparkSchedulerTest, ConfidencesAreTemperatureScaledWithSts) {
  auto model = random_model(DSparkLayout::kSpecula, 4, 11);
  DSparkDrafter drafter(*target_, *model);
  const auto reqs = requests(3, 21, 8);
  run(&drafter, reqs, 4, false, {});  // leaves the last round's confidences
  const std::span<const int> seqs = drafter.round_sequences();
  ASSERT_FALSE(seqs.empty());
  std::vector<DraftRow> rows;
  for (int q : seqs) rows.push_back({.sequence = q});
  const std::vector<int> drafted(rows.size(), 1);
  const std::span<const float> raw_f = drafter.last_confidences();
  const std::vector<float> raw(raw_f.begin(), raw_f.end());
  std::vector<double> plain(rows.size() * 4), scaled(rows.size() * 4);
  drafter.draft_confidences(rows, drafted, 4, plain);
  drafter.set_sts_temperatures({0.5f, 2.0f, 1.0f, 3.0f});
  drafter.draft_confidences(rows, drafted, 4, scaled);
  for (size_t i = 0; i < rows.size(); ++i) {
    EXPECT_EQ(plain[i * 4], raw[i * 4]) << i;
    const double c = raw[i * 4];
    EXPECT_NEAR(scaled[i * 4], 1.0 / (1.0 + std::exp(-std::log(c / (1 - c)) / 0.5)), 1e-9) << i;
  }
  // dspark.json: calibration.sts_temperatures is read and checked.
  const std::string dir = std::string(SPECULA_BINARY_DIR) + "/dspark_test_tmp/sts_config";
  std::filesystem::remove_all(dir);
  std::filesystem::create_directories(dir);
  nlohmann::json j =
      nlohmann::json::parse(std::ifstream(testing::golden_dir("dspark") + "/dspark.json"));
  const int gamma = j["config"]["block_size"].get<int>();
  j["calibration"]["sts_temperatures"] = std::vector<double>(static_cast<size_t>(gamma), 1.5);
  std::ofstream(dir + "/dspark.json") << j.dump();
  EXPECT_EQ(dspark::load_dspark_config(dir).sts_temperatures,
            std::vector<float>(static_cast<size_t>(gamma), 1.5f));
  j["calibration"]["sts_temperatures"][1] = -2;
  std::ofstream(dir + "/dspark.json") << j.dump();
  const std::string bad = error_of([&] { dspark::load_dspark_config(dir); });
  EXPECT_NE(bad.find("sts_temperatures"), std::string::npos) << bad;
  EXPECT_NE(bad.find("dspark.json"), std::string::npos) << bad;

  EXPECT_NE(error_of([&] { drafter.set_sts_temperatures({1.0f}); }).find("block has 4"),
            std::string::npos);
  EXPECT_NE(error_of([&] {
              drafter.set_sts_temperatures({1.0f, 0.0f, 1.0f, 1.0f});
            }).find("position 1 is 0"),
            std::string::npos);
}

TEST_F(DSparkSchedulerTest, ProfilesSpsOnTheDeviceAndCachesIt) {
  const auto sizes = speculative::sps_sizes(12);
  EXPECT_EQ(sizes, (std::vector<int64_t>{1, 2, 4, 8, 12}));
  EXPECT_EQ(speculative::sps_sizes(1), (std::vector<int64_t>{1}));
  int lines = 0;
  const speculative::SpsTable t =
      speculative::profile_sps(*target_, {.sizes = sizes,
                                          .window = 5,
                                          .context = 16,
                                          .reps = 1,
                                          .progress = [&](const std::string&) { ++lines; },
                                          .device = "cpu-test",
                                          .model = "dense_kev"});
  EXPECT_EQ(lines, 5);
  ASSERT_EQ(t.points().size(), 5u);
  for (size_t i = 0; i < sizes.size(); ++i) {
    EXPECT_EQ(t.points()[i].tokens, sizes[i]);
    EXPECT_GT(t.points()[i].steps_per_sec, 0.0);
  }
  const std::string dir = std::string(SPECULA_BINARY_DIR) + "/dspark_test_tmp/sps";
  std::filesystem::remove_all(dir);
  std::filesystem::create_directories(dir);
  const std::string path = dir + "/sps.json";
  EXPECT_FALSE(speculative::load_sps_cache(path, "cpu-test", "dense_kev", 12)) << "no file yet";
  t.save(path);
  const auto back = speculative::load_sps_cache(path, "cpu-test", "dense_kev", 12);
  ASSERT_TRUE(back);
  EXPECT_EQ(back->points().size(), 5u);
  EXPECT_EQ(back->steps_per_sec(8), t.steps_per_sec(8));
  EXPECT_FALSE(speculative::load_sps_cache(path, "cpu-test", "dense_kev", 13))
      << "too short: profile";
  const std::string other_device =
      error_of([&] { speculative::load_sps_cache(path, "cuda", "dense_kev", 1); });
  EXPECT_NE(other_device.find(path), std::string::npos) << other_device;
  EXPECT_NE(other_device.find("cpu-test"), std::string::npos) << other_device;
  EXPECT_NE(other_device.find("\"cuda\""), std::string::npos) << other_device;
  const std::string other_model =
      error_of([&] { speculative::load_sps_cache(path, "cpu-test", "e2b", 1); });
  EXPECT_NE(other_model.find("e2b"), std::string::npos) << other_model;
  // Bad profile options are named.
  EXPECT_NE(error_of([&] {
              speculative::profile_sps(*target_, {.sizes = {4, 2}});
            }).find("size 1"),
            std::string::npos);
  EXPECT_NE(
      error_of([&] { speculative::profile_sps(*target_, {.sizes = {1}, .reps = 0}); }).find("reps"),
      std::string::npos);
}

}  // namespace
}  // namespace specula
