// The planner: every policy it can choose for a config, length and machine, each with its
// predicted peak device and host memory and step time; the pick is the fastest that fits, so a
// memory saving (which always costs time) is used only at the length that needs it.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "model/config.h"
#include "plan/cost_model.h"
#include "plan/memory_model.h"
#include "plan/policy.h"

namespace spindle::plan {

// Device memory the allocator's counters never see: the CUDA context, cuBLASLt's workspaces
// (32 MiB per stream a Gemm serves: the model's, the head's, the four expert lanes'), the scratch
// output a Gemm times an accumulating product's algorithms into (at most 256 MiB, while it times a
// new plan's) and the caching allocator's exact-size blocks held between uses.
constexpr int64_t kDeviceReserveBytes = int64_t{2} << 30;

struct Machine {
  int64_t gpus = 1;
  int64_t gpu_bytes = 0;   // per GPU, as the driver reports it
  int64_t host_bytes = 0;  // host memory available to each GPU's process
};

struct Candidate {
  Policy policy;
  MemoryPrediction memory;
  StepTime time;
  double relative = 0;     // step time / the fastest candidate's
  std::string infeasible;  // why it does not fit; empty when it does
  bool fits() const { return infeasible.empty(); }
};

struct Plan {
  std::vector<Candidate> candidates;  // feasible first, fastest first; then the rest
  std::optional<size_t> pick;         // index into candidates
};

struct PlanRequest {
  int64_t tokens = 0;
  Machine machine;
  StepOptions options;
  Hardware hardware;
};

Plan make_plan(const ModelConfig& c, const PlanRequest& request);

// Streaming chunk lengths the planner tries: 4k, 16k, 64k and 256k tokens, those below `tokens`.
std::vector<int64_t> chunk_lengths(int64_t tokens);

// "12.3 GiB", for the planner's messages.
std::string gib_text(int64_t bytes);

}  // namespace spindle::plan
