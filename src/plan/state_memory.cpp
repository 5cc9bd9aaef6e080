#include "plan/state_memory.h"

#include <algorithm>
#include <map>
#include <string>

#include "model/weights.h"
#include "plan/ledger.h"
#include "train/adamw.h"

namespace spindle::plan {

namespace {

constexpr int64_t kArenaAlign = 256;  // DeviceWeights aligns every tensor in its arena to 256 bytes

int64_t arena_aligned(int64_t bytes) { return (bytes + kArenaAlign - 1) / kArenaAlign * kArenaAlign; }

bool contains(const std::string& name, const char* part) { return name.find(part) != std::string::npos; }

// The expert index of a routed expert's parameter, or -1.
int64_t expert_index(const std::string& name) {
  const std::string key = ".mlp.experts.";
  const size_t at = name.find(key);
  return at == std::string::npos ? -1 : std::stoll(name.substr(at + key.size()));
}

// Parameters that tensor parallelism splits: attention projections (not the shared low-rank
// inputs q_a / kv_a / f_a / g_a and the indexer's single key head, which every head reads), the
// dense and shared-expert MLPs, the embedding and lm_head (by vocabulary).
bool tensor_sharded(const Param& p) {
  if (p.role == ParamRole::Embedding) return true;
  if (p.role != ParamRole::Matrix) return false;
  const std::string& n = p.name;
  if (n == "lm_head.weight") return true;
  if (contains(n, ".self_attn.")) {
    for (const char* replicated :
         {"q_a_proj", "kv_a_proj", "f_a_proj", "g_a_proj", "indexer.wk.", "index_kpool_compress_gate"})
      if (contains(n, replicated)) return false;
    return true;
  }
  return contains(n, ".mlp.") && !contains(n, ".mlp.gate.") && !contains(n, ".mlp.experts.");
}

// The layer a parameter belongs to, or -1 (embedding, final norm, lm_head).
int64_t layer_index(const std::string& name) {
  const std::string key = "layers.";
  const size_t at = name.find(key);
  return at == std::string::npos ? -1 : std::stoll(name.substr(at + key.size()));
}

}  // namespace

StateBytes state_bytes(const ModelConfig& c, const Parallel& p) {
  // Shapes and device dtypes only, as DeviceWeights builds them.
  ModelWeights weights = build_weights(c, DType::BF16, [](const Shape& shape, WeightPrecision precision) {
    return Tensor::meta(shape, precision == WeightPrecision::Fp32 ? DType::F32 : DType::BF16);
  });
  StateBytes s;
  int64_t weight_arena = 0, gradient_arena = 0, optimizer_arena = 0;
  std::map<int64_t, int64_t> layer_gradients;

  for (const Param& param : parameter_table(c, weights)) {
    const int64_t expert = expert_index(param.name);
    if (expert >= p.experts_per_gpu(c)) continue;  // another GPU's expert
    const int64_t n = tensor_sharded(param) ? param.tensor.numel() / p.tensor : param.tensor.numel();
    const bool bf16 = param.tensor.dtype() == DType::BF16;
    s.parameters += n;
    weight_arena += arena_aligned(n * (bf16 ? 2 : 4));
    gradient_arena += arena_aligned(n * 4);
    layer_gradients[layer_index(param.name)] += n * 4;
    s.host_weights += n * 4;
    if (!role_trained(param.role)) continue;
    const int64_t states = bf16 ? 3 : 2;  // (master,) m, v
    optimizer_arena += states * arena_aligned(n * 4);
    s.host_optimizer += 3 * n * 4;  // the host's AdamW keeps an fp32 master, m and v for every slot
    s.host_optimizer_with_gradients += (states + 1) * n * 4;
  }
  s.weights = allocator_rounded(weight_arena);
  s.gradients = allocator_rounded(gradient_arena);
  s.optimizer = allocator_rounded(optimizer_arena);   // one arena (backend/cuda/cuda_device_model.cpp)
  s.host_optimizer += weight_arena + gradient_arena;  // backend/cuda/host_optimizer.h: pinned mirrors
  for (const auto& [layer, bytes] : layer_gradients)
    s.largest_layer_gradients = std::max(s.largest_layer_gradients, bytes);
  return s;
}

}  // namespace spindle::plan
