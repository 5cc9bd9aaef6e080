// The policy a run executes: forced by the user (a chunk length), or the planner's fastest that
// fits among the policies today's CUDA executor runs (keep, or stream in chunks; the optimizer on
// the device; one GPU). `spindle bench` and `spindle train --device cuda` use it.
#pragma once

#include <cstdint>
#include <optional>
#include <string>

#include "model/config.h"
#include "plan/planner.h"

namespace spindle::plan {

// What the executor runs today; the planner predicts the others too (docs/PLANNER.md).
bool executor_runs(const Policy& policy);

struct Execution {
  Policy policy;
  int64_t chunk_tokens = 0;          // for LossOptions::chunk_tokens; 0: the sequence in one pass
  int64_t predicted_peak_bytes = 0;  // device
  bool forced = false;               // the user chose the chunk length
  std::string summary;               // one line for the log
};

// forced_chunk: the user's --chunk (0 or >= tokens: no chunks). Without it, fails with every
// policy's reason when none the executor runs fits the machine.
Execution plan_execution(const ModelConfig& c, int64_t tokens, const Machine& machine,
                         const StepOptions& options, std::optional<int64_t> forced_chunk);

}  // namespace spindle::plan
