#include "eval/svg_plot.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <sstream>

#include "core/error.h"

namespace spindle {

namespace {

const char* const kColors[] = {"#1f77b4", "#d62728", "#2ca02c", "#9467bd", "#ff7f0e", "#8c564b"};
constexpr double kFontWidth = 0.6;  // average glyph width per font size, to fit legend names
constexpr double kLegendRow = 18;

std::string number(double v) {
  char text[32];
  std::snprintf(text, sizeof text, "%.2f", v);
  return text;
}

std::string escape_xml(const std::string& text) {
  std::string out;
  for (char c : text) {
    switch (c) {
      case '&':
        out += "&amp;";
        break;
      case '<':
        out += "&lt;";
        break;
      case '>':
        out += "&gt;";
        break;
      case '"':
        out += "&quot;";
        break;
      default:
        // Control characters are not allowed in XML 1.0.
        out += static_cast<unsigned char>(c) < 0x20 && c != '\t' ? '?' : c;
    }
  }
  return out;
}

// Long names (model paths) keep their tail, which is the part that tells runs apart.
std::string shorten(const std::string& text, size_t max_chars) {
  if (text.size() <= max_chars) return text;
  size_t cut = text.size() - (max_chars - 3);
  while (cut < text.size() && (static_cast<unsigned char>(text[cut]) & 0xC0) == 0x80) ++cut;  // UTF-8 tail
  return "..." + text.substr(cut);
}

const char* color_of(size_t series) { return kColors[series % std::size(kColors)]; }

// The first series is solid, later ones dashed: where lines coincide both colours still show.
std::string line_style(size_t series) {
  std::string style = " stroke=\"" + std::string(color_of(series)) + "\" stroke-width=\"2\"";
  if (series > 0) style += " stroke-dasharray=\"7 4\"";
  return style;
}

// A filled circle for the first series, hollow squares after it (a filled circle shows through).
std::string marker(size_t series, double x, double y) {
  if (series == 0) {
    return "<circle cx=\"" + number(x) + "\" cy=\"" + number(y) + "\" r=\"3.5\" fill=\"" + color_of(0) +
           "\"/>\n";
  }
  return "<rect x=\"" + number(x - 4.5) + "\" y=\"" + number(y - 4.5) +
         "\" width=\"9\" height=\"9\" fill=\"none\" stroke=\"" + color_of(series) +
         "\" stroke-width=\"1.6\"/>\n";
}

struct Range {
  double lo = INFINITY;
  double hi = -INFINITY;
  void include(double v) {
    lo = std::min(lo, v);
    hi = std::max(hi, v);
  }
  bool empty() const { return lo > hi; }
};

}  // namespace

AxisTicks nice_ticks(double lo, double hi, int target, bool round_out, double min_step) {
  check(std::isfinite(lo) && std::isfinite(hi) && lo <= hi, "axis range [", lo, ", ", hi,
        "] is not a finite interval");
  check(target >= 2, "need at least 2 ticks, got ", target);
  if (hi - lo <= 1e-12 * std::max(1.0, std::fabs(lo))) {
    // One value (a single bucket, or equal losses): centre it in a small range around itself.
    const double pad = lo == 0.0 ? 1.0 : 0.05 * std::fabs(lo);
    lo -= pad;
    hi += pad;
  }
  const double rough = (hi - lo) / (target - 1);
  const double magnitude = std::pow(10.0, std::floor(std::log10(rough)));
  const double fraction = rough / magnitude;
  const double nice = fraction < 1.5 ? 1.0 : fraction < 3.0 ? 2.0 : fraction < 7.0 ? 5.0 : 10.0;
  AxisTicks ticks;
  ticks.step = std::max(nice * magnitude, min_step);
  const double first = round_out ? std::floor(lo / ticks.step + 1e-9) : std::ceil(lo / ticks.step - 1e-9);
  const double last = round_out ? std::ceil(hi / ticks.step - 1e-9) : std::floor(hi / ticks.step + 1e-9);
  ticks.lo = round_out ? first * ticks.step : lo;
  ticks.hi = round_out ? last * ticks.step : hi;
  for (double k = first; k <= last + 0.5; k += 1.0) {
    const double v = k * ticks.step;
    ticks.values.push_back(std::fabs(v) < 1e-9 * ticks.step ? 0.0 : v);
  }
  return ticks;
}

std::string format_tick(double value, double step, double axis_max) {
  double scale = 1.0;
  const char* suffix = "";
  if (axis_max >= 1e6) {
    scale = 1e6;
    suffix = "M";
  } else if (axis_max >= 1e4) {
    scale = 1e3;
    suffix = "k";
  }
  const int decimals = std::max(0, static_cast<int>(-std::floor(std::log10(step / scale) + 1e-9)));
  char text[48];
  std::snprintf(text, sizeof text, "%.*f%s", decimals, value / scale, value == 0.0 ? "" : suffix);
  return text;
}

std::string render_svg(const LinePlot& plot) {
  check(!plot.series.empty(), "plot '", plot.title, "' has no series");
  Range xr, yr;
  for (const PlotSeries& s : plot.series) {
    check(s.x.size() == s.y.size(), "plot series '", s.name, "' has ", s.x.size(), " x values and ",
          s.y.size(), " y values");
    for (size_t i = 0; i < s.x.size(); ++i) {
      if (!std::isfinite(s.x[i]) || !std::isfinite(s.y[i])) continue;
      xr.include(s.x[i]);
      yr.include(s.y[i]);
    }
  }
  check(!yr.empty(), "plot '", plot.title, "' has no finite points");
  for (double v : plot.x_include) {
    if (std::isfinite(v)) xr.include(v);
  }
  const AxisTicks xt = nice_ticks(xr.lo, xr.hi, 7, false, 1.0);
  const AxisTicks yt = nice_ticks(yr.lo, yr.hi, 6);

  const double W = plot.width, H = plot.height;
  const double legend_top = plot.subtitle.empty() ? 40 : 58;
  const double left = 86, right = 28, bottom = 62;
  const double top = legend_top + kLegendRow * static_cast<double>(plot.series.size()) + 10;
  const double pw = W - left - right, ph = H - top - bottom;
  check(pw > 50 && ph > 50, "plot size ", plot.width, "x", plot.height, " is too small");
  // Data sit a few pixels inside the frame, so points at the ends of a range stay visible.
  const double inset = 8;
  auto px = [&](double x) { return left + inset + (x - xt.lo) / (xt.hi - xt.lo) * (pw - 2 * inset); };
  auto py = [&](double y) { return top + ph - inset - (y - yt.lo) / (yt.hi - yt.lo) * (ph - 2 * inset); };
  const double x_max = std::max(std::fabs(xt.lo), std::fabs(xt.hi));
  const double y_max = std::max(std::fabs(yt.lo), std::fabs(yt.hi));

  std::ostringstream o;
  o << "<?xml version=\"1.0\" encoding=\"UTF-8\"?>\n"
    << "<svg xmlns=\"http://www.w3.org/2000/svg\" version=\"1.1\" width=\"" << plot.width << "\" height=\""
    << plot.height << "\" viewBox=\"0 0 " << plot.width << ' ' << plot.height
    << "\" font-family=\"DejaVu Sans, Helvetica, Arial, sans-serif\">\n";
  o << "<rect x=\"0\" y=\"0\" width=\"" << plot.width << "\" height=\"" << plot.height
    << "\" fill=\"white\"/>\n";
  o << "<text x=\"" << number(W / 2)
    << "\" y=\"28\" text-anchor=\"middle\" font-size=\"17\" font-weight=\"bold\">" << escape_xml(plot.title)
    << "</text>\n";
  if (!plot.subtitle.empty()) {
    o << "<text x=\"" << number(W / 2) << "\" y=\"48\" text-anchor=\"middle\" font-size=\"13\" fill=\"#444\">"
      << escape_xml(plot.subtitle) << "</text>\n";
  }

  // Grid and ticks.
  o << "<g font-size=\"12\" fill=\"#222\">\n";
  for (double v : yt.values) {
    const double y = py(v);
    o << "<line x1=\"" << number(left) << "\" y1=\"" << number(y) << "\" x2=\"" << number(left + pw)
      << "\" y2=\"" << number(y) << "\" stroke=\"#e3e3e3\" stroke-width=\"1\"/>\n";
    o << "<line x1=\"" << number(left - 5) << "\" y1=\"" << number(y) << "\" x2=\"" << number(left)
      << "\" y2=\"" << number(y) << "\" stroke=\"#222\" stroke-width=\"1\"/>\n";
    o << "<text x=\"" << number(left - 8) << "\" y=\"" << number(y + 4) << "\" text-anchor=\"end\">"
      << format_tick(v, yt.step, y_max) << "</text>\n";
  }
  for (double v : xt.values) {
    const double x = px(v);
    o << "<line x1=\"" << number(x) << "\" y1=\"" << number(top) << "\" x2=\"" << number(x) << "\" y2=\""
      << number(top + ph) << "\" stroke=\"#f0f0f0\" stroke-width=\"1\"/>\n";
    o << "<line x1=\"" << number(x) << "\" y1=\"" << number(top + ph) << "\" x2=\"" << number(x) << "\" y2=\""
      << number(top + ph + 5) << "\" stroke=\"#222\" stroke-width=\"1\"/>\n";
    o << "<text x=\"" << number(x) << "\" y=\"" << number(top + ph + 19) << "\" text-anchor=\"middle\">"
      << format_tick(v, xt.step, x_max) << "</text>\n";
  }
  o << "</g>\n";
  o << "<rect x=\"" << number(left) << "\" y=\"" << number(top) << "\" width=\"" << number(pw)
    << "\" height=\"" << number(ph) << "\" fill=\"none\" stroke=\"#222\" stroke-width=\"1\"/>\n";
  o << "<text x=\"" << number(left + pw / 2) << "\" y=\"" << number(H - 16)
    << "\" text-anchor=\"middle\" font-size=\"13\">" << escape_xml(plot.x_label) << "</text>\n";
  o << "<text x=\"18\" y=\"" << number(top + ph / 2)
    << "\" text-anchor=\"middle\" font-size=\"13\" transform=\"rotate(-90 18 " << number(top + ph / 2)
    << ")\">" << escape_xml(plot.y_label) << "</text>\n";

  // Series: a line through the points, and markers when there are few enough to tell apart
  // (a single point draws no line, only its marker).
  for (size_t s = 0; s < plot.series.size(); ++s) {
    const PlotSeries& series = plot.series[s];
    std::string points;
    std::vector<std::pair<double, double>> marks;
    for (size_t i = 0; i < series.x.size(); ++i) {
      if (!std::isfinite(series.x[i]) || !std::isfinite(series.y[i])) continue;
      const double x = px(series.x[i]), y = py(series.y[i]);
      if (!points.empty()) points += ' ';
      points += number(x) + "," + number(y);
      marks.emplace_back(x, y);
    }
    o << "<polyline fill=\"none\"" << line_style(s) << " stroke-linejoin=\"round\" points=\"" << points
      << "\"/>\n";
    if (marks.size() <= 64) {
      for (const auto& [x, y] : marks) o << marker(s, x, y);
    }
  }

  // Legend above the plot area, one row per series, so it never hides a line.
  for (size_t s = 0; s < plot.series.size(); ++s) {
    const double y = legend_top + kLegendRow * static_cast<double>(s) + kLegendRow / 2;
    o << "<line x1=\"" << number(left) << "\" y1=\"" << number(y) << "\" x2=\"" << number(left + 26)
      << "\" y2=\"" << number(y) << "\"" << line_style(s) << "/>\n";
    o << marker(s, left + 13, y);
    const size_t max_chars = static_cast<size_t>(std::max(10.0, (pw - 34) / (12 * kFontWidth)));
    o << "<text x=\"" << number(left + 34) << "\" y=\"" << number(y + 4) << "\" font-size=\"12\">"
      << escape_xml(shorten(plot.series[s].name, max_chars)) << "</text>\n";
  }
  o << "</svg>\n";
  return o.str();
}

}  // namespace spindle
