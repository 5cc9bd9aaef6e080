#include "plan/execution.h"

#include <sstream>

#include "core/error.h"
#include "core/host_memory.h"

namespace spindle::plan {

namespace {

SiteMemory site_memory(ActivationPolicy policy) {
  switch (policy) {
    case ActivationPolicy::KeepLayerInputs:
      return SiteMemory::KeepLayerInputs;
    case ActivationPolicy::OffloadLayerInputs:
      return SiteMemory::OffloadLayerInputs;
    case ActivationPolicy::KeepSites:
    case ActivationPolicy::Stream:
      return SiteMemory::KeepSites;
  }
  return SiteMemory::KeepSites;
}

// forced_by: the option that forced it, or null for the planner's pick; host_bytes: the host memory
// the process may use (host_memory_bytes), next to the candidate's host peak.
Execution from(const Candidate& candidate, const char* forced_by, int64_t host_bytes) {
  Execution e;
  e.policy = candidate.policy;
  e.chunk_tokens =
      candidate.policy.activations == ActivationPolicy::Stream ? candidate.policy.chunk_tokens : 0;
  e.site_memory = site_memory(candidate.policy.activations);
  e.keep_selections = !candidate.policy.indexer_again;
  e.keep_outputs = !candidate.policy.outputs_again;
  e.keep_kda_matrices = e.keep_outputs && !candidate.policy.kda_matrices_again;
  e.rebuild_ffn_inputs = e.keep_kda_matrices && candidate.policy.ffn_inputs_again;
  e.kda_projections_kept = e.keep_outputs ? candidate.policy.kda_projections_kept : 0;
  e.predicted_peak_bytes = candidate.memory.device.peak_total;
  e.forced = forced_by != nullptr;
  e.summary =
      "policy " + candidate.policy.name() +
      (e.forced ? std::string(" (forced by ") + forced_by + ")" : std::string(" (the planner's pick)")) +
      ": predicted peak " + gib_text(e.predicted_peak_bytes) + " on the device, " +
      gib_text(candidate.memory.host) + " on the host (of " + gib_text(host_bytes) + ")" +
      (candidate.fits() ? "" : "; it does not fit: " + candidate.infeasible);
  return e;
}

}  // namespace

bool executor_runs(const Policy& policy) { return policy.tensor_parallel == 1 && !policy.gradients_to_host; }

const Candidate* fastest_runnable(const Plan& plan, std::optional<bool> optimizer_on_host) {
  for (const Candidate& candidate : plan.candidates)  // feasible first, fastest first
    if (candidate.fits() && executor_runs(candidate.policy) &&
        (!optimizer_on_host || candidate.policy.optimizer_on_host == *optimizer_on_host))
      return &candidate;
  return nullptr;
}

Machine this_machine(int64_t gpu_capacity, std::optional<int64_t> planned_gpu_bytes) {
  const int64_t bytes = planned_gpu_bytes.value_or(gpu_capacity);
  const auto gib = [](int64_t b) { return static_cast<double>(b) / static_cast<double>(int64_t{1} << 30); };
  check(bytes <= gpu_capacity, "--gpu-mem ", gib(bytes), " GiB is more than the ", gib(gpu_capacity),
        " GiB the GPU has");
  return {1, bytes, host_memory_bytes()};
}

ActivationPolicy parse_site_policy(const std::string& name) {
  if (name == "keep") return ActivationPolicy::KeepSites;
  if (name == "recompute") return ActivationPolicy::KeepLayerInputs;
  if (name == "offload") return ActivationPolicy::OffloadLayerInputs;
  fail("--policy must be keep, recompute or offload (--chunk N streams), got '", name, "'");
}

void set_memory_options(const Execution& execution, LossOptions& options) {
  options.chunk_tokens = execution.chunk_tokens;
  options.site_memory = execution.site_memory;
  options.keep_selections = execution.keep_selections;
  options.keep_outputs = execution.keep_outputs;
  options.keep_kda_matrices = execution.keep_kda_matrices;
  options.rebuild_ffn_inputs = execution.rebuild_ffn_inputs;
  options.kda_projections_kept = execution.kda_projections_kept;
}

Execution plan_execution(const ModelConfig& c, int64_t tokens, const Machine& machine,
                         const StepOptions& options, std::optional<int64_t> forced_chunk,
                         std::optional<bool> optimizer_on_host,
                         std::optional<ActivationPolicy> forced_activations,
                         const std::optional<std::string>& forced_name) {
  const auto runs = [&](const Policy& p) {
    return executor_runs(p) && (!optimizer_on_host || p.optimizer_on_host == *optimizer_on_host);
  };
  check(machine.gpus == 1, "the CUDA executor runs on one GPU; the planner plans more (spindle plan --gpus)");
  PlanRequest request;
  request.tokens = tokens;
  request.machine = machine;
  request.options = options;
  const Plan plan = make_plan(c, request);
  check(!(forced_chunk && forced_activations), "--chunk and --policy exclude each other (--chunk N streams)");
  if (forced_name) {
    check(!forced_chunk && !forced_activations, "--plan-policy excludes --chunk and --policy");
    for (const Candidate& candidate : plan.candidates) {
      if (candidate.policy.name() != *forced_name) continue;
      check(executor_runs(candidate.policy), "--plan-policy '", *forced_name,
            "': the planner predicts it, the executor does not run it");
      check(!optimizer_on_host || candidate.policy.optimizer_on_host == *optimizer_on_host, "--plan-policy '",
            *forced_name, "': the AdamW state is ", *optimizer_on_host ? "on the host" : "on the device",
            " for this run");
      return from(candidate, "--plan-policy", machine.host_bytes);
    }
    fail("the planner has no policy '", *forced_name, "' for ", tokens, " tokens (spindle plan lists them)");
  }
  if (forced_activations) {
    check(*forced_activations != ActivationPolicy::Stream, "a streamed policy is forced by --chunk N");
    Policy wanted;
    wanted.activations = *forced_activations;
    wanted.optimizer_on_host = optimizer_on_host.value_or(false);
    for (const Candidate& candidate : plan.candidates)
      if (candidate.policy.name() == wanted.name()) return from(candidate, "--policy", machine.host_bytes);
    fail("the planner has no policy '", wanted.name(), "' for ", tokens, " tokens");
  }
  if (forced_chunk) {
    check(*forced_chunk >= 0, "--chunk must be >= 0 tokens, got ", *forced_chunk);
    Policy wanted;
    wanted.optimizer_on_host = optimizer_on_host.value_or(false);
    if (*forced_chunk > 0 && *forced_chunk < tokens) {
      wanted.activations = ActivationPolicy::Stream;
      wanted.chunk_tokens = *forced_chunk;
    }
    // The planner predicts its own chunk lengths (4k, 16k, 64k, 256k), with the selections kept or
    // the indexer run twice: the faster that fits (candidates come feasible first, fastest first).
    // Another length runs as asked, without a prediction.
    for (const Candidate& candidate : plan.candidates) {
      const Policy& p = candidate.policy;
      if (p.activations == wanted.activations && p.chunk_tokens == wanted.chunk_tokens &&
          p.optimizer_on_host == wanted.optimizer_on_host && executor_runs(p))
        return from(candidate, "--chunk", machine.host_bytes);
    }
    Execution e;
    e.policy = wanted;
    e.chunk_tokens = wanted.chunk_tokens;
    e.forced = true;
    e.summary = "policy " + wanted.name() + " (forced by --chunk; no prediction for this chunk length)";
    return e;
  }
  if (const Candidate* pick = fastest_runnable(plan, optimizer_on_host))
    return from(*pick, nullptr, machine.host_bytes);
  std::ostringstream why;
  for (const Candidate& candidate : plan.candidates)
    if (runs(candidate.policy))
      why << "\n  " << candidate.policy.name() << ": " << (candidate.fits() ? "fits" : candidate.infeasible);
  fail("no policy that the executor runs fits ", tokens, " tokens on this machine (",
       gib_text(machine.gpu_bytes), " GPU, ", gib_text(machine.host_bytes), " host):", why.str(),
       "\n(spindle plan lists every policy; a shorter --seq-len or a larger GPU may fit)");
}

}  // namespace spindle::plan
