// The parameters of a GLM-5.3-Flash text model, one struct per module, and the table that
// names each parameter as it is stored on disk (what transformers' save_pretrained writes).
#pragma once

#include <functional>
#include <string>
#include <vector>

#include "core/tensor.h"
#include "model/config.h"

namespace spindle {

struct HyperConnectionWeights {
  Tensor fn;     // [(2 + H) * H, H * hidden]
  Tensor base;   // [(2 + H) * H]
  Tensor scale;  // [3]: pre, post, comb
};

struct KdaWeights {
  // [3 heads * head_dim + 2 head_dim + heads, hidden]: the rows of q_proj, k_proj, v_proj, g_a_proj,
  // f_a_proj and b_proj in that order, so that the GPU takes x's projections in one product and
  // their weights' gradients in another (the table names them apart, as checkpoints do).
  Tensor in_proj;
  Tensor q_proj, k_proj, v_proj;  // [heads * head_dim, hidden]
  Tensor q_conv, k_conv, v_conv;  // [heads * head_dim, 1, kernel]
  Tensor f_a_proj;                // [head_dim, hidden]
  Tensor f_b_proj;                // [heads * head_dim, head_dim]
  Tensor dt_bias;                 // [heads * head_dim]
  Tensor A_log;                   // [heads]
  Tensor b_proj;                  // [heads, hidden]
  Tensor g_a_proj;                // [head_dim, hidden]
  Tensor g_b_proj;                // [heads * head_dim, head_dim]
  Tensor o_norm;                  // [head_dim]
  Tensor o_proj;                  // [hidden, heads * head_dim]
};

struct IndexerWeights {
  Tensor wq_b;           // [index_heads * index_dim, q_lora_rank]
  Tensor wk;             // [index_dim, hidden]
  Tensor k_norm_weight;  // [index_dim]
  Tensor k_norm_bias;    // [index_dim]
  Tensor weights_proj;   // [index_heads, hidden]
  Tensor compress_ape;   // [kpool, index_dim]
  Tensor compress_gate;  // [index_dim, hidden]
};

struct DsaWeights {
  // [q_lora_rank + kv_lora_rank + rope_dim (+ 2 index_dim), hidden]: the rows of q_a_proj,
  // kv_a_proj and, with an indexer of its own, the indexer's wk and compress_gate, in that order,
  // so that the GPU takes x's low-rank projections in one product and their weights' gradients in
  // another (the table names them apart, as checkpoints do).
  Tensor x_proj;
  Tensor q_a_proj;        // [q_lora_rank, hidden]
  Tensor q_a_layernorm;   // [q_lora_rank]
  Tensor q_b_proj;        // [heads * qk_head_dim, q_lora_rank]
  Tensor kv_a_proj;       // [kv_lora_rank + rope_dim, hidden]
  Tensor kv_a_layernorm;  // [kv_lora_rank]
  Tensor kv_b_proj;       // [heads * (nope_dim + v_dim), kv_lora_rank]
  Tensor o_proj;          // [hidden, heads * v_dim]
  bool has_indexer = false;
  IndexerWeights indexer;
};

struct MlpWeights {
  // [2 intermediate, hidden]: the gate rows, then the up rows, so that the GPU multiplies both in
  // one product; gate_proj and up_proj are its halves (the table names them apart, as checkpoints do).
  Tensor gate_up;
  Tensor gate_proj, up_proj;  // [intermediate, hidden]
  Tensor down_proj;           // [hidden, intermediate]
};

struct MoeWeights {
  Tensor router;           // [experts, hidden]
  Tensor correction_bias;  // [experts]: e_score_correction_bias, a buffer, not a trained weight
  // [experts, 2 moe_intermediate, hidden]: each expert's gate rows, then its up rows, so that the
  // GPU multiplies both in one product (the table names them apart, as checkpoints do).
  Tensor experts_gate_up;
  Tensor experts_down;  // [experts, hidden, moe_intermediate]
  MlpWeights shared;    // intermediate = moe_intermediate * n_shared_experts
};

struct LayerWeights {
  AttentionKind attention = AttentionKind::Kda;
  MlpKind mlp = MlpKind::Dense;
  HyperConnectionWeights attn_hc, ffn_hc;
  Tensor input_layernorm, post_attention_layernorm;  // [hidden]
  KdaWeights kda;
  DsaWeights dsa;
  MlpWeights dense;
  MoeWeights moe;
};

struct ModelWeights {
  DType dtype = DType::F32;
  Tensor embed_tokens;  // [vocab, hidden]
  Tensor norm;          // [hidden]
  Tensor lm_head;       // [vocab, hidden]; the same storage as embed_tokens when tied
  std::vector<LayerWeights> layers;
};

// What kind of value a parameter holds: decides its initialisation and, later, weight decay.
enum class ParamRole {
  Matrix,        // projection weights, experts, conv kernels
  Embedding,     // token embedding
  Norm,          // RMSNorm / LayerNorm weights (initialised to one)
  NormBias,      // LayerNorm bias (zero)
  HcFn,          // mHC projection (normal 0.02)
  HcBase,        // mHC bias (zero)
  HcScale,       // mHC scales (one)
  ALog,          // KDA decay rate
  DtBias,        // KDA gate bias
  CompressApe,   // indexer k-pool position embedding (zero)
  CompressGate,  // indexer k-pool gate (one)
  RouterBias,    // e_score_correction_bias: a buffer updated outside gradient descent
};

struct Param {
  std::string name;  // on-disk name, e.g. "model.language_model.layers.3.self_attn.q_a_proj.weight"
  Tensor tensor;     // a view into the model's weights
  ParamRole role;
};

constexpr const char* kTextPrefix = "model.language_model.";

// The storage a backend gives a parameter. The mixed-precision GPU path keeps the small
// parameters that feed fp32 math (mHC, conv taps, decay rate and bias, router bias) in fp32.
enum class WeightPrecision { Compute, Fp32 };
using WeightFactory = std::function<Tensor(const Shape& shape, WeightPrecision precision)>;

// Builds the weights of `config` from tensors made by `make`; `dtype` is the compute dtype.
ModelWeights build_weights(const ModelConfig& config, DType dtype, const WeightFactory& make);

// Allocates every weight of `config` (uninitialised) in `dtype`. With `shapes_only`, the tensors
// have shapes but no memory (parameter counts of models too large for this machine).
ModelWeights allocate_weights(const ModelConfig& config, DType dtype, bool shapes_only = false);

// Every parameter in on-disk order and naming. Per-expert entries are views into the 3-D
// expert tensors. A tied lm_head is not listed (it is the embedding).
std::vector<Param> parameter_table(const ModelConfig& config, ModelWeights& weights);

}  // namespace spindle
