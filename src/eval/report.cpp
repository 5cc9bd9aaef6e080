#include "eval/report.h"

#include <unistd.h>

#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <numbers>
#include <sstream>

#include "core/error.h"

namespace spindle {

namespace {

std::string printf_string(const char* format, double value) {
  char text[64];
  std::snprintf(text, sizeof text, format, value);
  return text;
}

std::string range_label(int64_t start, int64_t end) {
  return "[" + std::to_string(start) + ", " + std::to_string(end) + ")";
}

void check_same_counts(const BucketLoss& model, const BucketLoss& compare) {
  check(model.bucket_size() == compare.bucket_size(),
        "compared losses use different bucket sizes: ", model.bucket_size(), " and ", compare.bucket_size());
  check(model.num_buckets() == compare.num_buckets() && model.windows() == compare.windows(),
        "compared losses cover different windows: ", model.windows(), " windows in ", model.num_buckets(),
        " buckets against ", compare.windows(), " windows in ", compare.num_buckets(), " buckets");
  for (int64_t b = 0; b < model.num_buckets(); ++b) {
    check(model.count(b) == compare.count(b), "compared losses count different tokens in bucket ", b, ": ",
          model.count(b), " and ", compare.count(b));
  }
}

// Column layout shared by the table's header and rows.
struct Column {
  std::string header;
  int width;
};

std::string pad_left(const std::string& text, int width) {
  const int n = static_cast<int>(text.size());
  return n >= width ? text : std::string(width - n, ' ') + text;
}

std::string pad_right(const std::string& text, int width) {
  const int n = static_cast<int>(text.size());
  return n >= width ? text : text + std::string(width - n, ' ');
}

std::vector<std::string> table_cells(const ReportRow& row) {
  std::vector<std::string> cells = {row.label, std::to_string(row.tokens), printf_string("%.6f", row.loss),
                                    printf_string("%.6f", nats_to_bits(row.loss))};
  if (row.compare_loss) {
    cells.push_back(printf_string("%.6f", *row.compare_loss));
    cells.push_back(printf_string("%.6f", nats_to_bits(*row.compare_loss)));
    cells.push_back(printf_string("%+.6f", row.improvement()));
    cells.push_back(printf_string("%+.3f%%", row.improvement_percent()));
  }
  return cells;
}

}  // namespace

double nats_to_bits(double nats) { return nats / std::numbers::ln2; }

double ReportRow::improvement() const {
  check(compare_loss.has_value(), "row ", label, " has no comparison");
  return *compare_loss - loss;
}

double ReportRow::improvement_percent() const { return 100.0 * improvement() / *compare_loss; }

LossReport make_report(const BucketLoss& model, const std::string& model_name, const BucketLoss* compare,
                       const std::string& compare_name) {
  if (compare) check_same_counts(model, *compare);
  LossReport report;
  report.model_name = model_name;
  report.compare_name = compare ? compare_name : "";
  report.bucket_size = model.bucket_size();
  report.windows = model.windows();
  for (int64_t b = 0; b < model.num_buckets(); ++b) {
    // With B = 1 bucket 0 holds only position 0, which has no prediction.
    if (model.count(b) == 0) continue;
    ReportRow row;
    row.start = model.bucket_start(b);
    row.end = model.bucket_end(b);
    row.label = range_label(row.start, row.end);
    row.tokens = model.count(b);
    row.loss = model.mean(b);
    if (compare) row.compare_loss = compare->mean(b);
    report.buckets.push_back(row);
  }
  report.overall.label = "all";
  report.overall.start = 0;
  report.overall.end = model.max_window_length();
  report.overall.tokens = model.total_count();
  report.overall.loss = model.overall_mean();
  if (compare) report.overall.compare_loss = compare->overall_mean();
  return report;
}

std::string format_table(const LossReport& report) {
  std::vector<Column> columns = {{"bucket", 0}, {"tokens", 0}, {"nats", 0}, {"bits", 0}};
  std::ostringstream out;
  if (report.has_compare()) {
    // Short column names A/B keep the table narrow; the legend says which model is which.
    columns = {{"bucket", 0}, {"tokens", 0}, {"A nats", 0},      {"A bits", 0},
               {"B nats", 0}, {"B bits", 0}, {"improvement", 0}, {"improvement %", 0}};
    out << "A = " << report.model_name << " (--model)\n"
        << "B = " << report.compare_name << " (--compare)\n"
        << "improvement = B - A in nats per token and as % of B; positive: A has the lower loss\n";
  } else {
    out << "model: " << report.model_name << '\n';
  }
  std::vector<std::vector<std::string>> rows;
  for (const ReportRow& row : report.buckets) rows.push_back(table_cells(row));
  rows.push_back(table_cells(report.overall));
  for (Column& c : columns) c.width = static_cast<int>(c.header.size());
  for (const auto& cells : rows) {
    for (size_t i = 0; i < cells.size(); ++i) {
      columns[i].width = std::max(columns[i].width, static_cast<int>(cells[i].size()));
    }
  }
  auto emit = [&](const std::vector<std::string>& cells) {
    std::string line;
    for (size_t i = 0; i < cells.size(); ++i) {
      // The bucket label reads best left-aligned, numbers right-aligned.
      line += i == 0 ? pad_right(cells[i], columns[i].width) : "  " + pad_left(cells[i], columns[i].width);
    }
    out << line << '\n';
  };
  std::vector<std::string> header;
  for (const Column& c : columns) header.push_back(c.header);
  emit(header);
  int total_width = 0;
  for (const Column& c : columns) total_width += c.width + 2;
  for (size_t r = 0; r < rows.size(); ++r) {
    if (r + 1 == rows.size()) out << std::string(total_width - 2, '-') << '\n';
    emit(rows[r]);
  }
  return out.str();
}

std::string format_csv(const LossReport& report) {
  std::ostringstream out;
  out << "bucket,start,end,tokens,loss_nats,bits_per_token";
  if (report.has_compare())
    out << ",compare_loss_nats,compare_bits_per_token,improvement_nats,improvement_percent";
  out << '\n';
  auto emit = [&](const std::string& bucket, const ReportRow& row) {
    out << bucket << ',' << row.start << ',' << row.end << ',' << row.tokens << ','
        << printf_string("%.10g", row.loss) << ',' << printf_string("%.10g", nats_to_bits(row.loss));
    if (row.compare_loss) {
      out << ',' << printf_string("%.10g", *row.compare_loss) << ','
          << printf_string("%.10g", nats_to_bits(*row.compare_loss)) << ','
          << printf_string("%.10g", row.improvement()) << ','
          << printf_string("%.10g", row.improvement_percent());
    }
    out << '\n';
  };
  for (const ReportRow& row : report.buckets) emit(std::to_string(row.start / report.bucket_size), row);
  emit("all", report.overall);
  return out.str();
}

LinePlot loss_plot(const LossReport& report, const std::string& title, const std::string& subtitle) {
  LinePlot plot;
  plot.title = title;
  plot.subtitle = subtitle;
  plot.x_label =
      "bucket start position in the window (tokens; buckets of " + std::to_string(report.bucket_size) + ")";
  plot.y_label = "mean next-token loss (nats)";
  PlotSeries model{
      report.has_compare() ? "A: " + report.model_name + " (--model)" : report.model_name, {}, {}};
  PlotSeries compare{"B: " + report.compare_name + " (--compare)", {}, {}};
  for (const ReportRow& row : report.buckets) {
    model.x.push_back(static_cast<double>(row.start));
    model.y.push_back(row.loss);
    if (row.compare_loss) {
      compare.x.push_back(static_cast<double>(row.start));
      compare.y.push_back(*row.compare_loss);
    }
  }
  plot.series.push_back(model);
  if (report.has_compare()) plot.series.push_back(compare);
  plot.x_include = {0.0, static_cast<double>(report.overall.end)};
  return plot;
}

void write_text_file(const std::string& path, const std::string& text) {
  const std::string temporary = path + ".tmp." + std::to_string(::getpid());
  {
    std::ofstream file(temporary, std::ios::binary | std::ios::trunc);
    check(file.good(), "cannot write '", temporary, "' (does the directory exist?)");
    file << text;
    file.close();
    check(!file.fail(), "failed writing '", temporary, "'");
  }
  std::error_code error;
  std::filesystem::rename(temporary, path, error);
  if (error) {
    std::filesystem::remove(temporary);
    fail("cannot rename '", temporary, "' to '", path, "': ", error.message());
  }
}

}  // namespace spindle
