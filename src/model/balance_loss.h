// transformers' load_balancing_loss_func over all MoE layers: with p = softmax(router logits),
// f_e the share of top-k picks of p (ties to the lower expert; not the biased grouped routing)
// and P_e the mean p_e, both pooled over every MoE layer's tokens, aux = E * sum_e f_e P_e.
// The statistics are gathered first (over all layers, or all chunks of a streamed sequence);
// each layer's gradient is then computed from its own logits.
#pragma once

#include <cstdint>
#include <vector>

#include "model/config.h"

namespace spindle {

struct BalanceStats {
  std::vector<double> counts, prob_sum;  // per expert: top-k picks, sum of p
  double rows = 0;                       // tokens over all MoE layers
};

// Adds one layer's tokens ([tokens, experts] logits) to `stats`.
template <class T>
void add_balance_stats(const ModelConfig& c, const T* logits, int64_t tokens, BalanceStats& stats);

double balance_value(const ModelConfig& c, const BalanceStats& stats);

// d(coef * aux)/dlogits for one layer's tokens, written into dlogits [tokens, experts].
template <class T>
void balance_gradient(const ModelConfig& c, const T* logits, int64_t tokens, const BalanceStats& stats,
                      double coef, T* dlogits);

}  // namespace spindle
