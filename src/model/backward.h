// The gradient of the mean next-token loss of one sequence with respect to every parameter, on
// the CPU reference path: a forward pass that keeps each residual site's input streams, then the
// sites in reverse, each recomputing its sublayer before backpropagating through it.
#pragma once

#include <cstdint>
#include <vector>

#include "model/config.h"
#include "model/weights.h"

namespace spindle {

struct LossOptions {
  int64_t head_block = 1024;  // tokens per lm_head + softmax block
  double scale = 1.0;         // gradients of scale * loss are accumulated (micro-batch averaging)
};

// Returns the mean over positions 1..n-1 of -log p(token_i | tokens before i) and accumulates the
// gradient of scale * that loss into `grads` (allocated like the weights, same dtype T). The
// indexer is not differentiated (its choice is discrete; its own loss is separate), nor is the
// router's correction bias (a buffer). The padding token's embedding row gets no gradient, as in
// torch's nn.Embedding(padding_idx).
template <class T>
double loss_and_gradients(const ModelConfig& config, const ModelWeights& weights, const std::vector<int32_t>& tokens,
                          ModelWeights& grads, const LossOptions& options = {});

// Allocates gradient buffers shaped like the weights, zero-filled.
ModelWeights zero_gradients(const ModelConfig& config, DType dtype);

}  // namespace spindle
