// What every GPU module call shares: the stream, the GEMM plans, the fused head, the expert
// permutation's workspace and the experts' side streams, the kernel record and the timer.
#pragma once

#include <cstdlib>
#include <string>

#include "backend/cuda/stream.h"
#include "kernels/cuda/gemm.h"
#include "kernels/cuda/lm_loss.h"
#include "kernels/cuda/moe_ops.h"
#include "model/cuda/expert_lanes.h"
#include "model/cuda/kernel_record.h"
#include "model/cuda/kind_timer.h"

namespace spindle::cuda {

// Whether the environment variable is set to "0".
inline bool env_says_off(const char* name) {
  const char* value = std::getenv(name);
  return value != nullptr && std::string(value) == "0";
}

struct Context {
  explicit Context(bool strict_kernels = false, bool absorbed = false)
      : absorbed_mla(absorbed),
        union_attention(absorbed && !env_says_off("SPINDLE_UNION_ATTENTION")),
        record(strict_kernels) {}
  cudaStream_t stream() const { return stream_.get(); }
  void synchronize() const { stream_.synchronize(); }

  // DSA attention over the shared kv_lora_rank-wide latent (MLA's absorbed form), or over
  // per-head keys and values expanded by kv_b_proj first. Same function, different cost.
  bool absorbed_mla;
  // With the absorbed form's latent cache, each chunk's selected tokens' keys and values expanded
  // where few are distinct (docs/UNION_ATTENTION.md): on unless SPINDLE_UNION_ATTENTION=0 in the
  // environment (to measure the absorbed kernels alone).
  bool union_attention;
  Stream stream_;
  Gemm gemm;
  LmHeadLoss head;
  ExpertPermutation permutation;
  ExpertLanes lanes;  // side streams for the routed experts' products
  KernelRecord record;
  KindTimer* timer = nullptr;  // GPU time per kind of work, when someone is measuring

  TimedScope timed(const char* kind) { return TimedScope(timer, kind, stream()); }
};

}  // namespace spindle::cuda
