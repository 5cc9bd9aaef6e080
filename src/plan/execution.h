// The policy a run executes: forced by the user (a chunk length, or --policy), or the planner's
// fastest that fits among the policies the CUDA executor runs unasked (keep, or stream in chunks;
// the optimizer on the device or the host; one GPU). `spindle bench` and `spindle train --device
// cuda` use it.
#pragma once

#include <cstdint>
#include <optional>
#include <string>

#include "model/backward.h"
#include "model/config.h"
#include "plan/planner.h"

namespace spindle::plan {

// What the planner may pick for the executor (every activation policy, on one GPU, gradients
// leaving after the backward); it predicts the others too (docs/PLANNER.md).
bool executor_runs(const Policy& policy);

// The fastest candidate of `plan` that fits and the executor runs (with the AdamW state where
// `optimizer_on_host` says, when it says); none when no such candidate fits.
const Candidate* fastest_runnable(const Plan& plan, std::optional<bool> optimizer_on_host = std::nullopt);

struct Execution {
  Policy policy;
  int64_t chunk_tokens = 0;  // for LossOptions::chunk_tokens; 0: the sequence in one pass
  SiteMemory site_memory = SiteMemory::KeepSites;  // for LossOptions::site_memory
  bool keep_selections = true;                     // for LossOptions::keep_selections
  bool keep_outputs = true;                        // for LossOptions::keep_outputs
  bool keep_kda_matrices = true;                   // for LossOptions::keep_kda_matrices
  bool rebuild_ffn_inputs = false;                 // for LossOptions::rebuild_ffn_inputs
  int64_t kda_projections_kept = 0;                // for LossOptions::kda_projections_kept
  int64_t predicted_peak_bytes = 0;                // device
  bool forced = false;                             // the user chose the policy
  std::string summary;                             // one line for the log
};

// forced_chunk: the user's --chunk (0 or >= tokens: no chunks). optimizer_on_host: where the
// AdamW state already is (a run of several lengths places it once), else the planner's choice.
// forced_activations: the user's --policy (KeepSites, KeepLayerInputs or OffloadLayerInputs;
// not with a forced chunk). forced_name: the planner's policy of that name (Policy::name, as
// spindle plan prints it), which the executor must run; alone. Fails with every policy's reason
// when none the executor runs fits.
Execution plan_execution(const ModelConfig& c, int64_t tokens, const Machine& machine,
                         const StepOptions& options, std::optional<int64_t> forced_chunk,
                         std::optional<bool> optimizer_on_host = std::nullopt,
                         std::optional<ActivationPolicy> forced_activations = std::nullopt,
                         const std::optional<std::string>& forced_name = std::nullopt);

// This process's GPU (`gpu_capacity` bytes, or the part of it the user's --gpu-mem gives the planner,
// which must not be more) and its host's memory.
Machine this_machine(int64_t gpu_capacity, std::optional<int64_t> planned_gpu_bytes);

// The execution's chunk and what its passes keep, into a run's loss options (the rest untouched).
void set_memory_options(const Execution& execution, LossOptions& options);

// --policy's names: keep, recompute, offload.
ActivationPolicy parse_site_policy(const std::string& name);

}  // namespace spindle::plan
