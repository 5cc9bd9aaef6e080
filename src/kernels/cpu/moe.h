// Mixture-of-experts routing and the clamped SwiGLU of GLM-5.3-Flash's feed-forward blocks.
#pragma once

#include <cstdint>

namespace spindle::cpu {

struct RouterShape {
  int64_t tokens;
  int64_t experts;
  int64_t groups;       // n_group
  int64_t topk_groups;  // topk_group
  int64_t topk;         // num_experts_per_tok
  bool normalize;       // norm_topk_prob
  double scaling;       // routed_scaling_factor
};

// DeepSeek-V3 routing: scores = sigmoid(logits); choice = scores + bias; keep the topk_groups
// groups with the largest sum of their two best choices; pick the topk experts by choice among
// them (ties to the lower index); weights = scores of the picks, normalised (sum + 1e-20) if asked,
// times scaling. logits: [tokens, experts]; bias: [experts]; expert: [tokens, topk]; weight: [tokens, topk].
template <class T>
void route_tokens(const RouterShape& s, const T* logits, const T* bias, int32_t* expert, T* weight);

// out = silu(min(gate, limit)) * clamp(up, -limit, limit), elementwise over n.
template <class T>
void clamped_swiglu(const T* gate, const T* up, T* out, int64_t n, double limit);

// Backward of clamped_swiglu: dgate and dup written (zero where a clamp held the input).
template <class T>
void clamped_swiglu_backward(const T* gate, const T* up, const T* dout, T* dgate, T* dup, int64_t n,
                             double limit);

// Backward of the routing weights with respect to the router logits, for the chosen experts
// (the choice itself is discrete): dlogits [tokens, experts] written.
template <class T>
void route_weights_backward(const RouterShape& s, const T* logits, const int32_t* expert, const T* dweight,
                            T* dlogits);

}  // namespace spindle::cpu
