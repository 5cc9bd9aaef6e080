#include <cstdio>
#include <fstream>
#include <iostream>

#include "backend/device_model.h"
#include "cli/args.h"
#include "cli/commands.h"
#include "cli/commands/layer_progress.h"
#include "core/allocator.h"
#include "core/log.h"
#include "io/token_text.h"
#include "model/checkpoint.h"
#include "model/forward.h"

namespace spindle {

namespace {

template <class T>
std::vector<T> compute(const std::string& dir, const std::vector<int32_t>& tokens, int64_t chunk) {
  Model model = load_model(dir, dtype_of<T>());
  check(static_cast<int64_t>(tokens.size()) >= 2, "need at least 2 tokens, got ", tokens.size());
  for (size_t i = 0; i < tokens.size(); ++i) {
    check(tokens[i] < model.config.vocab_size, "token id ", tokens[i], " at position ", i,
          " is outside the vocabulary of ", model.config.vocab_size);
  }
  ForwardOptions options;
  options.chunk_tokens = chunk;
  options.on_layer = layer_progress(model.config, tokens.size());
  return sequence_log_probs<T>(model.config, model.weights, tokens, options);
}

// On the GPU: the checkpoint is read in f32 and uploaded (bf16 matrices, fp32 small parameters).
std::vector<float> compute_on_device(const std::string& dir, const std::vector<int32_t>& tokens,
                                     bool strict_kernels, bool absorbed_mla, int64_t chunk) {
  const Model model = load_model(dir, DType::F32);
  auto device =
      open_device_model(Device::CUDA, model.config, model.weights, {strict_kernels, absorbed_mla, chunk});
  std::vector<float> values = device->log_probs(tokens);
  log_info("kernels on ", device->device_name(), ":\n", device->kernel_report());
  log_info("device memory peak ", device->memory().peak_total / (1024 * 1024), " MiB");
  return values;
}

}  // namespace

int run_logprobs(const std::vector<std::string>& argv) {
  const Args args("logprobs", argv, {"model", "tokens", "dtype", "out", "device", "chunk", "mla"},
                  {"strict-kernels"});
  const std::string dir = args.required("model");
  const std::vector<int32_t> tokens = read_token_text(args.required("tokens"));
  const Device device = parse_device(args.value_or("device", "cpu"), "--device");
  const DType dtype = parse_dtype(args.value_or("dtype", device == Device::CUDA ? "bf16" : "f32"), "--dtype");
  if (device == Device::CUDA)
    check(dtype == DType::BF16, "--device cuda computes in bf16 (fp32 accumulation); --dtype ",
          dtype_name(dtype), " is for the CPU");
  else
    check(dtype == DType::F32 || dtype == DType::F64, "--dtype must be f32 or f64 on the CPU, got ",
          dtype_name(dtype));
  check(device == Device::CUDA || !args.flag("strict-kernels"), "--strict-kernels applies to --device cuda");
  const int64_t chunk = args.int_or("chunk", 0);
  check(chunk >= 0, "--chunk must be a number of tokens >= 1 (or 0: the whole sequence), got ", chunk);
  const std::string mla = args.value_or("mla", "expanded");
  check(mla == "absorbed" || mla == "expanded", "--mla must be absorbed or expanded, got '", mla, "'");
  check(device == Device::CUDA || !args.optional("mla"), "--mla applies to --device cuda");

  std::vector<double> values;
  if (device == Device::CUDA) {
    for (float v : compute_on_device(dir, tokens, args.flag("strict-kernels"), mla == "absorbed", chunk))
      values.push_back(v);
  } else if (dtype == DType::F64) {
    for (double v : compute<double>(dir, tokens, chunk)) values.push_back(v);
  } else {
    for (float v : compute<float>(dir, tokens, chunk)) values.push_back(v);
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
