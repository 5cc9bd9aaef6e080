// A memory policy the planner can choose: how a training step keeps what the backward pass
// needs, where the optimizer state lives, and the tensor-parallel degree (plan/parallel.h).
#pragma once

#include <cstdint>
#include <string>

namespace spindle::plan {

enum class ActivationPolicy {
  KeepSites,           // today's CUDA executor: every residual site's bf16 input streams on the device
  KeepLayerInputs,     // one input per layer; the feed-forward site's input is recomputed from it
  OffloadLayerInputs,  // the layer inputs in pinned host memory, copied back ahead of the backward
  Stream,              // the whole model over the sequence in chunks (docs/STREAMING.md)
};

struct Policy {
  ActivationPolicy activations = ActivationPolicy::KeepSites;
  int64_t chunk_tokens = 0;  // Stream only
  bool optimizer_on_host = false;
  int64_t tensor_parallel = 1;
  // With the optimizer on the host: each layer's fp32 gradients go out as the backward finishes
  // them (the device holds two layers' worth) instead of staying on the device until the step
  // ends (what backend/cuda/host_optimizer.h does today). Predicted only.
  bool gradients_to_host = false;
  // Stream only: the recomputation before each chunk's backward runs the indexer again instead of
  // reusing the forward's selections, kept as pool lists (less memory, more time).
  bool indexer_again = false;
  // Stream only: each sublayer's backward computes its forward's output once more (the sparse
  // attention's, the KDA recurrence's, the feed-forward's for its mHC combine) instead of keeping
  // it from the chunk's recomputation (less memory, more time).
  bool outputs_again = false;
  // Stream with kept outputs only: the KDA backward computes each chunk's intra-chunk matrices (A,
  // Aq, Tinv) once more instead of keeping them from the recomputation (3.4 GB for the 4B config
  // at 16k chunks; less memory, more time).
  bool kda_matrices_again = false;
  // Stream with kept outputs and KDA matrices only: each feed-forward site's input is made again
  // before its backward from the attention site's (one mHC combine) instead of kept, and what that
  // frees keeps the attention sublayers' outputs and the MoE's [gate | up] products, which their
  // backwards then do not compute again (LossOptions::rebuild_ffn_inputs; about 9 GB less at 16k
  // chunks for the 4B config, a combine per layer more and an output projection and the experts'
  // first products less).
  bool ffn_inputs_again = false;
  // Stream with kept outputs only: this many KDA layers, the last ones, keep their input projections
  // from the recomputation, which their backwards then do not multiply again
  // (LossOptions::kda_projections_kept; 0.2 GiB a layer at 16k chunks for the 4B config). The
  // planner gives each streamed policy the most layers that fit (planner.cpp).
  int64_t kda_projections_kept = 0;

  // e.g. "keep", "stream 64k", "stream 16k, indexer twice, outputs again", "stream 16k, KDA
  // matrices again", "offload + host AdamW", with " tp8" when tensor parallel.
  std::string name() const;
};

const char* activation_policy_name(ActivationPolicy policy);

}  // namespace spindle::plan
