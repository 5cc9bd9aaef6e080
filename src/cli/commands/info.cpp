#include <iostream>
#include <map>

#include "cli/args.h"
#include "cli/commands.h"
#include "model/checkpoint.h"

namespace spindle {

namespace {

std::string human_bytes(double bytes) {
  const char* units[] = {"B", "KiB", "MiB", "GiB", "TiB"};
  int u = 0;
  while (bytes >= 1024 && u < 4) {
    bytes /= 1024;
    ++u;
  }
  char text[32];
  std::snprintf(text, sizeof text, "%.2f %s", bytes, units[u]);
  return text;
}

}  // namespace

int run_info(const std::vector<std::string>& argv) {
  const Args args("info", argv, {"model"});
  const std::string dir = args.required("model");
  const ModelConfig config = load_model_config(dir);
  check_supported(config);
  // Shapes only: no memory is taken and nothing is read from the safetensors.
  ModelWeights weights = allocate_weights(config, DType::BF16, /*shapes_only=*/true);
  const std::vector<Param> table = parameter_table(config, weights);

  int64_t total = 0, buffers = 0, routed = 0;
  for (const Param& p : table) {
    if (p.role == ParamRole::RouterBias)
      buffers += p.tensor.numel();
    else
      total += p.tensor.numel();
    if (p.name.find(".mlp.experts.") != std::string::npos) routed += p.tensor.numel();
  }
  int64_t moe_layers = 0;
  for (MlpKind k : config.mlp_layer_types) moe_layers += k == MlpKind::Sparse;
  const int64_t per_expert = 3 * config.hidden_size * config.moe_intermediate_size;
  const int64_t active = total - routed + moe_layers * config.num_experts_per_tok * per_expert;

  std::cout << "model " << dir << " (" << config.source << ")\n";
  std::cout << "layers " << config.num_hidden_layers << ", hidden " << config.hidden_size << ", vocab "
            << config.vocab_size << ", mHC streams " << config.hc_mult << "\n";
  std::cout << "layer  attention  indexer  feed-forward\n";
  for (int64_t i = 0; i < config.num_hidden_layers; ++i) {
    const auto u = static_cast<size_t>(i);
    const bool dsa = config.layer_types[u] == AttentionKind::Dsa;
    std::printf("%5lld  %-9s  %-7s  %s\n", static_cast<long long>(i), dsa ? "DSA" : "KDA",
                dsa ? indexer_kind_name(config.indexer_types[u]) : "-",
                config.mlp_layer_types[u] == MlpKind::Dense ? "dense" : "MoE");
  }
  std::cout << "parameters: " << total << " total, " << active << " active per token ("
            << config.num_experts_per_tok << " of " << config.n_routed_experts << " routed experts), "
            << buffers << " buffer values\n";
  std::cout << "bytes: " << human_bytes(2.0 * static_cast<double>(total)) << " in bf16, "
            << human_bytes(4.0 * static_cast<double>(total)) << " in f32\n";
  return 0;
}

}  // namespace spindle
