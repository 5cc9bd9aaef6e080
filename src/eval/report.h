// The per-bucket loss report of `spindle eval`: one model, or a model against a --compare model
// on the same windows, as an aligned text table and as CSV with the same columns.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "eval/bucket_loss.h"
#include "eval/svg_plot.h"

namespace spindle {

double nats_to_bits(double nats);

struct ReportRow {
  std::string label;  // "[start, end)" or "all"
  int64_t start = 0;
  int64_t end = 0;
  int64_t tokens = 0;
  double loss = 0.0;                   // nats per token, the --model
  std::optional<double> compare_loss;  // nats per token, the --compare model
  // compare_loss - loss: positive when the --model has the lower loss.
  double improvement() const;
  // improvement() as a percentage of compare_loss.
  double improvement_percent() const;
};

struct LossReport {
  std::string model_name;
  std::string compare_name;  // empty without a comparison
  int64_t bucket_size = 0;
  int64_t windows = 0;
  std::vector<ReportRow> buckets;  // buckets without tokens are left out
  ReportRow overall;               // token-weighted mean over every position
  bool has_compare() const { return overall.compare_loss.has_value(); }
};

// `compare`, when given, must have been evaluated on the same windows (same token counts).
LossReport make_report(const BucketLoss& model, const std::string& model_name,
                       const BucketLoss* compare = nullptr, const std::string& compare_name = "");

// Aligned columns: bucket, tokens, nats, bits (per model), then improvement and % with --compare.
std::string format_table(const LossReport& report);

// Header row then one row per bucket and a final "all" row; numbers unrounded (%.10g).
std::string format_csv(const LossReport& report);

// Loss (nats) against bucket start, one series per model; the x axis spans the whole window.
LinePlot loss_plot(const LossReport& report, const std::string& title, const std::string& subtitle);

// Writes `text` to `path` through a temporary file and a rename, so a failed run never leaves a
// half-written report.
void write_text_file(const std::string& path, const std::string& text);

}  // namespace spindle
