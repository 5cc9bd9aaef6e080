// The GLM-5.3-Flash text configuration, parsed exactly as transformers' Glm5NextTextConfig
// (transformers 5.17, models/glm5_next/configuration_glm5_next.py).
#pragma once

#include <cstdint>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <vector>

namespace spindle {

enum class AttentionKind { Kda, Dsa };    // "linear_attention", "deepseek_sparse_attention"
enum class MlpKind { Dense, Sparse };     // "dense", "sparse" (MoE)
enum class IndexerKind { Full, Shared };  // "full", "shared"

struct ModelConfig {
  int64_t vocab_size = 154880;
  int64_t hidden_size = 4096;
  int64_t intermediate_size = 12288;
  int64_t moe_intermediate_size = 2048;
  int64_t num_hidden_layers = 45;
  int64_t num_attention_heads = 64;
  int64_t num_key_value_heads = 64;
  int64_t n_shared_experts = 1;
  int64_t n_routed_experts = 288;
  double routed_scaling_factor = 2.5;
  int64_t kv_lora_rank = 512;
  int64_t q_lora_rank = 1536;
  int64_t qk_rope_head_dim = 0;
  int64_t v_head_dim = 256;
  int64_t qk_nope_head_dim = 256;
  int64_t n_group = 1;
  int64_t topk_group = 1;
  int64_t num_experts_per_tok = 8;
  bool norm_topk_prob = true;
  std::string hidden_act = "silu";
  int64_t max_position_embeddings = 1048576;
  double initializer_range = 0.02;
  double rms_norm_eps = 1e-5;
  std::optional<int64_t> pad_token_id = 154820;
  std::optional<int64_t> bos_token_id;
  nlohmann::json eos_token_id;  // null, an int or a list of ints; kept as given
  bool tie_word_embeddings = false;
  bool attention_bias = false;
  double attention_dropout = 0.0;
  int64_t index_topk = 2048;
  int64_t index_head_dim = 128;
  int64_t index_n_heads = 32;
  double swiglu_limit = 10.0;
  int64_t linear_head_dim = 128;
  int64_t linear_num_heads = 64;
  int64_t linear_conv_kernel_dim = 4;
  std::optional<double> linear_lower_bound = -5.0;
  int64_t hc_mult = 4;
  double hc_eps = 1e-6;
  int64_t hc_sinkhorn_iters = 20;
  double router_aux_loss_coef = 0.001;
  int64_t index_kpool = 16;
  bool index_kpool_always_select_tail = true;

  // Derived per-layer schedules (always num_hidden_layers long after parsing).
  std::vector<AttentionKind> layer_types;
  std::vector<MlpKind> mlp_layer_types;
  std::vector<IndexerKind> indexer_types;

  // Where this config came from, for error messages ("dir/config.json").
  std::string source = "<built-in>";

  int64_t qk_head_dim() const { return qk_rope_head_dim + qk_nope_head_dim; }
  int64_t linear_qkv_dim() const { return linear_head_dim * linear_num_heads; }
  // Number of routed experts chosen per token.
  int64_t experts_per_token() const { return num_experts_per_tok; }
  // DSA layer `layer` reuses the selection of layer `layer - 1`.
  bool dsa_shares_previous_selection(int64_t layer) const;
};

// Parses a config.json object: the nested form ({"model_type": "glm5_next", "text_config": {...}}),
// the flat form (text fields at the top level) or a bare text config ("glm5_next_text"). Applies
// transformers' defaults and derivations, then validates. Unknown or contradictory fields are
// errors naming `source` and the field.
ModelConfig parse_model_config(const nlohmann::json& json, const std::string& source);

// Reads `path`: a config.json file, or a directory holding one.
ModelConfig load_model_config(const std::string& path);

// The nested Hugging Face form that transformers' Glm5NextConfig loads.
nlohmann::json model_config_to_json(const ModelConfig& config);

// The last `n` layers of `kind` among `kinds`, as a flag per layer: the KDA layers that keep their
// input projections (LossOptions::kda_projections_kept) in the executor and in the planner.
std::vector<bool> last_layers_of_kind(const std::vector<AttentionKind>& kinds, AttentionKind kind, int64_t n);

const char* attention_kind_name(AttentionKind kind);
const char* mlp_kind_name(MlpKind kind);
const char* indexer_kind_name(IndexerKind kind);

}  // namespace spindle
