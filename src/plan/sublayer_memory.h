// The device buffers of one sublayer call of the CUDA executor (model/cuda/kda.cpp, dsa.cpp,
// moe.cpp), replayed on a Ledger in the order the code allocates and frees them: every
// forward's buffers live until it returns; a backward first recomputes its forward's
// intermediates, then adds its gradients. Sizes are the per-GPU Shapes.
#pragma once

#include <cstdint>
#include <vector>

#include "plan/ledger.h"
#include "plan/parallel.h"

namespace spindle::plan {

// One pass over `tokens` query rows. The whole-sequence executor has context == tokens. A
// streamed chunk (streamed = true) sees `context` earlier-or-own tokens through the DSA caches,
// which it reads and accumulates gradients into in place (they are counted with the carried
// state, not here), with attention over the shared latent (absorbed MLA).
struct Pass {
  int64_t tokens = 0;
  int64_t context = 0;
  bool streamed = false;
  bool absorbed = false;    // MLA over the shared latent (--mla absorbed) rather than expanded heads
  bool indexer_kl = false;  // the indexer's KL training in the DSA backward
  // Streamed: the recomputation keeps each sublayer's output for its backward (Policy::outputs_again
  // false; LossOptions::keep_outputs).
  bool keep_outputs = false;
  // With keep_outputs: the KDA layers' intra-chunk matrices too (Policy::kda_matrices_again false).
  bool keep_kda_matrices = false;
  // With keep_outputs: the feed-forward sites' inputs made again, the attention sublayers' outputs
  // and the MoE's [gate | up] products kept (Policy::ffn_inputs_again).
  bool rebuild_ffn_inputs = false;
  // With keep_outputs: this many KDA layers, the last ones, keep their input projections too
  // (Policy::kda_projections_kept).
  int64_t kda_projections_kept = 0;
};

// Whether each layer keeps its KDA input projections: the last `kept` KDA layers (last_layers_of_kind,
// as the executor takes them).
std::vector<bool> kda_layers_keeping_projections(const Shapes& s, int64_t kept);

// What the streaming executor keeps of an attention sublayer's forward for its backward
// (AttentionKept, model/cuda/modules.h): KDA, the recurrence's output, fp32 chunk states and
// intra-chunk matrices (and with `projections`, its input projections); DSA, the absorbed
// attention's output and log-sum-exp.
std::vector<Ledger::Block> attention_kept(Ledger& m, const Shapes& s, const LayerShape& layer,
                                          const Pass& pass, bool projections);

// The forward of a layer's attention sublayer. With `select` (a DSA layer with its own indexer,
// not a recomputation) it returns the selection, which the caller keeps for the backward pass.
Ledger::Block attention_forward(Ledger& m, const Shapes& s, const LayerShape& layer, const Pass& pass,
                                bool select);
// `kept`: the forward's attention_kept blocks are live (the caller frees them) and not recomputed;
// `projections`: they hold the KDA input projections too.
void attention_backward(Ledger& m, const Shapes& s, const LayerShape& layer, const Pass& pass, bool kept,
                        bool projections);
// `keep_routing` (if not null, a MoE layer's): takes the routing's blocks that the streaming
// executor keeps for the backward (MoeRouting, model/cuda/modules.h).
void ffn_forward(Ledger& m, const Shapes& s, const LayerShape& layer, const Pass& pass,
                 std::vector<Ledger::Block>* keep_routing = nullptr);
// `kept_routing`: those blocks (freed here), with which the backward routes nothing again.
void ffn_backward(Ledger& m, const Shapes& s, const LayerShape& layer, const Pass& pass,
                  std::vector<Ledger::Block> kept_routing = {});

// Routed rows this GPU's experts compute for `tokens` tokens (the busiest GPU's share).
int64_t routed_rows(const Shapes& s, int64_t tokens);
// Selection width x 4 bytes per query: the int32 token indices a DSA layer attends to.
int64_t selection_bytes(const Shapes& s, int64_t tokens);
// The expert permutation's workspace (kernels/cuda/moe_ops.cu: an int32 count per expert and tile
// of 2,048 assignments).
int64_t permutation_workspace_bytes(const Shapes& s, int64_t tokens);

}  // namespace spindle::plan
