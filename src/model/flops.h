// An analytic count of the model's floating-point operations for one sequence of L tokens, for
// MFU. Multiply-adds count 2. Per token and layer:
//   projections: 2 x (input x output) of every matrix a token passes through: KDA q/k/v/f/g/b/o,
//     MLA q_a/q_b/kv_a/kv_b/o, indexer wq_b/wk/gate/weights, dense MLP, or router + shared expert +
//     top-k routed experts; the lm_head (2 D V); mHC's 2 (H D)((2 + H) H) mixing projection.
//   KDA recurrence: 6 dk dv per head (read S^T q, the delta S^T k, the rank-1 update).
//   DSA attention: 2 w (qk_dim + v_dim) per head, w = min(selection width, t + 1) keys for the
//     query at position t.
//   Indexer scoring: 2 Hi d (t / kpool) per query at position t (pooled keys it can see).
// Training = 3 x forward (the backward is twice the forward) for everything a gradient flows
// through; the indexer's scores count once: nothing backpropagates through them (its KL training
// differentiates only the chosen pools, topk / kpool per query, and is not counted, like the
// recomputation a memory policy adds: model FLOPs, not hardware FLOPs).
#pragma once

#include <cstdint>

#include "model/config.h"

namespace spindle {

struct ModelFlops {
  double projections = 0;  // every matrix product, the lm_head included
  double kda = 0;          // the delta-rule recurrence
  double attention = 0;    // sparse attention over the selected keys
  double indexer = 0;      // the indexer's scores
  double forward() const { return projections + kda + attention + indexer; }
  double training() const { return 3 * (projections + kda + attention) + indexer; }
};

ModelFlops model_flops(const ModelConfig& config, int64_t tokens);

}  // namespace spindle
