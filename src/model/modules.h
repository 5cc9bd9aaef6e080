// Forward passes of the model's sublayers on the CPU reference path, for one sequence.
// Inputs are [tokens, hidden] rows (the normalised sublayer input); outputs likewise.
#pragma once

#include <cstdint>
#include <vector>

#include "model/backward.h"
#include "model/config.h"
#include "model/weights.h"

namespace spindle {

// What a KDA layer carries from one chunk of a sequence to the next (the streaming executor):
// the delta-rule state [heads, head_dim, head_dim] and the last kernel - 1 rows of each
// projection [kernel - 1, heads * head_dim] (the causal conv's window). Zero at the start.
template <class T>
struct KdaCarry {
  std::vector<T> state, q_tail, k_tail, v_tail;
  explicit KdaCarry(const ModelConfig& c);
};

// Kimi Delta Attention: projections, short conv, gates, delta rule, gated norm, output. The
// overload with a carry continues a sequence whose earlier tokens left `carry`, and updates it.
template <class T>
void kda_forward(const ModelConfig& c, const KdaWeights& w, const T* x, int64_t tokens, T* y);
template <class T>
void kda_forward(const ModelConfig& c, const KdaWeights& w, const T* x, int64_t tokens, T* y,
                 KdaCarry<T>& carry);

// What a DSA layer carries from one chunk of a sequence to the next: every earlier token's keys
// and values ([tokens, heads, qk_head_dim + v_head_dim]) and, with its own indexer, its keys and
// pool gates before pooling ([tokens, index_head_dim]: a pool may straddle two chunks).
template <class T>
struct DsaCarry {
  int64_t tokens = 0;
  std::vector<T> kv, index_keys, index_gate;
};

// The gradients of a DsaCarry's contents gathered over a backward in chunks (last chunk first),
// and of the indexer's pooled keys (every complete pool of the carry). Zero to begin with.
template <class T>
struct DsaCacheGrad {
  std::vector<T> kv, pool_keys, index_keys, index_gate;
  DsaCacheGrad(const ModelConfig& c, const DsaCarry<T>& cache);
};

// MLA + DSA. `selection` ([tokens, width], absolute positions) is written when the layer has its
// own indexer and read when it shares the previous layer's. The overload with a carry continues
// a sequence whose earlier tokens left `carry`, and appends this chunk to it.
template <class T>
void dsa_forward(const ModelConfig& c, const DsaWeights& w, const T* x, int64_t tokens,
                 std::vector<int32_t>& selection, T* y);
template <class T>
void dsa_forward(const ModelConfig& c, const DsaWeights& w, const T* x, int64_t tokens,
                 std::vector<int32_t>& selection, T* y, DsaCarry<T>& carry);

// SwiGLU with GLM's clamps: down(silu(min(gate x, lim)) * clamp(up x, -lim, lim)).
template <class T>
void mlp_forward(const MlpWeights& w, double swiglu_limit, const T* x, int64_t tokens, T* y);

// Routed experts (sigmoid router, group-limited top-k) plus the shared expert. When `load` is
// given, it receives the number of tokens routed to each expert; `router_logits`, the logits.
template <class T>
void moe_forward(const ModelConfig& c, const MoeWeights& w, const T* x, int64_t tokens, T* y,
                 std::vector<int64_t>* load = nullptr, std::vector<T>* router_logits = nullptr);

// The indexer's own training loss (KL to the main attention), accumulated over DSA layers.
struct IndexerLoss {
  double coef = 0.0;    // the loss weight; gradients of coef * mean KL go to the indexer only
  double kl_sum = 0.0;  // sum over layers of the mean KL over queries
  int64_t layers = 0;   // layers that contributed
  // Summed over layers and queries: what cpu::IndexerKlSums counts.
  int64_t trained_queries = 0, closed_queries = 0;

  // Into `result` (after the backward): the mean KL over layers and the closed share.
  void read(LossResult& result) const;
};

// Backward passes. Each recomputes its sublayer's forward from the input x, then accumulates the
// input gradient into dx and the parameter gradients into `grad` (same layout as the weights).
template <class T>
void kda_backward(const ModelConfig& c, const KdaWeights& w, const T* x, int64_t tokens, const T* dy, T* dx,
                  KdaWeights& grad);
// Backward of a chunk that began from `carry_in` (the carry its forward received). `carry_grad`
// holds on entry the gradient of the carry the chunk handed on (zero for the last chunk) and on
// return the gradient of `carry_in`, for the chunk before.
template <class T>
void kda_backward(const ModelConfig& c, const KdaWeights& w, const T* x, int64_t tokens, const T* dy, T* dx,
                  KdaWeights& grad, const KdaCarry<T>& carry_in, KdaCarry<T>& carry_grad);

// `selection` is the one the forward pass used (the layer's own, or the shared one). With
// `indexer_loss`, a layer with its own indexer also trains it (inputs detached).
template <class T>
void dsa_backward(const ModelConfig& c, const DsaWeights& w, const T* x, int64_t tokens,
                  const std::vector<int32_t>& selection, const T* dy, T* dx, DsaWeights& grad,
                  IndexerLoss* indexer_loss = nullptr);
// Backward of a chunk of queries at positions first .. first + tokens, over the whole sequence's
// cache `cache` (the forward's final DsaCarry). `cache_grad` (made from that cache before the last
// chunk) gathers every chunk's gradients of the keys and values and, when the indexer is trained,
// of its pooled keys, keys and gates; this chunk's own rows are complete when it runs (later chunks
// run first) and flow back into dx (keys and values) or the indexer's weights. The indexer's loss
// is normalised by the whole sequence's length, as over the whole sequence at once.
template <class T>
void dsa_backward(const ModelConfig& c, const DsaWeights& w, const T* x, int64_t tokens,
                  const std::vector<int32_t>& selection, const T* dy, T* dx, DsaWeights& grad,
                  IndexerLoss* indexer_loss, const DsaCarry<T>& cache, int64_t first,
                  DsaCacheGrad<T>& cache_grad);

template <class T>
void mlp_backward(const MlpWeights& w, double swiglu_limit, const T* x, int64_t tokens, const T* dy, T* dx,
                  MlpWeights& grad);

// `extra_dlogits` ([tokens, experts], may be null) is a further gradient on the router logits
// (the auxiliary balance loss).
template <class T>
void moe_backward(const ModelConfig& c, const MoeWeights& w, const T* x, int64_t tokens, const T* dy, T* dx,
                  MoeWeights& grad, const T* extra_dlogits = nullptr);

}  // namespace spindle
