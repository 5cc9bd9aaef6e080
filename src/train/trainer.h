// `spindle train`: the training loop a person runs and resumes. Everything a run needs comes
// from RUN.toml (RunConfig); the loop is written out plainly:
//   for each step: micro-batches of windows -> loss and gradients (CPU reference path) ->
//   clip -> AdamW at the scheduled lr -> MoE bias update -> metrics, progress, checkpoints, eval.
#pragma once

#include <cstdint>
#include <optional>
#include <string>

#include "core/tensor.h"
#include "plan/policy.h"
#include "train/run_config.h"

namespace spindle {

struct TrainOptions {
  bool resume = false;          // continue from the newest checkpoint in checkpoint.dir
  int64_t stop_after = -1;      // stop (with a checkpoint) once this many steps are done, < 0: run all
  Device device = Device::CPU;  // cuda: bf16 weights, fp32 gradients and optimizer on the GPU
  bool strict_kernels = false;  // cuda: fail if an op falls back to a slow or dense path
  // cuda: tokens per chunk of the streaming executor (0: none); unset, the planner picks the
  // memory policy (plan/execution.h).
  std::optional<int64_t> chunk_tokens;
  // cuda: the AdamW state on the host (backend/cuda/host_optimizer.h); unset, where the planner
  // puts it.
  std::optional<bool> optimizer_on_host;
  // cuda: keep every site, recompute or offload the layer inputs (--policy); unset, the planner's.
  std::optional<plan::ActivationPolicy> site_policy;
  // cuda: plan for this many bytes of the GPU (--gpu-mem, as spindle plan's); unset, all it has.
  std::optional<int64_t> gpu_bytes;
};

// Runs the training; returns the directory of the final checkpoint.
std::string train(const RunConfig& run, const TrainOptions& options);

}  // namespace spindle
