#include "model/init.h"

#include <iostream>

#include "cli/args.h"
#include "cli/commands.h"
#include "core/log.h"
#include "model/checkpoint.h"

namespace spindle {

int run_init(const std::vector<std::string>& argv) {
  const Args args("init", argv, {"config", "out", "seed", "dtype"});
  const ModelConfig config = load_model_config(args.required("config"));
  check_supported(config);
  const std::string out = args.required("out");
  const DType dtype = parse_dtype(args.value_or("dtype", "f32"), "--dtype");
  check(is_floating(dtype), "--dtype must be a floating-point type, got ", dtype_name(dtype));
  const int64_t seed = args.int_or("seed", 0);
  ModelWeights weights = allocate_weights(config, DType::F32);
  init_weights(config, weights, static_cast<uint64_t>(seed));
  save_model(out, config, weights, dtype);
  log_info("initialised ", config.num_hidden_layers, "-layer model with seed ", seed, " in ", out);
  return 0;
}

}  // namespace spindle
