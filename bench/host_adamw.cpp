// The host AdamW's update (train/adamw.h on bf16 weights and fp32 gradients, as
// backend/cuda/host_optimizer.h runs it) on a 209 M-parameter GLM-5.3-Flash-shaped model: seconds
// to build its state, per step, and bytes per second at the planner's 28 bytes per parameter
// (plan/cost_model.h). No GPU: the host side alone, on every core of this machine.
//     build/bench_host_adamw [steps]
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <nlohmann/json.hpp>
#include <vector>

#include "core/parallel.h"
#include "model/config.h"
#include "model/weights.h"
#include "train/adamw.h"

int main(int argc, char** argv) {
  using namespace spindle;
  const int steps = argc > 1 ? std::max(1, std::atoi(argv[1])) : 5;
  const ModelConfig config = parse_model_config(nlohmann::json::parse(R"({
    "model_type": "glm5_next_text", "vocab_size": 154880, "hidden_size": 512, "intermediate_size": 1536,
    "moe_intermediate_size": 256, "num_hidden_layers": 8, "num_attention_heads": 8, "num_key_value_heads": 8,
    "n_routed_experts": 16, "num_experts_per_tok": 4, "kv_lora_rank": 128, "q_lora_rank": 256,
    "qk_nope_head_dim": 64, "v_head_dim": 64, "index_head_dim": 64, "index_n_heads": 8, "index_topk": 256,
    "index_kpool": 16, "linear_head_dim": 64, "linear_num_heads": 8, "pad_token_id": 0})"),
                                                "bench_host_adamw");
  ModelWeights weights = allocate_weights(config, DType::BF16);
  ModelWeights grads = allocate_weights(config, DType::F32);
  int64_t parameters = 0;
  for (Param& g : parameter_table(config, grads)) {
    float* d = g.tensor.data<float>();
    for (int64_t i = 0; i < g.tensor.numel(); ++i)
      d[i] = 1e-3f * static_cast<float>((i * 2654435761u) % 1000) - 0.5f;
    parameters += g.tensor.numel();
  }
  const auto built = std::chrono::steady_clock::now();
  AdamW adam(config, weights);  // fp32 masters from the weights, m and v zeroed: 12 B per parameter
  const double construction = std::chrono::duration<double>(std::chrono::steady_clock::now() - built).count();
  std::vector<double> seconds;
  adam.step(grads, 1e-3);  // warm-up: the first touch of the optimizer state
  for (int s = 0; s < steps; ++s) {
    const auto start = std::chrono::steady_clock::now();
    adam.step(grads, 1e-3);
    seconds.push_back(std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count());
  }
  std::sort(seconds.begin(), seconds.end());
  const double median = seconds[seconds.size() / 2];
  std::printf(
      "host AdamW: %lld parameters, %d threads: state built in %.3f s; median of %d steps %.3f s, %.2f GB/s "
      "at "
      "28 B/parameter\n",
      static_cast<long long>(parameters), worker_count(), construction, steps, median,
      28.0 * static_cast<double>(parameters) / median / 1e9);
}
