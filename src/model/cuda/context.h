// What every GPU module call shares: the stream, the GEMM plans, the fused head, the expert
// permutation's workspace and the kernel record.
#pragma once

#include "backend/cuda/stream.h"
#include "kernels/cuda/gemm.h"
#include "kernels/cuda/lm_loss.h"
#include "kernels/cuda/moe_ops.h"
#include "model/cuda/kernel_record.h"

namespace spindle::cuda {

struct Context {
  explicit Context(bool strict_kernels = false) : record(strict_kernels) {}
  cudaStream_t stream() const { return stream_.get(); }
  void synchronize() const { stream_.synchronize(); }

  Stream stream_;
  Gemm gemm;
  LmHeadLoss head;
  ExpertPermutation permutation;
  KernelRecord record;
};

}  // namespace spindle::cuda
