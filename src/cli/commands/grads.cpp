#include <iostream>

#include "cli/args.h"
#include "cli/commands.h"
#include "core/log.h"
#include "io/safetensors.h"
#include "io/token_text.h"
#include "model/backward.h"
#include "model/checkpoint.h"

namespace spindle {

namespace {

template <class T>
void write_gradients(const std::string& dir, const std::vector<int32_t>& tokens, const std::string& out,
                     int64_t chunk) {
  Model model = load_model(dir, dtype_of<T>());
  ModelWeights grads = zero_gradients(model.config, dtype_of<T>());
  LossOptions options;
  options.chunk_tokens = chunk;
  const double loss = loss_and_gradients<T>(model.config, model.weights, tokens, grads, options).loss;
  NamedTensors named;
  for (Param& p : parameter_table(model.config, grads)) {
    if (p.role == ParamRole::RouterBias) continue;  // a buffer: no gradient
    named.emplace_back(p.name, p.tensor);
  }
  char text[40];
  std::snprintf(text, sizeof text, "%.17g", loss);
  write_safetensors(out, named,
                    {{"format", "pt"}, {"loss", text}, {"tokens", std::to_string(tokens.size())}});
  std::cout << "loss " << text << "\n";
  log_info("wrote ", named.size(), " gradient tensors to ", out);
}

}  // namespace

int run_grads(const std::vector<std::string>& argv) {
  const Args args("grads", argv, {"model", "tokens", "dtype", "out", "chunk"});
  const std::string dir = args.required("model");
  const std::vector<int32_t> tokens = read_token_text(args.required("tokens"));
  const std::string out = args.required("out");
  const DType dtype = parse_dtype(args.value_or("dtype", "f32"), "--dtype");
  check(dtype == DType::F32 || dtype == DType::F64, "--dtype must be f32 or f64 on the CPU, got ",
        dtype_name(dtype));
  const int64_t chunk = args.int_or("chunk", 0);
  check(chunk >= 0, "--chunk must be a number of tokens >= 1 (or 0: the whole sequence), got ", chunk);
  if (dtype == DType::F64)
    write_gradients<double>(dir, tokens, out, chunk);
  else
    write_gradients<float>(dir, tokens, out, chunk);
  return 0;
}

}  // namespace spindle
