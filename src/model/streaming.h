// The streaming executor on the CPU reference path: the loss and gradients of one sequence
// computed a chunk of tokens at a time (docs/STREAMING.md). The forward goes through all layers
// chunk by chunk, keeping only each layer's carry at chunk boundaries (KDA) and its growing
// key/value cache (DSA); the backward takes the chunks in reverse, recomputes each through all
// layers, and hands the carries' gradients to the chunk before.
#pragma once

#include <cstdint>
#include <vector>

#include "model/backward.h"
#include "model/config.h"
#include "model/weights.h"

namespace spindle {

// As loss_and_gradients with options.chunk_tokens tokens per chunk. The balance loss pools its
// statistics over every chunk in the forward before any gradient; the indexer's KL is per query,
// its pooled keys' gradients gathered over the chunks that see each pool.
template <class T>
LossResult streamed_loss_and_gradients(const ModelConfig& config, const ModelWeights& weights,
                                       const std::vector<int32_t>& tokens, ModelWeights& grads,
                                       const LossOptions& options);

}  // namespace spindle
