// How the planner assumes a model is split over GPUs, and the per-GPU sizes the executor's
// buffers are then made of. One sequence, no data or sequence parallelism: every GPU holds the
// whole sequence's residual streams. Routed experts are spread over all GPUs (expert parallel
// degree = GPUs); attention heads, the dense and shared-expert MLP columns and the vocabulary
// of the embedding and lm_head over `tensor` GPUs of one node (tensor parallel degree <= 8).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "model/config.h"

namespace spindle::plan {

// Real text routes unevenly: the busiest GPU of an expert-parallel group received about 4x the
// mean share of routed rows (shared/DESIGN.md, lesson 4).
constexpr double kBusiestGpuRouting = 4.0;
// Tensor parallelism stays inside one node's NVLink domain.
constexpr int64_t kGpusPerNode = 8;

struct Parallel {
  int64_t gpus = 1;
  int64_t tensor = 1;

  int64_t experts_per_gpu(const ModelConfig& c) const { return (c.n_routed_experts + gpus - 1) / gpus; }
  // Routed (token, expert) rows per token that the busiest GPU computes.
  double routed_rows_per_token(const ModelConfig& c) const;
  // The assumption in words (the tensor-parallel degree is each policy's own).
  std::string describe(const ModelConfig& c) const;
};

// Whether `tensor` GPUs can split every head count and the vocabulary evenly.
bool tensor_degree_fits(const ModelConfig& c, int64_t tensor);

struct LayerShape {
  AttentionKind attention;
  MlpKind mlp;
  bool own_indexer;  // a DSA layer that selects for itself (not "shared")
};

// Per-GPU sizes: head counts and MLP widths divided by the tensor-parallel degree.
struct Shapes {
  int64_t streams = 0, hidden = 0, vocab = 0;
  int64_t kda_heads = 0, kda_dim = 0, conv_kernel = 0;
  int64_t mla_heads = 0, qk_dim = 0, v_dim = 0, q_rank = 0, kv_rank = 0, rope_dim = 0;
  int64_t index_heads = 0, index_dim = 0, kpool = 0, width = 0;
  int64_t selected_pools = 0;  // pools a query selects: index_topk / kpool
  int64_t dense_inter = 0, shared_inter = 0, moe_inter = 0, experts = 0, topk = 0;
  double routed_rows_per_token = 0;
  std::vector<LayerShape> layers;

  int64_t kda_width() const { return kda_heads * kda_dim; }
};

Shapes gpu_shapes(const ModelConfig& c, const Parallel& p);

}  // namespace spindle::plan
