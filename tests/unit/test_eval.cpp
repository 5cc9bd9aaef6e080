// spindle eval: per-position-bucket loss, its report (table, CSV, comparison), the SVG plot, and
// an end-to-end evaluation of a tiny model on a small FASTA file.
#include <gtest/gtest.h>
#include <unistd.h>

#include <cmath>
#include <filesystem>
#include <fstream>
#include <numbers>
#include <regex>
#include <sstream>
#include <string>
#include <vector>

#include "core/error.h"
#include "core/random.h"
#include "data/sequence_source.h"
#include "data/window_sampler.h"
#include "eval/bucket_loss.h"
#include "eval/evaluate.h"
#include "eval/report.h"
#include "eval/svg_plot.h"
#include "model/checkpoint.h"
#include "model/forward.h"
#include "model/init.h"

namespace spindle {
namespace {

// log_probs[j] belongs to position j + 1; these give loss = position, easy to sum by hand.
std::vector<double> losses_equal_to_position(int64_t length) {
  std::vector<double> lp;
  for (int64_t i = 1; i < length; ++i) lp.push_back(-static_cast<double>(i));
  return lp;
}

TEST(BucketLoss, PartialLastBucket) {
  // L = 10, B = 4: [0,4) holds positions 1..3, [4,8) 4..7, [8,10) 8..9.
  BucketLoss loss(4);
  loss.add_window(losses_equal_to_position(10));
  ASSERT_EQ(loss.num_buckets(), 3);
  EXPECT_EQ(loss.count(0), 3);
  EXPECT_EQ(loss.count(1), 4);
  EXPECT_EQ(loss.count(2), 2);
  EXPECT_DOUBLE_EQ(loss.sum(0), 1 + 2 + 3);
  EXPECT_DOUBLE_EQ(loss.sum(1), 4 + 5 + 6 + 7);
  EXPECT_DOUBLE_EQ(loss.sum(2), 8 + 9);
  EXPECT_DOUBLE_EQ(loss.mean(0), 2.0);
  EXPECT_DOUBLE_EQ(loss.mean(1), 5.5);
  EXPECT_DOUBLE_EQ(loss.mean(2), 8.5);
  EXPECT_EQ(loss.bucket_start(2), 8);
  EXPECT_EQ(loss.bucket_end(2), 10);
  EXPECT_EQ(loss.total_count(), 9);
  EXPECT_DOUBLE_EQ(loss.overall_mean(), 45.0 / 9.0);
}

TEST(BucketLoss, BucketLargerThanWindow) {
  BucketLoss loss(100);
  loss.add_window(losses_equal_to_position(5));
  ASSERT_EQ(loss.num_buckets(), 1);
  EXPECT_EQ(loss.count(0), 4);
  EXPECT_EQ(loss.bucket_end(0), 5);
  EXPECT_DOUBLE_EQ(loss.mean(0), 2.5);
  EXPECT_DOUBLE_EQ(loss.overall_mean(), 2.5);
}

TEST(BucketLoss, WindowsAccumulateAndMerge) {
  const std::vector<float> a = {-1.0f, -2.0f, -3.0f};            // window of 4, positions 1..3
  const std::vector<double> b = {-0.5, -0.5, -0.5, -0.5, -0.5};  // window of 6, positions 1..5
  BucketLoss one(2);
  one.add_window(a);
  one.add_window(b);
  // Buckets of 2: [0,2) {1: 1, 0.5}, [2,4) {2,3: 2+3, 0.5+0.5}, [4,6) {4,5: 0.5+0.5}.
  ASSERT_EQ(one.num_buckets(), 3);
  EXPECT_DOUBLE_EQ(one.mean(0), 0.75);
  EXPECT_DOUBLE_EQ(one.mean(1), 6.0 / 4.0);
  EXPECT_DOUBLE_EQ(one.mean(2), 0.5);
  EXPECT_EQ(one.windows(), 2);

  BucketLoss left(2), right(2);
  left.add_window(a);
  right.add_window(b);
  left.merge(right);
  ASSERT_EQ(left.num_buckets(), one.num_buckets());
  for (int64_t k = 0; k < one.num_buckets(); ++k) {
    EXPECT_EQ(left.count(k), one.count(k));
    EXPECT_DOUBLE_EQ(left.sum(k), one.sum(k));
  }
  EXPECT_EQ(left.windows(), 2);
  EXPECT_EQ(left.max_window_length(), 6);

  BucketLoss other(3);
  EXPECT_THROW(left.merge(other), Error);
}

TEST(BucketLoss, RejectsBadInput) {
  EXPECT_THROW(BucketLoss(0), Error);
  BucketLoss loss(4);
  EXPECT_THROW(loss.add_window(std::vector<double>{-1.0, NAN}), Error);
  EXPECT_THROW(loss.add_window(std::vector<double>{0.5}), Error);  // a probability above 1
  EXPECT_THROW(loss.overall_mean(), Error);                        // nothing was added
  EXPECT_EQ(loss.windows(), 0);
}

TEST(Report, SingleModelTableAndCsv) {
  BucketLoss loss(4);
  loss.add_window(losses_equal_to_position(10));
  const LossReport report = make_report(loss, "runs/tiny");
  ASSERT_EQ(report.buckets.size(), 3u);
  EXPECT_EQ(report.buckets[2].label, "[8, 10)");
  EXPECT_EQ(report.overall.tokens, 9);
  EXPECT_FALSE(report.has_compare());

  const std::string table = format_table(report);
  EXPECT_NE(table.find("model: runs/tiny"), std::string::npos) << table;
  EXPECT_NE(table.find("[4, 8)"), std::string::npos) << table;
  EXPECT_NE(table.find("5.500000"), std::string::npos) << table;
  // bits = nats / ln 2: 5.5 nats = 7.934823 bits.
  EXPECT_NE(table.find("7.934823"), std::string::npos) << table;
  EXPECT_NE(table.find("all"), std::string::npos) << table;

  const std::string csv = format_csv(report);
  EXPECT_EQ(csv,
            "bucket,start,end,tokens,loss_nats,bits_per_token\n"
            "0,0,4,3,2,2.885390082\n"
            "1,4,8,4,5.5,7.934822725\n"
            "2,8,10,2,8.5,12.26290785\n"
            "all,0,10,9,5,7.213475204\n");
}

TEST(Report, ComparisonNumbers) {
  // Model A: loss 2 then 1; model B (the --compare one): 2.5 then 1 on the same windows.
  BucketLoss a(2), b(2);
  a.add_window(std::vector<double>{-2.0, -1.0, -1.0});
  b.add_window(std::vector<double>{-2.5, -1.0, -1.0});
  const LossReport report = make_report(a, "ft", &b, "base");
  ASSERT_TRUE(report.has_compare());
  ASSERT_EQ(report.buckets.size(), 2u);
  EXPECT_DOUBLE_EQ(report.buckets[0].loss, 2.0);
  EXPECT_DOUBLE_EQ(*report.buckets[0].compare_loss, 2.5);
  EXPECT_DOUBLE_EQ(report.buckets[0].improvement(), 0.5);
  EXPECT_DOUBLE_EQ(report.buckets[0].improvement_percent(), 20.0);
  EXPECT_DOUBLE_EQ(report.buckets[1].improvement(), 0.0);
  EXPECT_DOUBLE_EQ(report.overall.loss, 4.0 / 3.0);
  EXPECT_DOUBLE_EQ(*report.overall.compare_loss, 4.5 / 3.0);
  EXPECT_DOUBLE_EQ(report.overall.improvement(), 0.5 / 3.0);
  EXPECT_NEAR(report.overall.improvement_percent(), 100.0 * 0.5 / 4.5, 1e-12);

  const std::string table = format_table(report);
  EXPECT_NE(table.find("A = ft (--model)"), std::string::npos) << table;
  EXPECT_NE(table.find("B = base (--compare)"), std::string::npos) << table;
  EXPECT_NE(table.find("+0.500000"), std::string::npos) << table;
  EXPECT_NE(table.find("+20.000%"), std::string::npos) << table;
  EXPECT_NE(table.find("+11.111%"), std::string::npos) << table;

  const std::string csv = format_csv(report);
  std::istringstream lines(csv);
  std::string header, first;
  std::getline(lines, header);
  std::getline(lines, first);
  EXPECT_EQ(header,
            "bucket,start,end,tokens,loss_nats,bits_per_token,compare_loss_nats,compare_bits_per_token,"
            "improvement_nats,improvement_percent");
  EXPECT_EQ(first, "0,0,2,1,2,2.885390082,2.5,3.606737602,0.5,20");

  // Different windows cannot be compared.
  BucketLoss c(2);
  c.add_window(std::vector<double>{-1.0, -1.0});
  EXPECT_THROW(make_report(a, "ft", &c, "other"), Error);
}

TEST(Report, BucketOfOneSkipsPositionZero) {
  BucketLoss loss(1);
  loss.add_window(losses_equal_to_position(3));
  const LossReport report = make_report(loss, "m");
  ASSERT_EQ(report.buckets.size(), 2u);
  EXPECT_EQ(report.buckets[0].label, "[1, 2)");
}

// --- SVG ---------------------------------------------------------------------------------------

// Checks that every tag is closed in order (XML-ish well-formedness) and returns the tag names in
// document order.
std::vector<std::string> check_balanced(const std::string& svg) {
  std::vector<std::string> stack, names;
  size_t i = 0;
  while ((i = svg.find('<', i)) != std::string::npos) {
    const size_t end = svg.find('>', i);
    EXPECT_NE(end, std::string::npos) << "unterminated tag at " << i;
    if (end == std::string::npos) break;
    std::string tag = svg.substr(i + 1, end - i - 1);
    i = end + 1;
    if (tag.starts_with("?") || tag.starts_with("!")) continue;
    const bool closing = tag.starts_with("/");
    const bool self_closing = tag.ends_with("/");
    const std::string name =
        tag.substr(closing ? 1 : 0, tag.find_first_of(" /", closing ? 1 : 0) - (closing ? 1 : 0));
    if (closing) {
      EXPECT_FALSE(stack.empty()) << "closing </" << name << "> without an opening tag";
      if (stack.empty()) break;
      EXPECT_EQ(stack.back(), name);
      stack.pop_back();
    } else {
      names.push_back(name);
      if (!self_closing) stack.push_back(name);
    }
    // Attribute quotes must pair up.
    EXPECT_EQ(std::count(tag.begin(), tag.end(), '"') % 2, 0) << tag;
  }
  EXPECT_TRUE(stack.empty()) << "unclosed <" << (stack.empty() ? "" : stack.back()) << ">";
  return names;
}

// Every number in an attribute value parses as a finite double.
void check_numbers_finite(const std::string& svg) {
  EXPECT_EQ(svg.find("nan"), std::string::npos);
  EXPECT_EQ(svg.find("inf"), std::string::npos);
  static const std::regex attr(R"re(\s(x|y|x1|y1|x2|y2|cx|cy|r|width|height)="([^"]*)")re");
  int checked = 0;
  for (auto it = std::sregex_iterator(svg.begin(), svg.end(), attr); it != std::sregex_iterator(); ++it) {
    const double v = std::stod((*it)[2].str());
    EXPECT_TRUE(std::isfinite(v)) << (*it)[0].str();
    ++checked;
  }
  EXPECT_GT(checked, 10);
  static const std::regex points(R"re(points="([^"]*)")re");
  for (auto it = std::sregex_iterator(svg.begin(), svg.end(), points); it != std::sregex_iterator(); ++it) {
    std::string list = (*it)[1].str();
    std::replace(list.begin(), list.end(), ',', ' ');
    std::istringstream in(list);
    double v;
    while (in >> v) EXPECT_TRUE(std::isfinite(v));
  }
}

int count_of(const std::vector<std::string>& names, const std::string& name) {
  return static_cast<int>(std::count(names.begin(), names.end(), name));
}

TEST(SvgPlot, TwoSeriesWellFormed) {
  LinePlot plot;
  plot.title = "held-out loss by position <chr22 & co>";
  plot.subtitle = "2 windows";
  plot.x_label = "bucket start (tokens)";
  plot.y_label = "loss (nats/token)";
  plot.series = {{"A", {0, 32768, 65536, 98304}, {1.40, 1.31, 1.29, 1.28}},
                 {"B", {0, 32768, 65536, 98304}, {1.41, 1.36, 1.35, 1.35}}};
  plot.x_include = {0, 131072};
  const std::string svg = render_svg(plot);
  const auto names = check_balanced(svg);
  EXPECT_EQ(count_of(names, "svg"), 1);
  EXPECT_EQ(count_of(names, "polyline"), 2);
  check_numbers_finite(svg);
  EXPECT_NE(svg.find("&lt;chr22 &amp; co&gt;"), std::string::npos);
  EXPECT_NE(svg.find(">A<"), std::string::npos);  // legend
  EXPECT_NE(svg.find(">B<"), std::string::npos);
  // The x axis spans exactly [0, 131072] with ticks 0, 20k, ..., 120k inside.
  EXPECT_NE(svg.find(">0<"), std::string::npos);
  EXPECT_NE(svg.find(">120k<"), std::string::npos);
  EXPECT_EQ(svg.find(">140k<"), std::string::npos);
  EXPECT_NE(svg.find("stroke-dasharray"), std::string::npos);  // the second series is dashed
}

TEST(SvgPlot, SingleBucketAndEqualValues) {
  LinePlot one;
  one.title = "one";
  one.series = {{"only", {0}, {1.5}}};
  const std::string svg = render_svg(one);
  const auto names = check_balanced(svg);
  EXPECT_EQ(count_of(names, "polyline"), 1);
  EXPECT_GE(count_of(names, "circle"), 2);  // the point's marker and the legend's
  check_numbers_finite(svg);

  LinePlot flat;
  flat.title = "flat";
  flat.series = {{"a", {0, 10, 20}, {2.0, 2.0, 2.0}}, {"b", {0, 10, 20}, {2.0, 2.0, 2.0}}};
  const std::string flat_svg = render_svg(flat);
  EXPECT_EQ(count_of(check_balanced(flat_svg), "polyline"), 2);
  check_numbers_finite(flat_svg);

  LinePlot zero;
  zero.series = {{"z", {5}, {0.0}}};
  check_numbers_finite(render_svg(zero));
}

TEST(SvgPlot, NonFinitePointsAreLeftOut) {
  LinePlot plot;
  plot.series = {{"a", {0, 1, 2}, {1.0, INFINITY, 2.0}}};
  const std::string svg = render_svg(plot);
  EXPECT_EQ(count_of(check_balanced(svg), "polyline"), 1);
  check_numbers_finite(svg);

  LinePlot none;
  none.series = {{"a", {0}, {NAN}}};
  EXPECT_THROW(render_svg(none), Error);
}

TEST(SvgPlot, NiceTicks) {
  AxisTicks t = nice_ticks(1.27, 1.41, 6);
  EXPECT_NEAR(t.step, 0.02, 1e-12);
  EXPECT_NEAR(t.lo, 1.26, 1e-12);
  EXPECT_NEAR(t.hi, 1.42, 1e-12);
  EXPECT_EQ(t.values.size(), 9u);
  EXPECT_EQ(format_tick(t.values[1], t.step, 1.42), "1.28");

  t = nice_ticks(0, 524288, 7);
  EXPECT_DOUBLE_EQ(t.step, 100000);
  EXPECT_DOUBLE_EQ(t.hi, 600000);
  EXPECT_EQ(format_tick(300000, t.step, t.hi), "300k");
  EXPECT_EQ(format_tick(2500000, 500000, 3e6), "2.5M");

  t = nice_ticks(0, 524288, 7, /*round_out=*/false);  // a position axis keeps its range
  EXPECT_DOUBLE_EQ(t.hi, 524288);
  EXPECT_DOUBLE_EQ(t.values.back(), 500000);
  t = nice_ticks(0, 4, 7, false, /*min_step=*/1.0);  // whole token positions only
  EXPECT_DOUBLE_EQ(t.step, 1.0);
  EXPECT_EQ(t.values.size(), 5u);

  t = nice_ticks(3.0, 3.0, 6);  // an empty range is widened around its value
  EXPECT_LT(t.lo, 3.0);
  EXPECT_GT(t.hi, 3.0);
  EXPECT_GE(t.values.size(), 3u);
  t = nice_ticks(0.0, 0.0, 6);
  EXPECT_LT(t.lo, 0.0);
  EXPECT_GT(t.hi, 0.0);
}

// --- end to end --------------------------------------------------------------------------------

// The mean loss of the "all" row, read back from the table text.
double table_overall_mean(const std::string& table) {
  std::istringstream lines(table);
  std::string line;
  while (std::getline(lines, line)) {
    if (!line.starts_with("all")) continue;
    std::istringstream cells(line);
    std::string label;
    int64_t tokens = 0;
    double nats = NAN;
    cells >> label >> tokens >> nats;
    return nats;
  }
  ADD_FAILURE() << "no 'all' row in\n" << table;
  return NAN;
}

TEST(EvalEndToEnd, TableMeanMatchesDirectLogProbs) {
  namespace fs = std::filesystem;
  const fs::path dir = fs::temp_directory_path() / ("spindle_eval_" + std::to_string(::getpid()));
  fs::remove_all(dir);
  fs::create_directories(dir);

  // A tiny model (vocabulary 16 holds the 9 nucleotide tokens) in f64.
  ModelConfig config = load_model_config(std::string(SPINDLE_TEST_DATA) + "/configs/tiny.json");
  ModelWeights weights = allocate_weights(config, DType::F64);
  init_weights(config, weights, 7);
  save_model((dir / "model").string(), config, weights, DType::F64);
  const Model model = load_model((dir / "model").string(), DType::F64);

  // Two chromosomes of random bases, one with an N run that the N policy must skip.
  Random rng(11);
  const char bases[] = "ACGT";
  std::ofstream fasta(dir / "small.fa");
  fasta << ">chrA\n";
  for (int i = 0; i < 200; ++i) fasta << bases[rng.next() % 4] << ((i + 1) % 60 == 0 ? "\n" : "");
  fasta << "\n>chrB\n";
  for (int i = 0; i < 150; ++i)
    fasta << (i < 40 ? 'N' : bases[rng.next() % 4]) << ((i + 1) % 60 == 0 ? "\n" : "");
  fasta << "\n";
  fasta.close();

  SequenceOptions options;
  options.names = {"chrA", "chrB"};
  const auto data = open_sequences((dir / "small.fa").string(), options);
  const int64_t length = 48, bucket = 20;
  const std::vector<Window> windows = evaluation_windows(*data, length, 2, 0.01);
  ASSERT_EQ(windows.size(), 2u);
  const auto read = [&](int64_t k) {
    std::vector<int32_t> tokens(length);
    read_window(*data, windows[k], length, tokens.data());
    return tokens;
  };

  BucketEvalOptions eval_options;
  eval_options.bucket_size = bucket;
  int64_t progress_calls = 0;
  eval_options.on_window = [&](const WindowProgress& p) {
    EXPECT_EQ(p.index, progress_calls++);
    EXPECT_EQ(p.count, 2);
    EXPECT_EQ(p.tokens, length);
  };
  const BucketLoss loss = evaluate_bucket_loss<double>(model, 2, read, eval_options);
  EXPECT_EQ(progress_calls, 2);

  // Directly: every -log p of both windows, and per bucket.
  double total = 0.0;
  std::vector<double> bucket_sum(3, 0.0);
  std::vector<int64_t> bucket_count(3, 0);
  for (int64_t k = 0; k < 2; ++k) {
    const std::vector<int32_t> tokens = read(k);
    for (int32_t t : tokens) EXPECT_NE(t, 8) << "window " << k << " holds an N";
    const std::vector<double> lp = sequence_log_probs<double>(model.config, model.weights, tokens);
    ASSERT_EQ(lp.size(), static_cast<size_t>(length - 1));
    for (size_t j = 0; j < lp.size(); ++j) {
      total -= lp[j];
      bucket_sum[(j + 1) / bucket] -= lp[j];
      bucket_count[(j + 1) / bucket] += 1;
    }
  }
  const double direct_mean = total / (2.0 * (length - 1));
  ASSERT_EQ(loss.num_buckets(), 3);  // [0,20) [20,40) [40,48)
  for (int64_t b = 0; b < 3; ++b) {
    EXPECT_EQ(loss.count(b), bucket_count[b]);
    EXPECT_NEAR(loss.mean(b), bucket_sum[b] / bucket_count[b], 1e-12);
  }
  EXPECT_EQ(loss.total_count(), 2 * (length - 1));
  EXPECT_NEAR(loss.overall_mean(), direct_mean, 1e-12);
  // A random tiny model is near uniform over 16 tokens: loss close to ln 16.
  EXPECT_NEAR(direct_mean, std::log(16.0), 0.5);

  const LossReport report = make_report(loss, "tiny");
  const std::string table = format_table(report);
  EXPECT_NEAR(table_overall_mean(table), direct_mean, 5e-7) << table;  // printed with 6 decimals
  const std::string svg = render_svg(loss_plot(report, "title", "subtitle"));
  EXPECT_EQ(count_of(check_balanced(svg), "polyline"), 1);
  fs::remove_all(dir);
}

}  // namespace
}  // namespace spindle
