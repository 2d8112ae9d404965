// SPDX-License-Identifier: Apache-2.0
// PNG charts (engine/lab/plot/plot.h): the files are real PNGs of the stated
// size with something drawn on them, NaN never reaches a chart, and a path
// that cannot be written is an Error naming it.
#include "engine/lab/plot/plot.h"

#include <cairo.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <array>
#include <cstring>
#include <fstream>

#include "engine/core/error.h"
#include "tests/unit/lab/lab_test_util.h"

namespace specula::lab {
namespace {

using ::testing::HasSubstr;

struct PngHeader {
  bool signature_ok = false;
  bool ihdr_ok = false;
  uint32_t width = 0;
  uint32_t height = 0;
};

uint32_t be32(const unsigned char* p) {
  return (uint32_t{p[0]} << 24) | (uint32_t{p[1]} << 16) | (uint32_t{p[2]} << 8) | p[3];
}

// The 8-byte signature, then the first chunk, which must be IHDR (13 bytes).
PngHeader read_png_header(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  std::array<unsigned char, 24> b{};
  f.read(reinterpret_cast<char*>(b.data()), b.size());
  PngHeader h;
  if (f.gcount() != static_cast<std::streamsize>(b.size())) return h;
  static constexpr unsigned char kSig[8] = {0x89, 'P', 'N', 'G', '\r', '\n', 0x1a, '\n'};
  h.signature_ok = std::memcmp(b.data(), kSig, 8) == 0;
  h.ihdr_ok = be32(b.data() + 8) == 13 && std::memcmp(b.data() + 12, "IHDR", 4) == 0;
  h.width = be32(b.data() + 16);
  h.height = be32(b.data() + 20);
  return h;
}

// Fraction of pixels that are not white, read back through cairo's decoder.
double inked_fraction(const std::string& path) {
  cairo_surface_t* s = cairo_image_surface_create_from_png(path.c_str());
  EXPECT_EQ(cairo_surface_status(s), CAIRO_STATUS_SUCCESS) << path;
  const int w = cairo_image_surface_get_width(s), h = cairo_image_surface_get_height(s);
  const int stride = cairo_image_surface_get_stride(s);
  const unsigned char* data = cairo_image_surface_get_data(s);
  int64_t inked = 0;
  for (int y = 0; y < h && data; ++y) {
    const auto* row = reinterpret_cast<const uint32_t*>(data + static_cast<size_t>(y) * stride);
    for (int x = 0; x < w; ++x) inked += (row[x] & 0xffffffu) != 0xffffffu ? 1 : 0;
  }
  cairo_surface_destroy(s);
  return w * h > 0 ? static_cast<double>(inked) / (static_cast<double>(w) * h) : 0.0;
}

ReliabilityChart calibration_chart() {
  const std::vector<double> truth = {1.0, 2.0, 1.5, 0.8, 2.5};
  const std::vector<DraftRound> rounds = testing::miscalibrated_rounds(4000, truth, 3);
  const StsFit sts = fit_sts(rounds, {.block_size = 5, .t_step = 0.1});
  const ThresholdFit thr =
      fit_thresholds(samples_from_rounds(rounds), {.block_size = 5, .target = 0.5});
  ReliabilityChart chart{.title = "synthetic drafter: survival reliability per position"};
  for (int k = 0; k < 5; ++k) {
    ReliabilityPanel panel{.title = "position " + std::to_string(k)};
    panel.series.push_back(
        {.name = "raw", .bins = survival_reliability(rounds, std::vector<double>(5, 1.0), k)});
    panel.series.push_back(
        {.name = "STS", .bins = survival_reliability(rounds, sts.temperatures, k)});
    panel.marker = thr.thresholds[k];
    panel.marker_label = "Fit 1 threshold (on c_k)";
    chart.panels.push_back(std::move(panel));
  }
  return chart;
}

TEST(LabPlot, ReliabilityDiagramIsAPngOfTheStatedSize) {
  testing::ScratchDir dir("plot_rel");
  const ReliabilityChart chart = calibration_chart();
  const std::string path = dir.file("reliability.png");
  write_reliability_png(chart, path);
  const PngHeader h = read_png_header(path);
  EXPECT_TRUE(h.signature_ok);
  EXPECT_TRUE(h.ihdr_ok);
  const PixelSize size = reliability_png_size(chart);
  EXPECT_EQ(size.width, 3 * 300);  // 5 panels: 3 columns, 2 rows
  EXPECT_EQ(size.height, 2 * 300 + 44);
  EXPECT_EQ(h.width, static_cast<uint32_t>(size.width));
  EXPECT_EQ(h.height, static_cast<uint32_t>(size.height));
  const double ink = inked_fraction(path);
  EXPECT_GT(ink, 0.02);
  EXPECT_LT(ink, 0.6);
}

TEST(LabPlot, AbDeltaChartIsAPngOfTheStatedSize) {
  testing::ScratchDir dir("plot_ab");
  std::vector<PromptRun> a, b;
  testing::Rng rng(5);
  for (int i = 0; i < 40; ++i) {
    const int64_t drafted = i == 3 ? 0 : 100;  // one prompt drafted nothing
    a.push_back({.generated_tokens = 200,
                 .drafted = drafted,
                 .accepted = drafted * 6 / 10,
                 .target_calls = 80,
                 .wall_ms = 1000.0 + 100.0 * rng.uniform()});
    b.push_back({.generated_tokens = 200,
                 .drafted = drafted,
                 .accepted = drafted * (55 + static_cast<int64_t>(rng.next() % 10)) / 100,
                 .target_calls = 80,
                 .wall_ms = 900.0 + 200.0 * rng.uniform()});
  }
  const AbVerdict v = compare_arms(a, b);
  const std::string path = dir.file("ab.png");
  write_ab_delta_png(v, {.title = "bf16 vs int8", .width_px = 800, .height_px = 500}, path);
  const PngHeader h = read_png_header(path);
  EXPECT_TRUE(h.signature_ok);
  EXPECT_TRUE(h.ihdr_ok);
  EXPECT_EQ(h.width, 800u);
  EXPECT_EQ(h.height, 500u);
  EXPECT_GT(inked_fraction(path), 0.02);
  // The zero-drafted prompt plotted as 0, not NaN: the chart accepted it.
  EXPECT_EQ(v.per_prompt[3].delta_pts, 0.0);
  AbVerdict empty = v;
  empty.per_prompt.clear();
  EXPECT_THROW(write_ab_delta_png(empty, {}, dir.file("empty.png")), Error);
}

TEST(LabPlot, NanIsAnErrorNamingWhere) {
  testing::ScratchDir dir("plot_nan");
  ReliabilityChart chart = calibration_chart();
  chart.panels[2].series[1].bins[4].count = 3;
  chart.panels[2].series[1].bins[4].observed_rate = std::nan("");
  try {
    write_reliability_png(chart, dir.file("nan.png"));
    FAIL() << "expected an Error";
  } catch (const Error& e) {
    EXPECT_THAT(e.what(), HasSubstr("panel 2"));
    EXPECT_THAT(e.what(), HasSubstr("series 'STS' bin 4"));
  }
  AbVerdict v;
  v.per_prompt.resize(2);
  v.per_prompt[1].speed_ratio = std::nan("");
  try {
    write_ab_delta_png(v, {}, dir.file("nan_ab.png"));
    FAIL() << "expected an Error";
  } catch (const Error& e) {
    EXPECT_THAT(e.what(), HasSubstr("prompt 1 speed_ratio"));
  }
}

TEST(LabPlot, UnwritablePathIsAnErrorNamingIt) {
  const std::string path = "/nonexistent-specula-dir/sub/reliability.png";
  try {
    write_reliability_png(calibration_chart(), path);
    FAIL() << "expected an Error";
  } catch (const Error& e) {
    EXPECT_THAT(e.what(), HasSubstr(path));
  }
  AbVerdict v;
  v.per_prompt.resize(1);
  try {
    write_ab_delta_png(v, {}, "/nonexistent-specula-dir/ab.png");
    FAIL() << "expected an Error";
  } catch (const Error& e) {
    EXPECT_THAT(e.what(), HasSubstr("/nonexistent-specula-dir/ab.png"));
  }
}

}  // namespace
}  // namespace specula::lab
