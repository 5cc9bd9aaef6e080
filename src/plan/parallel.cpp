#include "plan/parallel.h"

#include <algorithm>
#include <sstream>

#include "core/error.h"

namespace spindle::plan {

double Parallel::routed_rows_per_token(const ModelConfig& c) const {
  const auto k = static_cast<double>(c.num_experts_per_tok);
  if (gpus == 1) return k;
  // A token meets each of this GPU's experts at most once.
  return std::min(
      {k, static_cast<double>(experts_per_gpu(c)), k * kBusiestGpuRouting / static_cast<double>(gpus)});
}

std::string Parallel::describe(const ModelConfig& c) const {
  std::ostringstream out;
  out << gpus << " GPU" << (gpus > 1 ? "s" : "") << ": expert parallel " << gpus << " (" << experts_per_gpu(c)
      << " of " << c.n_routed_experts << " routed experts per GPU";
  if (gpus > 1)
    out << ", the busiest GPU computing " << routed_rows_per_token(c)
        << " routed rows per token: " << kBusiestGpuRouting << "x its mean share";
  out << "); tensor parallel over up to " << std::min(gpus, kGpusPerNode)
      << " GPUs of a node, the degree in each policy's name (tpN; none: 1), splits attention heads, the "
         "dense "
         "and shared-expert MLPs and the vocabulary; data and sequence parallel none (every GPU holds the "
         "whole "
         "sequence's residual streams)";
  return out.str();
}

bool tensor_degree_fits(const ModelConfig& c, int64_t t) {
  return t >= 1 && c.num_attention_heads % t == 0 && c.linear_num_heads % t == 0 &&
         c.index_n_heads % t == 0 && c.intermediate_size % t == 0 &&
         (c.moe_intermediate_size * c.n_shared_experts) % t == 0 && c.vocab_size % t == 0;
}

Shapes gpu_shapes(const ModelConfig& c, const Parallel& p) {
  check(p.gpus >= 1, "the number of GPUs must be positive, got ", p.gpus);
  check(tensor_degree_fits(c, p.tensor), "tensor parallel degree ", p.tensor, " does not divide the heads (",
        c.num_attention_heads, " attention, ", c.linear_num_heads, " KDA, ", c.index_n_heads,
        " indexer), MLP widths or vocabulary of ", c.source);
  const int64_t t = p.tensor;
  Shapes s;
  s.streams = c.hc_mult;
  s.hidden = c.hidden_size;
  s.vocab = c.vocab_size / t;
  s.kda_heads = c.linear_num_heads / t;
  s.kda_dim = c.linear_head_dim;
  s.conv_kernel = c.linear_conv_kernel_dim;
  s.mla_heads = c.num_attention_heads / t;
  s.qk_dim = c.qk_head_dim();
  s.v_dim = c.v_head_dim;
  s.q_rank = c.q_lora_rank;
  s.kv_rank = c.kv_lora_rank;
  s.rope_dim = c.qk_rope_head_dim;
  s.index_heads = c.index_n_heads / t;
  s.index_dim = c.index_head_dim;
  s.kpool = c.index_kpool;
  s.width = c.index_topk + (c.index_kpool_always_select_tail ? c.index_kpool - 1 : 0);
  s.selected_pools = c.index_topk / c.index_kpool;
  s.dense_inter = c.intermediate_size / t;
  s.shared_inter = c.moe_intermediate_size * c.n_shared_experts / t;
  s.moe_inter = c.moe_intermediate_size;
  s.experts = c.n_routed_experts;
  s.topk = c.num_experts_per_tok;
  s.routed_rows_per_token = p.routed_rows_per_token(c);
  for (size_t i = 0; i < c.layer_types.size(); ++i)
    s.layers.push_back({c.layer_types[i], c.mlp_layer_types[i],
                        c.layer_types[i] == AttentionKind::Dsa && c.indexer_types[i] == IndexerKind::Full});
  return s;
}

}  // namespace spindle::plan
