// The whole model's forward pass on the CPU reference path, for one sequence of token ids.
#pragma once

#include <cstdint>
#include <functional>
#include <vector>

#include "model/config.h"
#include "model/weights.h"

namespace spindle {

struct ForwardOptions {
  // Tokens per block of the lm_head + log-softmax: bounds the logits buffer to block x vocab.
  int64_t head_block = 1024;
  // Called after each layer with its index (progress on long sequences; once per chunk).
  std::function<void(int64_t layer)> on_layer;
  // Called after each MoE layer (once per chunk) with the rows routed to each expert in that
  // chunk: tokens x top-k in all (`spindle route` measures the imbalance from these).
  std::function<void(int64_t layer, const std::vector<int64_t>& load)> on_expert_load;
  // Called after each DSA layer (once per chunk) with the selections of the chunk's queries, from
  // position `first`: [queries, width] token indices as cpu::indexer_select writes them (`spindle
  // select` measures how neighbouring queries' selections overlap).
  std::function<void(int64_t layer, int64_t first, const std::vector<int32_t>& selection)> on_selection;
  // Tokens per chunk of the streaming executor: the sequence goes through all layers a chunk at
  // a time, each layer carrying what later tokens need (KDA state and conv window, DSA keys and
  // values). 0: the whole sequence as one chunk. The result is the same either way.
  int64_t chunk_tokens = 0;
};

// log p(tokens[i] | tokens[<i]) for i = 1 .. n-1, computed in T (float or double). The weights
// must be stored in T's dtype.
template <class T>
std::vector<T> sequence_log_probs(const ModelConfig& config, const ModelWeights& weights,
                                  const std::vector<int32_t>& tokens, const ForwardOptions& options = {});

}  // namespace spindle
