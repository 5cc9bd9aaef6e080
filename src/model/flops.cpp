#include "model/flops.h"

#include <algorithm>

namespace spindle {

ModelFlops model_flops(const ModelConfig& c, int64_t tokens) {
  const auto L = static_cast<double>(tokens);
  const double D = static_cast<double>(c.hidden_size), H = static_cast<double>(c.hc_mult);
  ModelFlops f;
  double per_token = 2 * D * static_cast<double>(c.vocab_size);
  for (size_t i = 0; i < c.layer_types.size(); ++i) {
    per_token += 2 * 2 * (H * D) * ((2 + H) * H);  // two mHC sites
    if (c.layer_types[i] == AttentionKind::Kda) {
      const double qkv = static_cast<double>(c.linear_qkv_dim()), dh = static_cast<double>(c.linear_head_dim);
      const double heads = static_cast<double>(c.linear_num_heads);
      per_token += 2 * (3 * D * qkv + D * dh + dh * qkv + D * heads + D * dh + dh * qkv + qkv * D);
      f.kda += L * heads * 6 * dh * dh;
    } else {
      const double heads = static_cast<double>(c.num_attention_heads),
                   qk = static_cast<double>(c.qk_head_dim()), v = static_cast<double>(c.v_head_dim),
                   qr = static_cast<double>(c.q_lora_rank), kr = static_cast<double>(c.kv_lora_rank);
      per_token += 2 * (D * qr + qr * heads * qk + D * kr + kr * heads * (qk + v) + heads * v * D);
      const int64_t width = c.index_topk + (c.index_kpool_always_select_tail ? c.index_kpool - 1 : 0);
      // sum over t of min(width, t + 1) keys
      const double w = static_cast<double>(width);
      const double keys = L <= w ? L * (L + 1) / 2 : w * (w + 1) / 2 + (L - w) * w;
      f.attention += keys * heads * 2 * (qk + v);
      if (c.indexer_types[i] == IndexerKind::Full) {
        const double hi = static_cast<double>(c.index_n_heads), d = static_cast<double>(c.index_head_dim);
        per_token += 2 * (qr * hi * d + 2 * D * d + D * hi);
        f.indexer += 2 * hi * d * (L * (L - 1) / 2) / static_cast<double>(c.index_kpool);
      }
    }
    if (c.mlp_layer_types[i] == MlpKind::Dense) {
      per_token += 2 * 3 * D * static_cast<double>(c.intermediate_size);
    } else {
      const double I = static_cast<double>(c.moe_intermediate_size);
      const double experts = static_cast<double>(c.num_experts_per_tok + c.n_shared_experts);
      per_token += 2 * (D * static_cast<double>(c.n_routed_experts) + experts * 3 * D * I);
    }
  }
  f.projections = per_token * L;
  return f;
}

}  // namespace spindle
