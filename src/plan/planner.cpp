#include "plan/planner.h"

#include <algorithm>
#include <cstdio>
#include <utility>

#include "core/error.h"

namespace spindle::plan {

std::string gib_text(int64_t bytes) {
  char text[32];
  std::snprintf(text, sizeof text, "%.1f GiB", static_cast<double>(bytes) / (1 << 30));
  return text;
}

namespace {

std::vector<Policy> policies(const ModelConfig& c, int64_t tokens, int64_t gpus) {
  std::vector<Policy> out;
  for (int64_t t = 1; t <= std::min(gpus, kGpusPerNode); t *= 2) {
    if (!tensor_degree_fits(c, t)) continue;
    // The optimizer on the device, on the host, or on the host with the gradients too.
    for (const auto& [host, gradients] :
         {std::pair{false, false}, std::pair{true, false}, std::pair{true, true}}) {
      for (const ActivationPolicy a : {ActivationPolicy::KeepSites, ActivationPolicy::KeepLayerInputs,
                                       ActivationPolicy::OffloadLayerInputs})
        out.push_back({a, 0, host, t, gradients});
      // Kept outputs with the KDA matrices (and the feed-forward inputs made again, or not), kept
      // outputs without them, or nothing kept.
      struct Kept {
        bool outputs_again, matrices_again, ffn_inputs_again;
      };
      for (const int64_t chunk : chunk_lengths(tokens))
        for (const bool again : {false, true})
          for (const Kept k : {Kept{false, false, false}, Kept{false, false, true}, Kept{false, true, false},
                               Kept{true, false, false}})
            out.push_back({ActivationPolicy::Stream, chunk, host, t, gradients, again, k.outputs_again,
                           k.matrices_again, k.ffn_inputs_again});
    }
  }
  return out;
}

}  // namespace

std::vector<int64_t> chunk_lengths(int64_t tokens) {
  std::vector<int64_t> out;
  for (int64_t chunk = 4096; chunk <= 262144 && chunk < tokens; chunk *= 4) out.push_back(chunk);
  return out;
}

Plan make_plan(const ModelConfig& c, const PlanRequest& r) {
  check(r.tokens >= 2, "--seq-len must be at least 2 tokens, got ", r.tokens);
  check(r.machine.gpus >= 1, "--gpus must be at least 1, got ", r.machine.gpus);
  check(r.machine.gpu_bytes > kDeviceReserveBytes, "--gpu-mem must exceed the ",
        gib_text(kDeviceReserveBytes), " kept for the CUDA context and libraries, got ",
        gib_text(r.machine.gpu_bytes));
  check(r.machine.host_bytes > 0, "--host-mem must be positive");
  check(r.hardware.mfu > 0 && r.hardware.mfu <= 1, "--mfu must be in (0, 1], got ", r.hardware.mfu);
  const int64_t usable = r.machine.gpu_bytes - kDeviceReserveBytes;

  Plan plan;
  for (const Policy& base : policies(c, r.tokens, r.machine.gpus)) {
    const Parallel parallel{r.machine.gpus, base.tensor_parallel};
    const Shapes shapes = gpu_shapes(c, parallel);
    const StateBytes state = state_bytes(c, parallel);
    const auto candidate = [&](const Policy& policy) {
      Candidate x;
      x.policy = policy;
      x.memory = predict_memory(shapes, state, r.tokens, policy, r.options);
      x.time = step_time(c, parallel, state, r.tokens, policy, r.hardware, r.options.indexer_kl);
      if (x.memory.device.peak_total > usable)
        x.infeasible =
            "device " + gib_text(x.memory.device.peak_total) + " > " + gib_text(usable) + " usable";
      else if (x.memory.host > r.machine.host_bytes)
        x.infeasible = "host " + gib_text(x.memory.host) + " > " + gib_text(r.machine.host_bytes);
      return x;
    };
    plan.candidates.push_back(candidate(base));
    // A streamed policy that keeps outputs and fits: again with the most KDA layers keeping their
    // input projections that still fit (the peak grows with them).
    if (!plan.candidates.back().fits() || base.activations != ActivationPolicy::Stream || base.outputs_again)
      continue;
    const auto fits_with = [&](int64_t layers) {
      Policy p = base;
      p.kda_projections_kept = layers;
      return predict_memory(shapes, state, r.tokens, p, r.options).device.peak_total <= usable;
    };
    int64_t low = 0, high = std::count(c.layer_types.begin(), c.layer_types.end(), AttentionKind::Kda);
    while (low < high) {  // the most layers that fit: fits_with(low) holds throughout
      const int64_t mid = (low + high + 1) / 2;
      if (fits_with(mid))
        low = mid;
      else
        high = mid - 1;
    }
    if (low == 0) continue;
    Policy filled = base;
    filled.kda_projections_kept = low;
    plan.candidates.push_back(candidate(filled));
  }
  std::stable_sort(plan.candidates.begin(), plan.candidates.end(),
                   [](const Candidate& a, const Candidate& b) {
                     if (a.fits() != b.fits()) return a.fits();
                     if (a.time.total() != b.time.total()) return a.time.total() < b.time.total();
                     return a.memory.device.peak_total < b.memory.device.peak_total;
                   });
  double fastest = plan.candidates.front().time.total();
  for (const Candidate& x : plan.candidates) fastest = std::min(fastest, x.time.total());
  for (Candidate& x : plan.candidates) x.relative = x.time.total() / fastest;
  if (plan.candidates.front().fits()) plan.pick = 0;
  return plan;
}

}  // namespace spindle::plan
