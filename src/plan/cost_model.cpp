#include "plan/cost_model.h"

#include <algorithm>
#include <cmath>

#include "model/flops.h"
#include "train/adamw.h"

namespace spindle::plan {

namespace {

// The convention Hardware's rates are stated in: a step's 3 forwards of model FLOPs over 5 passes
// (the forward, two recomputations of every sublayer in the backward, and the backward (2): the
// executor when the rates were first fitted; it now does 5 - the attention share, forward_passes).
constexpr double kCalibrationPasses = 5;
constexpr double kKernelsPerSublayerPass = 50;  // launches of one sublayer's pass, about
// A streamed chunk's passes per sublayer: forward, recomputation, backward; the feed-forward's
// also once more for its site's combine, unless the recomputation kept its output.
constexpr double kAttentionPassesPerChunk = 3;
constexpr double kFfnPassesPerChunk = 4;

// A forward's FLOPs on the busiest GPU: the indexer's scores apart (quadratic in the length, on
// the tensor cores at a higher rate than the rest), and the attention sites' share of the rest.
struct Work {
  double forward = 0;  // without the indexer's scores
  double indexer = 0;
  double trained_attention = 0;  // the attention over the selections of the layers with their own indexer
  double attention_share = 0;
  double core_share = 0;  // of the attention sites': the KDA recurrence and the sparse attention
  // Of the forward: the attention sublayers' output projections and the MoE's [gate | up]
  // products (routed and shared), which Policy::ffn_inputs_again keeps for their backwards.
  double rebuilt_share = 0;
};

Work gpu_work(const ModelConfig& c, const Parallel& p, int64_t tokens) {
  const double L = static_cast<double>(tokens), D = static_cast<double>(c.hidden_size);
  const double t = static_cast<double>(p.tensor);
  double ffn = 0, experts = 0, dsa_layers = 0, own_indexers = 0, outputs = 0, shared_gate_up = 0;
  for (size_t i = 0; i < c.layer_types.size(); ++i) {
    if (c.layer_types[i] == AttentionKind::Dsa) {
      ++dsa_layers;
      if (c.indexer_types[i] == IndexerKind::Full) ++own_indexers;
      outputs += 2 * static_cast<double>(c.num_attention_heads * c.v_head_dim) * D * L;
    } else {
      outputs += 2 * static_cast<double>(c.linear_qkv_dim()) * D * L;
    }
    if (c.mlp_layer_types[i] == MlpKind::Dense) {
      ffn += 2 * 3 * D * static_cast<double>(c.intermediate_size) * L;
    } else {
      const double I = static_cast<double>(c.moe_intermediate_size);
      const double routed = 2 * 3 * D * I * static_cast<double>(c.num_experts_per_tok) * L;
      experts += routed;
      shared_gate_up += 2 * 2 * D * I * static_cast<double>(c.n_shared_experts) * L;
      ffn += routed + 2 *
                          (D * static_cast<double>(c.n_routed_experts) +
                           static_cast<double>(c.n_shared_experts) * 3 * D * I) *
                          L;
    }
  }
  const double head = 2 * D * static_cast<double>(c.vocab_size) * L;
  const ModelFlops flops = model_flops(c, tokens);
  const double attention = flops.forward() - flops.indexer - ffn - head;  // mHC and norms included
  const double busiest = p.routed_rows_per_token(c) / static_cast<double>(c.num_experts_per_tok);
  Work w;
  w.forward = (attention + ffn - experts + head) / t + experts * busiest;
  w.indexer = flops.indexer / t;
  // Every DSA layer attends over as many selected keys; the KL trains only the layers' own indexers.
  w.trained_attention = dsa_layers > 0 ? flops.attention * own_indexers / dsa_layers / t : 0;
  w.attention_share = attention / t / w.forward;
  w.core_share = attention > 0 ? (flops.kda + flops.attention) / attention : 0;
  // The routed experts' [gate | up] is two of their three products.
  w.rebuilt_share = (outputs / t + shared_gate_up / t + experts * busiest * 2 / 3) / w.forward;
  return w;
}

// Seconds of one all-reduce of `bytes` over `gpus` GPUs (ring: 2 (n - 1) / n of the bytes).
double all_reduce(double bytes, int64_t gpus, const Hardware& h) {
  if (gpus <= 1) return 0;
  const double n = static_cast<double>(gpus);
  const double bandwidth = gpus <= kGpusPerNode ? h.nvlink_bytes_per_s : h.network_bytes_per_s;
  return 2 * (n - 1) / n * bytes / bandwidth;
}

}  // namespace

double forward_passes(const Policy& policy, int64_t tokens, double attention_share, double core_share,
                      double rebuilt_share) {
  // The attention sites' backward writes their output for the combine: one recomputation less.
  const double keep = kCalibrationPasses - attention_share;
  switch (policy.activations) {
    case ActivationPolicy::KeepSites:
      return keep;
    case ActivationPolicy::KeepLayerInputs:
    case ActivationPolicy::OffloadLayerInputs:
      // Every sublayer once more, from its layer's input, on top of keep's recomputations inside
      // each sublayer's backward (these keep no outputs): streaming's "outputs again". Measured at
      // 128k: offload 24.4 s, stream 16k with kept outputs 20.8 s (docs/PERF.md).
      return keep + 1;
    case ActivationPolicy::Stream: {
      // The forward pass takes every chunk but the last (whose recomputation is its forward; without
      // the balance loss, the default). Kept outputs spare the feed-forward's recomputation for the
      // combine and, inside each attention sublayer's backward, its core's (its projections still
      // run again).
      const double chunks = std::ceil(static_cast<double>(tokens) / static_cast<double>(policy.chunk_tokens));
      return keep + (chunks - 1) / chunks -
             (policy.outputs_again ? 0 : 1 - attention_share + attention_share * core_share) -
             (policy.ffn_inputs_again ? rebuilt_share : 0);
    }
  }
  return keep;
}

StepTime step_time(const ModelConfig& c, const Parallel& p, const StateBytes& state, int64_t tokens,
                   const Policy& policy, const Hardware& h, bool indexer_kl) {
  const Work work = gpu_work(c, p, tokens);
  const double passes =
      forward_passes(policy, tokens, work.attention_share, work.core_share, work.rebuilt_share);
  // The measured rate counts 3 forwards of model FLOPs per step of the calibration's 5 passes.
  const double seconds_per_pass = 3 * work.forward / h.mfu / h.peak_flops / kCalibrationPasses;
  // The indexer's scores run once per step, in the forward: every recomputation reuses the
  // selection (kept whole, or as pool lists when streaming), unless streaming runs it again.
  const double indexer = (policy.indexer_again ? 2 : 1) * work.indexer / h.indexer_mfu / h.peak_flops;
  StepTime time;
  time.compute = passes * seconds_per_pass + indexer;
  if (indexer_kl) time.compute += work.trained_attention / h.indexer_kl_mfu / h.peak_flops;
  if (policy.activations == ActivationPolicy::Stream && !policy.outputs_again && policy.kda_matrices_again) {
    const auto kda_layers =
        static_cast<double>(std::count(c.layer_types.begin(), c.layer_types.end(), AttentionKind::Kda));
    time.compute += kda_layers * static_cast<double>(tokens) *
                    static_cast<double>(gpu_shapes(c, p).kda_heads) * h.kda_matrices_seconds_per_token_head;
  }
  if (policy.activations == ActivationPolicy::Stream && !policy.outputs_again) {
    const double width = static_cast<double>(3 * c.linear_qkv_dim() + 2 * c.linear_head_dim);
    time.compute -= static_cast<double>(policy.kda_projections_kept) * 2 * static_cast<double>(tokens) *
                    static_cast<double>(c.hidden_size) * width / h.kda_projection_flops_per_s;
  }
  const double forward = seconds_per_pass + indexer, backward = (passes - 1) * seconds_per_pass;
  const double L = static_cast<double>(tokens);
  const double layers = static_cast<double>(c.num_hidden_layers);
  const double chunks = policy.activations == ActivationPolicy::Stream
                            ? static_cast<double>((tokens + policy.chunk_tokens - 1) / policy.chunk_tokens)
                            : 1;

  if (policy.ffn_inputs_again) {  // a combine per layer: the streams read and written, y read
    const double H = static_cast<double>(c.hc_mult), D = static_cast<double>(c.hidden_size);
    time.compute += static_cast<double>(c.num_hidden_layers) * static_cast<double>(tokens) * (2 * H + 1) * D *
                    2 / h.hbm_bytes_per_s;
  }
  if (policy.activations == ActivationPolicy::Stream) {
    const double ffn_passes = kFfnPassesPerChunk - (policy.outputs_again ? 0 : 1);
    const double launches = layers * (kAttentionPassesPerChunk + ffn_passes) * kKernelsPerSublayerPass;
    // Most of the weights are the experts'.
    const double weights = ffn_passes * static_cast<double>(state.weights) / h.hbm_bytes_per_s;
    time.chunks = chunks * (launches * h.launch_seconds + weights);
  }
  if (policy.activations == ActivationPolicy::OffloadLayerInputs) {
    const double bytes = layers * L * static_cast<double>(c.hc_mult * c.hidden_size) * 2;
    time.copies = bytes / h.pcie_bytes_per_s;
    time.exposed_copies = std::max(0.0, time.copies - forward) + std::max(0.0, time.copies - backward);
  }

  // All-reduces: a sublayer's output in each forward-like pass, its input's gradient (fp32) in
  // the backward. Attention and dense MLP sites over the tensor-parallel group; MoE sites over
  // every GPU (the routed experts' and the shared expert's partial sums together).
  const double site_bytes = ((passes - 2) * 2 + 4) * L * static_cast<double>(c.hidden_size);
  for (size_t i = 0; i < c.layer_types.size(); ++i) {
    time.communication += all_reduce(site_bytes, p.tensor, h);
    const int64_t ffn_group = c.mlp_layer_types[i] == MlpKind::Sparse ? p.gpus : p.tensor;
    time.communication += all_reduce(site_bytes, ffn_group, h);
  }

  if (policy.optimizer_on_host) {
    const double params = static_cast<double>(state.parameters);
    if (policy.gradients_to_host) {
      // The gradients out layer by layer during the backward (once per chunk when streaming),
      // beyond the backward's time, then the update on the host (read grad, master, m, v; write
      // master, m, v; the bf16 weight) and the weights back.
      const double update = 28 * params / h.host_adam_bytes_per_s,
                   weights_back = 2 * params / h.pcie_bytes_per_s;
      time.optimizer =
          std::max(0.0, 4 * params / h.pcie_bytes_per_s * chunks - backward) + std::max(update, weights_back);
    } else {
      // backend/cuda/host_optimizer.h: the host updates its share, with its fp32 gradients out and
      // its weights back pipelined under the update (the first batch's gradients before it); the
      // device updates the rest, their masters and moments up and back (12 bytes a value each way)
      // beside it. Each direction of PCIe carries its part of both.
      const double host = kHostAdamWHostShare * params, device = params - host;
      const double update = 28 * host / h.host_adam_bytes_per_s,
                   down = (4 * host + 12 * device) / h.pcie_both_ways_bytes_per_s,
                   up = (2 * host + 12 * device) / h.pcie_both_ways_bytes_per_s;
      time.optimizer = 4 * host / h.pcie_bytes_per_s / kHostAdamWBatches + std::max({update, down, up});
    }
  }
  return time;
}

}  // namespace spindle::plan
