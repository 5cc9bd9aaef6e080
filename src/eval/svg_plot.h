// A small line-chart writer producing standalone SVG text: series of (x, y) points, axes with
// "nice" ticks (1, 2 or 5 times a power of ten), axis labels, a title and a legend.
#pragma once

#include <optional>
#include <string>
#include <vector>

namespace spindle {

struct PlotSeries {
  std::string name;
  std::vector<double> x;
  std::vector<double> y;  // points whose x or y is not finite are left out
};

struct LinePlot {
  std::string title;
  std::string subtitle;  // a smaller second line under the title; may be empty
  std::string x_label;
  std::string y_label;
  std::vector<PlotSeries> series;
  // Values the x axis must include besides the data (e.g. 0 and the window length).
  std::vector<double> x_include;
  int width = 900;
  int height = 540;
};

struct AxisTicks {
  double lo = 0.0;  // axis range, rounded out to whole steps
  double hi = 1.0;
  double step = 1.0;
  std::vector<double> values;
};

// About `target` ticks for [lo, hi]. With `round_out` the range grows to whole steps (a value
// axis); without, it stays [lo, hi] and the ticks are the whole steps inside (a position axis).
// The step is at least `min_step` (1 for token positions). An empty range (lo == hi) is widened
// around its value.
AxisTicks nice_ticks(double lo, double hi, int target = 6, bool round_out = true, double min_step = 0.0);

// A tick label with as many decimals as `step` needs; large values get a k or M suffix when the
// axis reaches 10^4 or 10^6 (`axis_max` is the largest absolute value on the axis).
std::string format_tick(double value, double step, double axis_max);

// The chart as SVG 1.1 text; one <polyline> per series. The x axis is taken as integer positions.
// Series after the first are dashed with hollow markers, so equal series still show each other.
std::string render_svg(const LinePlot& plot);

}  // namespace spindle
