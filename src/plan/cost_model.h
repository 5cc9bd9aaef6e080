// A simple, explicit model of one training step's time on the busiest GPU, to rank policies
// (docs/PLANNER.md). Work is counted in forward passes of the model (model/flops.h): the
// executor does 5 - a per step, a the attention sites' share of a forward (the forward, the
// feed-forward recomputed for its mHC combine's backward, every sublayer recomputed inside its
// backward, and the backward itself, twice a forward), but the indexer's scores once (every
// recomputation reuses the forward's selection); two measured speeds (a fraction of peak for
// most FLOPs, a higher one for the indexer's scores) turn that into seconds. Each policy adds
// work or transfers:
//   recompute / offload: the attention site's forward once more per layer, to rebuild the
//     feed-forward site's input from the layer input;
//   offload: the layer inputs' copies over PCIe, overlapped with the forward (to the host) and
//     the backward (back); only what exceeds that pass's compute is added;
//   stream: one more forward without the indexer (each chunk is recomputed before its backward,
//     its selections kept as pool lists) plus a per-chunk cost (kernel launches of every layer
//     again, weights read again), less what the recomputation keeps for the backward (unless
//     "outputs again"): the feed-forward's recomputation for the combine, and the attention
//     cores' (KDA recurrence, sparse attention) inside the backward, and the KDA backward's
//     intra-chunk matrices (unless "KDA matrices again", a measured time per token); with
//     "feed-forward inputs again" also the attention's output projections and the MoE's [gate | up]
//     products, for a combine per layer (at HBM speed) that makes each feed-forward site's input;
//     with KDA projections kept, those layers' input projections in their backward (at the
//     products' measured rate);
//   host AdamW: the update on the CPU at host-memory speed, the weights back over PCIe, and the
//     gradients out over PCIe (once per chunk when streaming) beyond the backward's compute;
//   tensor parallel t: attention, dense MLP and head work / t, plus all-reduces over NVLink;
//   expert parallel: the busiest GPU's routed rows, and each MoE layer's all-reduce over all GPUs.
// Communication is not overlapped (conservative).
#pragma once

#include <cstdint>
#include <string>

#include "model/config.h"
#include "plan/parallel.h"
#include "plan/policy.h"
#include "plan/state_memory.h"

namespace spindle::plan {

struct Hardware {
  double peak_flops = 989e12;  // dense bf16 FLOP/s of an H100/H200 SXM
  // Measured speeds of today's executor, fitted to the 4B config's 1M step on the H200 (docs/PLANNER.md
  // "Step time"): model FLOPs without the indexer's scores at 21.05% of peak (counted as 5 passes,
  // see kCalibrationPasses), the indexer's quadratic scores with their selection, which run once
  // per step, at 40%. Fitted to stream 16k, feed-forward inputs again, KDA projections kept in 30
  // layers + host AdamW: 76.09 s, a warm step from a trained checkpoint at 1af4691, its indexer
  // 7.73 s (2026-12-07; 78.7 s predicted at the rates before). Earlier fits: 20.35% and 38% at
  // 1b89334 (81.17 s, the indexer 8.21 s; 33.3% before the scorer's wave-filling splits), fitted
  // to 025590b's 81.50 s, where stream 16k + host AdamW took 83.52 s, predicted 85.7: the kept
  // products saved 2.0 s, not the 4.2 predicted, as the MoE's products run faster than the average
  // rate; 20.6% at a265920 (84.99 s), 20.4% and 30.6% at f4bf5af (86.19 s, the indexer 10.22 s),
  // 11.5% and 34% from random weights at cac0719, before the union form (139.05 s, the indexer 9.3
  // s). The indexer's KL training
  // (`--indexer-kl`) adds the attention's mass over the selection and the KL's gradient, counted as
  // the sparse attention's forward FLOPs in the layers with their own indexer at 14%: 88.96 s with
  // it at f4bf5af (89.2 predicted), 85.38 s at 025590b (84.3 predicted).
  double mfu = 0.2105;
  double indexer_mfu = 0.40;
  double indexer_kl_mfu = 0.14;
  double pcie_bytes_per_s = 50e9;
  // Each way with both ways busy and the host updating beside the copies: the host AdamW's device
  // share (2.5 B values' state, 30 GB each way, with the host share's gradients and weights) took
  // about 1.2 s of a 1.22 s optimizer on the H100 machine (the 4B config at 256k, 2026-12-07).
  double pcie_both_ways_bytes_per_s = 30e9;
  double hbm_bytes_per_s = 4.8e12;
  double nvlink_bytes_per_s = 450e9;  // all-reduce bus bandwidth inside a node
  double network_bytes_per_s = 50e9;  // per GPU across nodes (400 Gb/s)
  // The host AdamW update, 28 bytes per parameter: 1.81 s per step with its copies for the 4B
  // config on the H200 machine's 16 cores (8c5e036, the 1M step: vectorised and pipelined; 5.0-6.4
  // s before).
  double host_adam_bytes_per_s = 65e9;
  // Pinning host memory (cudaHostAlloc of the offload pool), once, in the first step: 96.6 GB in
  // about 45 s on the H200 machine (the 4B config at 128k, 5bdf894: 70.3 s first step, 24.9 s after).
  double pin_bytes_per_s = 2.1e9;
  double launch_seconds = 5e-6;  // one kernel launch
  // A KDA layer's intra-chunk matrices computed once more in its backward (Policy::kda_matrices_again),
  // per token and head (dk = dv = 128): build/bench_kda at 16,384 tokens and 16 heads, H200,
  // 2026-12-02, 79f708c: backward 5.56 -> 5.07 ms with the matrices kept, the forward that keeps
  // them 0.04 ms longer.
  double kda_matrices_seconds_per_token_head = 0.45e-3 / (16384.0 * 16);
  // The KDA layer's input projections (x times q, k, v and the low-rank gates' stacked weights),
  // which a layer keeping them (Policy::kda_projections_kept) does not compute again in its
  // backward: build/bench_gemm_shapes' "KDA q, k, v stacked (N 6144)" at 16k rows, H200, 2026-12-04:
  // 0.537 ms, 767 TFLOP/s.
  double kda_projection_flops_per_s = 767e12;
};

struct StepTime {
  double compute = 0;         // GPU work at the measured MFU
  double chunks = 0;          // streaming's per-chunk cost
  double exposed_copies = 0;  // offload copies beyond the compute they overlap
  double copies = 0;          // offload copies in all (each way), for the note
  double communication = 0;   // all-reduces
  double optimizer = 0;       // host AdamW
  double total() const { return compute + chunks + exposed_copies + communication + optimizer; }
};

StepTime step_time(const ModelConfig& c, const Parallel& parallel, const StateBytes& state, int64_t tokens,
                   const Policy& policy, const Hardware& hardware, bool indexer_kl);

// Forward passes of work per step (see above) for a sequence of `tokens`; attention_share: the
// attention sites' share of a forward's FLOPs; core_share: the KDA recurrence's and sparse
// attention's share of theirs; rebuilt_share: the share of a forward that Policy::ffn_inputs_again
// keeps for the backward (the attention's output projections, the MoE's [gate | up] products).
double forward_passes(const Policy& policy, int64_t tokens, double attention_share, double core_share,
                      double rebuilt_share = 0);

}  // namespace spindle::plan
