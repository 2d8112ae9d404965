// SPDX-License-Identifier: Apache-2.0
// PNG charts for `specula calibrate` and `specula ab` (issue #33), drawn with
// cairo (Debian libcairo2-dev) and its toy text API. A library of its own
// (specula_lab_plot) so that nothing in the engine links cairo.
#pragma once

#include <optional>
#include <string>
#include <vector>

#include "engine/lab/ab_stats.h"
#include "engine/lab/calibration.h"

namespace specula::lab {

// One line of a reliability panel: bins of predicted probability against the
// observed rate (calibration.h). Bins with count 0 are not drawn.
struct ReliabilitySeries {
  std::string name;  // legend text, e.g. "raw", "STS"
  std::vector<ReliabilityBin> bins;
};

// One panel (one draft position): every series on [0, 1] x [0, 1] with the
// diagonal; the first series' bin counts are drawn as faint bars (scaled to
// the panel's largest count); `marker`, when set, is a dashed vertical line at
// that predicted value (e.g. the Fit 1 threshold), labelled `marker_label`.
struct ReliabilityPanel {
  std::string title;
  std::vector<ReliabilitySeries> series;
  std::optional<double> marker;
  std::string marker_label;
};

struct ReliabilityChart {
  std::string title;
  std::vector<ReliabilityPanel> panels;  // laid out in a grid, row by row
  int panel_px = 300;                    // each panel's width and height
};

// The per-prompt deltas of an A/B verdict: bars of Δ acceptance points (with
// the −max_drop line) above bars of the speed ratio B/A (around 1).
struct AbDeltaChart {
  std::string title;
  int width_px = 900;
  int height_px = 600;
};

// Size of the PNG write_reliability_png makes: columns = ceil(sqrt(panels)),
// rows to fit, plus a title band. At least one panel is drawn.
struct PixelSize {
  int width = 0;
  int height = 0;
};
PixelSize reliability_png_size(const ReliabilityChart& chart);

// Writes the chart as a PNG at `path`. Throws Error naming the path when it
// cannot be written, and naming the panel, series and bin when a value is
// not finite (a NaN in a chart is a bug upstream, not a point to skip).
void write_reliability_png(const ReliabilityChart& chart, const std::string& path);

// Writes the per-prompt delta chart of `verdict` as a PNG at `path`
// (width_px x height_px). Errors as write_reliability_png; an empty verdict
// throws.
void write_ab_delta_png(const AbVerdict& verdict, const AbDeltaChart& chart,
                        const std::string& path);

}  // namespace specula::lab
