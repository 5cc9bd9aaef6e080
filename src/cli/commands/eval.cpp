// spindle eval: held-out next-token loss per position bucket, for one model or two on the same
// windows; a table on stdout, PREFIX.csv and PREFIX.svg.
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <iostream>
#include <memory>

#include "cli/args.h"
#include "cli/commands.h"
#include "core/error.h"
#include "core/log.h"
#include "data/sequence_range.h"
#include "data/sequence_source.h"
#include "data/window_sampler.h"
#include "eval/evaluate.h"
#include "eval/report.h"
#include "io/safetensors.h"
#include "model/checkpoint.h"
#include "model/config.h"

namespace spindle {

namespace {

std::vector<std::string> split_names(const std::string& list) {
  std::vector<std::string> names;
  size_t begin = 0;
  while (begin <= list.size()) {
    const size_t end = std::min(list.find(',', begin), list.size());
    const std::string name = list.substr(begin, end - begin);
    check(!name.empty(), "--chromosomes '", list, "' has an empty name (expected names separated by commas)");
    names.push_back(name);
    begin = end + 1;
  }
  return names;
}

double parse_fraction(const std::string& text) {
  size_t used = 0;
  double value = NAN;
  try {
    value = std::stod(text, &used);
  } catch (const std::exception&) {
    used = 0;
  }
  check(used == text.size() && !text.empty() && value >= 0.0 && value <= 1.0,
        "--max-n-fraction expects a number in [0, 1], got '", text, "'");
  return value;
}

std::string duration(double seconds) {
  char text[32];
  if (seconds < 120) {
    std::snprintf(text, sizeof text, "%.1f s", seconds);
  } else if (seconds < 7200) {
    std::snprintf(text, sizeof text, "%.1f min", seconds / 60);
  } else {
    std::snprintf(text, sizeof text, "%.1f h", seconds / 3600);
  }
  return text;
}

// Progress on stderr: every window, and every layer of a long window at most every 10 seconds.
BucketEvalOptions progress_options(int64_t bucket, const std::string& label, int64_t layers,
                                   int64_t windows_after) {
  using Clock = std::chrono::steady_clock;
  auto last = std::make_shared<Clock::time_point>(Clock::now());
  BucketEvalOptions options;
  options.bucket_size = bucket;
  options.on_layer = [=](int64_t window, int64_t layer) {
    if (Clock::now() - *last < std::chrono::seconds(10)) return;
    *last = Clock::now();
    log_info(label, "window ", window + 1, ": layer ", layer + 1, "/", layers);
  };
  options.on_window = [=](const WindowProgress& p) {
    *last = Clock::now();
    const double per_window = p.total_seconds / static_cast<double>(p.index + 1);
    const double left = per_window * static_cast<double>(p.count - p.index - 1 + windows_after);
    char rate[64];
    std::snprintf(rate, sizeof rate, "%.0f tokens/s, running loss %.4f nats",
                  p.tokens / std::max(p.seconds, 1e-9), p.running_loss);
    log_info(label, "window ", p.index + 1, "/", p.count, ": ", p.tokens, " tokens in ", duration(p.seconds),
             " (", rate, ")", left > 0 ? ", about " + duration(left) + " left" : std::string());
  };
  return options;
}

// The config and weight files of `dir`, checked before any long evaluation starts (a broken
// --compare model would otherwise fail only after the first model's whole run). Returns the
// vocabulary size.
int64_t check_model_dir(const std::string& dir) {
  const ModelConfig config = load_model_config(dir);
  check_supported(config);
  SafetensorsReader::open(dir);
  return config.vocab_size;
}

// Every token of every window must be in the vocabulary of each model (`vocabs`: name, size).
void check_window_tokens(const TokenSequences& data, const std::vector<Window>& windows, int64_t seq_len,
                         const std::vector<std::pair<std::string, int64_t>>& vocabs) {
  std::vector<int32_t> tokens(static_cast<size_t>(seq_len));
  for (size_t k = 0; k < windows.size(); ++k) {
    read_window(data, windows[k], seq_len, tokens.data());
    const int32_t largest = *std::max_element(tokens.begin(), tokens.end());
    for (const auto& [dir, vocab] : vocabs) {
      check(largest < vocab, "evaluation window ", k + 1, " (", data.name(windows[k].sequence), ":",
            windows[k].start, ") holds token id ", largest, ", outside the vocabulary of ", vocab,
            " of model ", dir);
    }
  }
}

template <class T>
BucketLoss evaluate_model(const std::string& dir, const std::string& label, const TokenSequences& data,
                          const std::vector<Window>& windows, int64_t seq_len, int64_t bucket,
                          int64_t windows_after) {
  const Model model = load_model(dir, dtype_of<T>());
  log_info(label, "model ", dir, ": ", model.config.num_hidden_layers, " layers, vocabulary ",
           model.config.vocab_size);
  const auto read = [&](int64_t k) {
    std::vector<int32_t> tokens(static_cast<size_t>(seq_len));
    read_window(data, windows[static_cast<size_t>(k)], seq_len, tokens.data());
    return tokens;
  };
  return evaluate_bucket_loss<T>(
      model, static_cast<int64_t>(windows.size()), read,
      progress_options(bucket, label, model.config.num_hidden_layers, windows_after));
}

}  // namespace

int run_eval(const std::vector<std::string>& argv) {
  const Args args("eval", argv,
                  {"model", "data", "seq-len", "bucket", "windows", "chromosomes", "max-n-fraction",
                   "compare", "out", "dtype", "holdout"});
  const std::string model_dir = args.required("model");
  const std::string data_path = args.required("data");
  args.required("seq-len");
  args.required("bucket");
  const int64_t seq_len = args.int_or("seq-len", 0);
  const int64_t bucket = args.int_or("bucket", 0);
  check(seq_len >= 2, "--seq-len must be at least 2 tokens, got ", seq_len);
  check(bucket >= 1, "--bucket must be at least 1 token, got ", bucket);
  const int64_t count = args.int_or("windows", 8);
  check(count >= 1, "--windows must be at least 1, got ", count);
  const double max_n_fraction = parse_fraction(args.value_or("max-n-fraction", "0.01"));
  const auto compare_dir = args.optional("compare");
  const std::string prefix = args.value_or("out", "eval");
  const DType dtype = parse_dtype(args.value_or("dtype", "f32"), "--dtype");
  check(dtype == DType::F32 || dtype == DType::F64, "--dtype must be f32 or f64 on the CPU, got ",
        dtype_name(dtype));
  const std::filesystem::path out_dir = std::filesystem::path(prefix).parent_path();
  check(out_dir.empty() || std::filesystem::is_directory(out_dir), "--out ", prefix, ": directory ",
        out_dir.string(), " does not exist");

  std::vector<std::pair<std::string, int64_t>> vocabs = {{model_dir, check_model_dir(model_dir)}};
  if (compare_dir) vocabs.emplace_back(*compare_dir, check_model_dir(*compare_dir));

  SequenceOptions data_options;
  if (auto names = args.optional("chromosomes")) data_options.names = split_names(*names);
  const std::unique_ptr<TokenSequences> file = open_sequences(data_path, data_options);
  // --holdout F: only the last F of each sequence, the part `spindle train` held out with data.holdout.
  const double holdout = parse_fraction(args.value_or("holdout", "1"));
  check(holdout > 0, "--holdout must be in (0, 1], got ", holdout);
  const std::unique_ptr<TokenSequences> held_out =
      holdout < 1 ? sequence_range(*file, 1 - holdout, 1) : nullptr;
  const TokenSequences* data = held_out ? held_out.get() : file.get();
  const std::vector<Window> windows = evaluation_windows(*data, seq_len, count, max_n_fraction);
  const auto n = static_cast<int64_t>(windows.size());
  for (int64_t k = 0; k < n; ++k) {
    const Window& w = windows[static_cast<size_t>(k)];
    log_info("window ", k + 1, "/", n, ": ", data->name(w.sequence), ":", w.start, "-", w.start + seq_len);
  }
  check_window_tokens(*data, windows, seq_len, vocabs);

  const std::string label_a = compare_dir ? "A: " : "";
  const std::string label_b = "B: ";
  const int64_t after_a = compare_dir ? n : 0;
  BucketLoss loss_a(bucket), loss_b(bucket);
  if (dtype == DType::F64) {
    loss_a = evaluate_model<double>(model_dir, label_a, *data, windows, seq_len, bucket, after_a);
    if (compare_dir)
      loss_b = evaluate_model<double>(*compare_dir, label_b, *data, windows, seq_len, bucket, 0);
  } else {
    loss_a = evaluate_model<float>(model_dir, label_a, *data, windows, seq_len, bucket, after_a);
    if (compare_dir)
      loss_b = evaluate_model<float>(*compare_dir, label_b, *data, windows, seq_len, bucket, 0);
  }

  const LossReport report =
      make_report(loss_a, model_dir, compare_dir ? &loss_b : nullptr, compare_dir.value_or(""));
  std::string where = std::filesystem::path(data_path).filename().string();
  if (!data_options.names.empty()) where += " (" + args.value_or("chromosomes", "") + ")";
  if (held_out) where += ", last " + args.value_or("holdout", "") + " of each sequence";
  std::cout << "held-out next-token loss by position: " << where << ", " << n << " windows of " << seq_len
            << " tokens, buckets of " << bucket << ", " << dtype_name(dtype) << "\n"
            << format_table(report);
  std::cout.flush();

  write_text_file(prefix + ".csv", format_csv(report));
  const std::string title = "Held-out loss by position: " + where + ", seq-len " + std::to_string(seq_len);
  const std::string subtitle = std::to_string(n) + " windows, buckets of " + std::to_string(bucket) +
                               " tokens, " + std::to_string(report.overall.tokens) + " tokens scored, " +
                               dtype_name(dtype);
  write_text_file(prefix + ".svg", render_svg(loss_plot(report, title, subtitle)));
  log_info("wrote ", prefix, ".csv and ", prefix, ".svg");
  return 0;
}

}  // namespace spindle
