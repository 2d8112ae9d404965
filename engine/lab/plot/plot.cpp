// SPDX-License-Identifier: Apache-2.0
#include "engine/lab/plot/plot.h"

#include <cairo.h>
#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <memory>

#include "engine/core/error.h"

namespace specula::lab {
namespace {

struct SurfaceDeleter {
  void operator()(cairo_surface_t* s) const { cairo_surface_destroy(s); }
};
struct ContextDeleter {
  void operator()(cairo_t* c) const { cairo_destroy(c); }
};
using Surface = std::unique_ptr<cairo_surface_t, SurfaceDeleter>;
using Context = std::unique_ptr<cairo_t, ContextDeleter>;

struct Rgb {
  double r, g, b;
};
// Colour-blind-safe (Okabe-Ito) order for the series.
constexpr Rgb kPalette[] = {{0.90, 0.62, 0.00}, {0.00, 0.45, 0.70}, {0.00, 0.62, 0.45},
                            {0.80, 0.40, 0.00}, {0.34, 0.71, 0.91}, {0.80, 0.47, 0.65}};
constexpr int kPaletteSize = sizeof(kPalette) / sizeof(kPalette[0]);

void set_rgb(cairo_t* cr, Rgb c, double alpha = 1.0) {
  cairo_set_source_rgba(cr, c.r, c.g, c.b, alpha);
}

enum class Align { kLeft, kCenter, kRight };

// Draws `text` with its baseline's anchor at (x, y) (toy text API).
void draw_text(cairo_t* cr, const std::string& text, double x, double y, Align align,
               double size = 11.0) {
  cairo_set_font_size(cr, size);
  cairo_text_extents_t ext;
  cairo_text_extents(cr, text.c_str(), &ext);
  double dx = 0.0;
  if (align == Align::kCenter) dx = -(ext.width / 2.0 + ext.x_bearing);
  if (align == Align::kRight) dx = -(ext.width + ext.x_bearing);
  cairo_move_to(cr, x + dx, y);
  cairo_show_text(cr, text.c_str());
}

// `text` centred on (x, y), rotated to read bottom to top (a y-axis label).
void draw_vertical_text(cairo_t* cr, const std::string& text, double x, double y,
                        double size = 11.0) {
  cairo_save(cr);
  cairo_translate(cr, x, y);
  cairo_rotate(cr, -M_PI / 2.0);
  draw_text(cr, text, 0.0, 0.0, Align::kCenter, size);
  cairo_restore(cr);
}

// A plot area in pixels and the data range it shows.
struct Frame {
  double px, py, pw, ph;  // left, top, width, height in pixels
  double x0, x1, y0, y1;  // data range
  double x(double v) const { return px + (v - x0) / (x1 - x0) * pw; }
  double y(double v) const { return py + ph - (v - y0) / (y1 - y0) * ph; }
};

// About `target` ticks at 1, 2 or 5 times a power of ten covering [lo, hi].
std::vector<double> nice_ticks(double lo, double hi, int target) {
  const double span = hi - lo;
  if (!(span > 0.0)) return {lo};
  const double raw = span / std::max(1, target);
  const double mag = std::pow(10.0, std::floor(std::log10(raw)));
  double step = mag;
  for (double m : {1.0, 2.0, 5.0, 10.0}) {
    step = m * mag;
    if (step >= raw) break;
  }
  std::vector<double> ticks;
  for (double v = std::ceil(lo / step - 1e-9) * step; v <= hi + step * 1e-9; v += step) {
    ticks.push_back(std::abs(v) < step * 1e-9 ? 0.0 : v);
  }
  return ticks;
}

// Enough decimals to tell ticks `step` apart (0.25 -> 2, 0.5 -> 1, 5 -> 0).
std::string tick_label(double v, double step) {
  int decimals = 0;
  for (double scaled = std::abs(step); decimals < 6; ++decimals, scaled *= 10.0) {
    if (std::abs(scaled - std::round(scaled)) < 1e-6 * std::max(1.0, scaled)) break;
  }
  return fmt::format("{:.{}f}", v, decimals);
}

// Frame border, grid-less ticks with labels on both axes, and axis titles.
void draw_axes(cairo_t* cr, const Frame& f, const std::vector<double>& xticks,
               const std::vector<double>& yticks, const std::string& xlabel,
               const std::string& ylabel, double ylabel_offset = 34.0) {
  cairo_set_source_rgb(cr, 0.0, 0.0, 0.0);
  cairo_set_line_width(cr, 1.0);
  cairo_rectangle(cr, f.px, f.py, f.pw, f.ph);
  cairo_stroke(cr);
  const double xstep = xticks.size() > 1 ? xticks[1] - xticks[0] : 1.0;
  const double ystep = yticks.size() > 1 ? yticks[1] - yticks[0] : 1.0;
  for (double v : xticks) {
    const double x = f.x(v);
    cairo_move_to(cr, x, f.py + f.ph);
    cairo_line_to(cr, x, f.py + f.ph + 4.0);
    cairo_stroke(cr);
    draw_text(cr, tick_label(v, xstep), x, f.py + f.ph + 15.0, Align::kCenter, 10.0);
  }
  for (double v : yticks) {
    const double y = f.y(v);
    cairo_move_to(cr, f.px - 4.0, y);
    cairo_line_to(cr, f.px, y);
    cairo_stroke(cr);
    draw_text(cr, tick_label(v, ystep), f.px - 6.0, y + 3.5, Align::kRight, 10.0);
  }
  if (!xlabel.empty()) draw_text(cr, xlabel, f.px + f.pw / 2.0, f.py + f.ph + 29.0, Align::kCenter);
  if (!ylabel.empty()) draw_vertical_text(cr, ylabel, f.px - ylabel_offset, f.py + f.ph / 2.0);
}

void check_finite(double v, const std::string& what) {
  if (!std::isfinite(v)) fail("plot: {} is {} (every plotted value must be finite)", what, v);
}

std::pair<Surface, Context> make_canvas(int width, int height, const std::string& path) {
  if (width < 1 || height < 1 || width > 16384 || height > 16384) {
    fail("{}: chart size {}x{} px is outside 1..16384", path, width, height);
  }
  Surface surface(cairo_image_surface_create(CAIRO_FORMAT_ARGB32, width, height));
  if (cairo_surface_status(surface.get()) != CAIRO_STATUS_SUCCESS) {
    fail("{}: cannot make a {}x{} image: {}", path, width, height,
         cairo_status_to_string(cairo_surface_status(surface.get())));
  }
  Context cr(cairo_create(surface.get()));
  cairo_set_source_rgb(cr.get(), 1.0, 1.0, 1.0);
  cairo_paint(cr.get());
  cairo_select_font_face(cr.get(), "sans-serif", CAIRO_FONT_SLANT_NORMAL, CAIRO_FONT_WEIGHT_NORMAL);
  return {std::move(surface), std::move(cr)};
}

void write_png(cairo_surface_t* surface, cairo_t* cr, const std::string& path) {
  if (cairo_status(cr) != CAIRO_STATUS_SUCCESS) {
    fail("{}: drawing failed: {}", path, cairo_status_to_string(cairo_status(cr)));
  }
  cairo_surface_flush(surface);
  const cairo_status_t status = cairo_surface_write_to_png(surface, path.c_str());
  if (status != CAIRO_STATUS_SUCCESS) {
    fail("{}: cannot write the PNG: {}", path, cairo_status_to_string(status));
  }
}

void check_panel(const ReliabilityPanel& panel, size_t p) {
  for (size_t s = 0; s < panel.series.size(); ++s) {
    const ReliabilitySeries& series = panel.series[s];
    for (size_t b = 0; b < series.bins.size(); ++b) {
      const ReliabilityBin& bin = series.bins[b];
      const std::string where =
          fmt::format("panel {} ('{}') series '{}' bin {}", p, panel.title, series.name, b);
      check_finite(bin.mean_predicted, where + " mean_predicted");
      check_finite(bin.observed_rate, where + " observed_rate");
      check_finite(bin.lo, where + " lo");
      check_finite(bin.hi, where + " hi");
      if (bin.count < 0) fail("plot: {} count is {} (must be >= 0)", where, bin.count);
    }
  }
  if (panel.marker) check_finite(*panel.marker, fmt::format("panel {} marker", p));
}

constexpr double kTitleBand = 44.0;  // pixels above the panels: title and legend

void draw_panel(cairo_t* cr, const ReliabilityPanel& panel, double left, double top, double size) {
  const Frame f{.px = left + 48.0,
                .py = top + 22.0,
                .pw = size - 60.0,
                .ph = size - 60.0,
                .x0 = 0.0,
                .x1 = 1.0,
                .y0 = 0.0,
                .y1 = 1.0};
  // Faint count bars of the first series (how much evidence each bin holds).
  if (!panel.series.empty()) {
    int64_t max_count = 0;
    for (const ReliabilityBin& b : panel.series[0].bins) max_count = std::max(max_count, b.count);
    for (const ReliabilityBin& b : panel.series[0].bins) {
      if (b.count == 0 || max_count == 0) continue;
      const double h = 0.35 * static_cast<double>(b.count) / static_cast<double>(max_count);
      const double x0 = f.x(std::clamp(b.lo, 0.0, 1.0));
      const double x1 = f.x(std::clamp(b.hi, 0.0, 1.0));
      cairo_set_source_rgba(cr, 0.3, 0.3, 0.3, 0.15);
      cairo_rectangle(cr, x0 + 0.5, f.y(h), std::max(1.0, x1 - x0 - 1.0), f.y(0.0) - f.y(h));
      cairo_fill(cr);
    }
  }
  // The diagonal: perfect calibration.
  const double dash[] = {4.0, 3.0};
  cairo_set_dash(cr, dash, 2, 0.0);
  cairo_set_source_rgb(cr, 0.55, 0.55, 0.55);
  cairo_set_line_width(cr, 1.0);
  cairo_move_to(cr, f.x(0.0), f.y(0.0));
  cairo_line_to(cr, f.x(1.0), f.y(1.0));
  cairo_stroke(cr);
  if (panel.marker) {
    const double m = std::clamp(*panel.marker, 0.0, 1.0);
    cairo_set_source_rgb(cr, 0.8, 0.1, 0.1);
    cairo_move_to(cr, f.x(m), f.y(0.0));
    cairo_line_to(cr, f.x(m), f.y(1.0));
    cairo_stroke(cr);
    if (!panel.marker_label.empty()) {
      const bool right_half = m > 0.6;
      draw_text(cr, panel.marker_label, f.x(m) + (right_half ? -4.0 : 4.0), f.y(0.93),
                right_half ? Align::kRight : Align::kLeft, 10.0);
    }
  }
  cairo_set_dash(cr, nullptr, 0, 0.0);
  for (size_t s = 0; s < panel.series.size(); ++s) {
    set_rgb(cr, kPalette[s % kPaletteSize]);
    cairo_set_line_width(cr, 1.8);
    bool started = false;
    for (const ReliabilityBin& b : panel.series[s].bins) {
      if (b.count == 0) continue;
      const double x = f.x(std::clamp(b.mean_predicted, 0.0, 1.0));
      const double y = f.y(std::clamp(b.observed_rate, 0.0, 1.0));
      if (started) {
        cairo_line_to(cr, x, y);
      } else {
        cairo_move_to(cr, x, y);
        started = true;
      }
    }
    cairo_stroke(cr);
    for (const ReliabilityBin& b : panel.series[s].bins) {
      if (b.count == 0) continue;
      cairo_arc(cr, f.x(std::clamp(b.mean_predicted, 0.0, 1.0)),
                f.y(std::clamp(b.observed_rate, 0.0, 1.0)), 2.5, 0.0, 2.0 * M_PI);
      cairo_fill(cr);
    }
  }
  const std::vector<double> ticks = {0.0, 0.25, 0.5, 0.75, 1.0};
  draw_axes(cr, f, ticks, ticks, "predicted", "observed");
  cairo_set_source_rgb(cr, 0.0, 0.0, 0.0);
  draw_text(cr, panel.title, f.px + f.pw / 2.0, top + 15.0, Align::kCenter, 12.0);
}

}  // namespace

PixelSize reliability_png_size(const ReliabilityChart& chart) {
  const int n = std::max<int>(1, static_cast<int>(chart.panels.size()));
  const int cols = static_cast<int>(std::ceil(std::sqrt(static_cast<double>(n))));
  const int rows = (n + cols - 1) / cols;
  return {.width = cols * chart.panel_px,
          .height = rows * chart.panel_px + static_cast<int>(kTitleBand)};
}

void write_reliability_png(const ReliabilityChart& chart, const std::string& path) {
  if (chart.panel_px < 120) fail("{}: panel_px {} is too small (>= 120)", path, chart.panel_px);
  for (size_t p = 0; p < chart.panels.size(); ++p) check_panel(chart.panels[p], p);
  const PixelSize size = reliability_png_size(chart);
  auto [surface, context] = make_canvas(size.width, size.height, path);
  cairo_t* cr = context.get();
  cairo_set_source_rgb(cr, 0.0, 0.0, 0.0);
  draw_text(cr, chart.title, 10.0, 18.0, Align::kLeft, 14.0);
  // Legend: the series names of the first panel that has any.
  for (const ReliabilityPanel& panel : chart.panels) {
    if (panel.series.empty()) continue;
    double x = 10.0;
    for (size_t s = 0; s < panel.series.size(); ++s) {
      set_rgb(cr, kPalette[s % kPaletteSize]);
      cairo_set_line_width(cr, 2.0);
      cairo_move_to(cr, x, 34.0);
      cairo_line_to(cr, x + 18.0, 34.0);
      cairo_stroke(cr);
      cairo_set_source_rgb(cr, 0.0, 0.0, 0.0);
      draw_text(cr, panel.series[s].name, x + 22.0, 38.0, Align::kLeft, 11.0);
      cairo_text_extents_t ext;
      cairo_text_extents(cr, panel.series[s].name.c_str(), &ext);
      x += 22.0 + ext.x_advance + 16.0;
    }
    cairo_set_source_rgb(cr, 0.3, 0.3, 0.3);
    draw_text(cr, "bars: samples per bin; dashed: ideal", x, 38.0, Align::kLeft, 10.0);
    break;
  }
  const int n = static_cast<int>(chart.panels.size());
  const int cols = size.width / chart.panel_px;
  for (int p = 0; p < n; ++p) {
    draw_panel(cr, chart.panels[p], (p % cols) * chart.panel_px,
               kTitleBand + (p / cols) * chart.panel_px, chart.panel_px);
  }
  write_png(surface.get(), cr, path);
}

void write_ab_delta_png(const AbVerdict& verdict, const AbDeltaChart& chart,
                        const std::string& path) {
  const std::vector<PromptDelta>& d = verdict.per_prompt;
  if (d.empty()) fail("{}: the A/B verdict has no prompts to plot", path);
  if (chart.width_px < 300 || chart.height_px < 300) {
    fail("{}: chart size {}x{} px is too small (>= 300x300)", path, chart.width_px,
         chart.height_px);
  }
  check_finite(verdict.delta_acc_pts, "delta_acc_pts");
  check_finite(verdict.speed_ratio, "speed_ratio");
  check_finite(verdict.max_drop_pts, "max_drop_pts");
  double dmin = std::min(0.0, -verdict.max_drop_pts), dmax = 0.0;
  double rmin = 1.0, rmax = 1.0;
  for (size_t i = 0; i < d.size(); ++i) {
    check_finite(d[i].delta_pts, fmt::format("prompt {} delta_pts", i));
    check_finite(d[i].speed_ratio, fmt::format("prompt {} speed_ratio", i));
    dmin = std::min(dmin, d[i].delta_pts);
    dmax = std::max(dmax, d[i].delta_pts);
    rmin = std::min(rmin, d[i].speed_ratio);
    rmax = std::max(rmax, d[i].speed_ratio);
  }
  rmin = std::min(rmin, verdict.speed_ratio);
  rmax = std::max(rmax, verdict.speed_ratio);
  auto pad = [](double& lo, double& hi, double min_span) {
    const double span = std::max(hi - lo, min_span);
    lo -= 0.08 * span;
    hi += 0.08 * span;
  };
  pad(dmin, dmax, 1.0);
  pad(rmin, rmax, 0.05);

  auto [surface, context] = make_canvas(chart.width_px, chart.height_px, path);
  cairo_t* cr = context.get();
  const double w = chart.width_px, h = chart.height_px;
  const double left = 70.0, right = 16.0, top = 52.0, gap = 56.0, bottom = 44.0;
  const double ph = (h - top - gap - bottom) / 2.0;
  const double n = static_cast<double>(d.size());
  const Frame fa{.px = left,
                 .py = top,
                 .pw = w - left - right,
                 .ph = ph,
                 .x0 = -0.5,
                 .x1 = n - 0.5,
                 .y0 = dmin,
                 .y1 = dmax};
  const Frame fr{.px = left,
                 .py = top + ph + gap,
                 .pw = w - left - right,
                 .ph = ph,
                 .x0 = -0.5,
                 .x1 = n - 0.5,
                 .y0 = rmin,
                 .y1 = rmax};

  cairo_set_source_rgb(cr, 0.0, 0.0, 0.0);
  draw_text(cr, chart.title, 10.0, 18.0, Align::kLeft, 14.0);
  draw_text(cr,
            fmt::format("delta acceptance {:+.2f} points, speed ratio {:.4f}, {} of {} prompts "
                        "hold, {}",
                        verdict.delta_acc_pts, verdict.speed_ratio, verdict.paired_holds, d.size(),
                        verdict.pass ? "PASS" : "FAIL"),
            10.0, 36.0, Align::kLeft, 11.0);
  cairo_set_source_rgb(cr, 0.3, 0.3, 0.3);
  draw_text(cr, "grey dashed: all prompts together; red dashed: the allowed drop",
            chart.width_px - 10.0, 36.0, Align::kRight, 10.0);

  const double bar = std::max(1.0, 0.7 * fa.pw / n);
  for (size_t i = 0; i < d.size(); ++i) {
    const double x = fa.x(static_cast<double>(i)) - bar / 2.0;
    // Acceptance: green where the prompt holds, red where it does not.
    if (d[i].holds) {
      cairo_set_source_rgb(cr, 0.0, 0.62, 0.45);
    } else {
      cairo_set_source_rgb(cr, 0.84, 0.15, 0.16);
    }
    const double y0 = fa.y(0.0), y1 = fa.y(d[i].delta_pts);
    cairo_rectangle(cr, x, std::min(y0, y1), bar, std::max(1.0, std::abs(y1 - y0)));
    cairo_fill(cr);
    // Speed: blue where B is faster, orange where it is not.
    if (d[i].speed_ratio > 1.0) {
      cairo_set_source_rgb(cr, 0.0, 0.45, 0.70);
    } else {
      cairo_set_source_rgb(cr, 0.90, 0.62, 0.0);
    }
    const double r0 = fr.y(1.0), r1 = fr.y(d[i].speed_ratio);
    cairo_rectangle(cr, x, std::min(r0, r1), bar, std::max(1.0, std::abs(r1 - r0)));
    cairo_fill(cr);
  }
  // Reference lines: 0 and the allowed drop; 1 and the arms' overall ratio.
  auto hline = [&](const Frame& f, double v, Rgb c, bool dashed) {
    const double dash[] = {5.0, 3.0};
    cairo_set_dash(cr, dash, dashed ? 2 : 0, 0.0);
    set_rgb(cr, c);
    cairo_set_line_width(cr, 1.2);
    cairo_move_to(cr, f.px, f.y(v));
    cairo_line_to(cr, f.px + f.pw, f.y(v));
    cairo_stroke(cr);
    cairo_set_dash(cr, nullptr, 0, 0.0);
  };
  hline(fa, 0.0, {0.0, 0.0, 0.0}, false);
  hline(fa, -verdict.max_drop_pts, {0.84, 0.15, 0.16}, true);
  hline(fa, verdict.delta_acc_pts, {0.3, 0.3, 0.3}, true);
  hline(fr, 1.0, {0.0, 0.0, 0.0}, false);
  hline(fr, verdict.speed_ratio, {0.3, 0.3, 0.3}, true);

  // Prompt ticks: every prompt up to 25, else a 1-2-5 stride.
  std::vector<double> xticks;
  const std::vector<double> stride_ticks = nice_ticks(0.0, n - 1.0, 20);
  const double stride =
      d.size() <= 25
          ? 1.0
          : std::max(1.0, stride_ticks.size() > 1 ? stride_ticks[1] - stride_ticks[0] : 1.0);
  for (double v = 0.0; v <= n - 1.0 + 1e-9; v += stride) xticks.push_back(v);
  draw_axes(cr, fa, xticks, nice_ticks(dmin, dmax, 6), "", "delta acceptance (points)", 54.0);
  draw_axes(cr, fr, xticks, nice_ticks(rmin, rmax, 6), "prompt", "speed ratio B/A", 54.0);
  write_png(surface.get(), cr, path);
}

}  // namespace specula::lab
