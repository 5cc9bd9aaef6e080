#include <cstdio>
#include <fstream>
#include <iostream>

#include "cli/args.h"
#include "cli/commands.h"
#include "core/allocator.h"
#include "core/log.h"
#include "io/token_text.h"
#include "model/checkpoint.h"
#include "model/forward.h"

namespace spindle {

namespace {

template <class T>
std::vector<T> compute(const std::string& dir, const std::vector<int32_t>& tokens) {
  Model model = load_model(dir, dtype_of<T>());
  check(static_cast<int64_t>(tokens.size()) >= 2, "need at least 2 tokens, got ", tokens.size());
  for (size_t i = 0; i < tokens.size(); ++i) {
    check(tokens[i] < model.config.vocab_size, "token id ", tokens[i], " at position ", i,
          " is outside the vocabulary of ", model.config.vocab_size);
  }
  ForwardOptions options;
  const bool long_run = tokens.size() >= 16384;
  options.on_layer = [&](int64_t layer) {
    if (long_run) log_info("layer ", layer + 1, "/", model.config.num_hidden_layers, " done");
  };
  return sequence_log_probs<T>(model.config, model.weights, tokens, options);
}

}  // namespace

int run_logprobs(const std::vector<std::string>& argv) {
  const Args args("logprobs", argv, {"model", "tokens", "dtype", "out"});
  const std::string dir = args.required("model");
  const std::vector<int32_t> tokens = read_token_text(args.required("tokens"));
  const DType dtype = parse_dtype(args.value_or("dtype", "f32"), "--dtype");
  check(dtype == DType::F32 || dtype == DType::F64, "--dtype must be f32 or f64 on the CPU, got ",
        dtype_name(dtype));

  std::vector<double> values;
  if (dtype == DType::F64) {
    for (double v : compute<double>(dir, tokens)) values.push_back(v);
  } else {
    for (float v : compute<float>(dir, tokens)) values.push_back(v);
  }

  const auto out_path = args.optional("out");
  std::ofstream file;
  if (out_path) {
    file.open(*out_path);
    check(file.good(), "cannot write --out file '", *out_path, "'");
  }
  std::ostream& out = out_path ? static_cast<std::ostream&>(file) : std::cout;
  char text[40];
  for (double v : values) {
    std::snprintf(text, sizeof text, dtype == DType::F64 ? "%.17g" : "%.9g", v);
    out << text << '\n';
  }
  check(out.good(), "failed writing log-probs");
  log_info("peak RSS ", peak_rss_bytes() / (1024 * 1024), " MiB for ", tokens.size(), " tokens");
  return 0;
}

}  // namespace spindle
