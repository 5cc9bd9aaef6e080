// What every GPU module call shares: the stream, the GEMM plans, the fused head, the expert
// permutation's workspace and the experts' side streams, the kernel record and the timer.
#pragma once

#include <cstdlib>

#include "backend/cuda/stream.h"
#include "kernels/cuda/gemm.h"
#include "kernels/cuda/lm_loss.h"
#include "kernels/cuda/moe_ops.h"
#include "model/cuda/expert_lanes.h"
#include "model/cuda/kernel_record.h"
#include "model/cuda/kind_timer.h"

namespace spindle::cuda {

struct Context {
  explicit Context(bool strict_kernels = false, bool absorbed = false)
      : absorbed_mla(absorbed),
        union_attention(absorbed && std::getenv("SPINDLE_UNION_ATTENTION") != nullptr),
        record(strict_kernels) {}
  cudaStream_t stream() const { return stream_.get(); }
  void synchronize() const { stream_.synchronize(); }

  // DSA attention over the shared kv_lora_rank-wide latent (MLA's absorbed form), or over
  // per-head keys and values expanded by kv_b_proj first. Same function, different cost.
  bool absorbed_mla;
  // With the absorbed form's latent cache, each chunk's selected tokens' keys and values expanded
  // where few are distinct (docs/UNION_ATTENTION.md, version 1): SPINDLE_UNION_ATTENTION set in the
  // environment, while it is measured against the absorbed kernels.
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
