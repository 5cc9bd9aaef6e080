// The gradient of the mean next-token loss of one sequence with respect to every parameter, on
// the CPU reference path: a forward pass that keeps each residual site's input streams, then the
// sites in reverse, each recomputing its sublayer before backpropagating through it.
#pragma once

#include <cstdint>
#include <vector>

#include "model/config.h"
#include "model/weights.h"

namespace spindle {

// What the GPU executor keeps for its backward pass (plan/policy.h): every residual site's input,
// only each layer's (the feed-forward site's input rebuilt in the backward by running the
// attention site again), or each layer's in pinned host memory. The CPU reference keeps every site.
enum class SiteMemory { KeepSites, KeepLayerInputs, OffloadLayerInputs };

struct LossOptions {
  int64_t head_block = 1024;     // tokens per lm_head + softmax block
  double scale = 1.0;            // gradients of scale * loss are accumulated (micro-batch averaging)
  double indexer_kl_coef = 0.0;  // > 0: train each indexer on KL(attention || indexer)
  double aux_loss_coef = 0.0;    // > 0: add transformers' router load-balancing loss
  int64_t chunk_tokens = 0;  // > 0: the streaming executor, this many tokens per chunk (model/streaming.h)
  SiteMemory site_memory = SiteMemory::KeepSites;  // the unchunked GPU executor only
  // The streaming executor on the GPU: keep each chunk's DSA selections (as pool lists) for the
  // recomputation before its backward; false runs the indexer again there (less memory).
  bool keep_selections = true;
  // The streaming executor on the GPU: keep from each chunk's recomputation what each sublayer's
  // backward would compute once more (the sparse attention's and the KDA recurrence's outputs,
  // the feed-forward's output for its mHC combine, a MoE's routing) until that backward; false
  // recomputes them there (less memory).
  bool keep_outputs = true;
  // The streaming executor on the GPU, with keep_outputs: the KDA layers' intra-chunk matrices too
  // (A, Aq, Tinv packed: 100 MB per layer at 16k tokens for the 4B config), which their backward
  // then does not compute again.
  bool keep_kda_matrices = true;
  // The streaming executor on the GPU, with keep_outputs: each feed-forward site's input is made
  // again before its backward (one mHC combine) instead of kept from the recomputation, and the
  // memory that frees keeps each attention sublayer's output (its backward then runs no output
  // projection) and each MoE's [gate | up] products (its backward multiplies no rows again).
  bool rebuild_ffn_inputs = false;
  // The streaming executor on the GPU, with keep_outputs: this many KDA layers, the last ones,
  // also keep their input projections (the conv windows and the low-rank gates' inputs: 210 MB per
  // layer at 16k tokens for the 4B config), so that their backward multiplies x by the stacked
  // weights no more.
  int64_t kda_projections_kept = 0;
};

struct LossResult {
  double loss = 0.0;        // mean next-token loss (nats)
  double indexer_kl = 0.0;  // mean over indexer layers of the mean KL over queries (when trained)
  // The share of the indexer queries the KL trains whose every relu was closed on their chosen
  // pools (when trained): their scores all tie at 0, the KL cannot move them, and their sparse
  // attention takes the lowest pools. A layer whose queries are all closed has a dead indexer.
  double indexer_closed = 0.0;
  double aux_loss = 0.0;                          // the balance loss before its coefficient (when enabled)
  std::vector<std::vector<int64_t>> expert_load;  // per layer: tokens routed to each expert (MoE layers)
};

// The mean over positions 1..n-1 of -log p(token_i | tokens before i); accumulates into `grads`
// (allocated like the weights, same dtype T) the gradient of scale * (loss + aux_loss_coef * aux)
// for the model and of scale * indexer_kl_coef * KL for the indexers. The indexer gets no
// gradient from the language-model loss (its choice is discrete), the model none from the KL;
// the router's correction bias is a buffer (no gradient). The padding token's embedding row gets
// no gradient, as in torch's nn.Embedding(padding_idx).
template <class T>
LossResult loss_and_gradients(const ModelConfig& config, const ModelWeights& weights,
                              const std::vector<int32_t>& tokens, ModelWeights& grads,
                              const LossOptions& options = {});

// Allocates gradient buffers shaped like the weights, zero-filled.
ModelWeights zero_gradients(const ModelConfig& config, DType dtype);

}  // namespace spindle
