// The CUDA backend's operations (device pointers; bf16 storage, fp32 accumulation, fp32
// optimizer state). Each has a CPU reference in kernels/cpu that tests compare it with.
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "core/adamw_constants.h"

namespace spindle::cuda {

struct AdamWStep {
  float lr, beta1, beta2, eps, weight_decay;
  int64_t step;  // 1-based update number, for the bias correction
};

// One fused AdamW update of n values: fp32 master, moments and gradient; the bf16 weight is
// written from the master. PyTorch semantics (decoupled decay, bias correction). A parameter
// kept in fp32 is its own master: pass it as `master` and weight = nullptr.
void adamw_update(float* master, float* exp_avg, float* exp_avg_sq, const float* grad, __nv_bfloat16* weight,
                  int64_t n, const AdamWStep& step, cudaStream_t stream);

// The host AdamW's update of n values bit for bit, with its constants (train/adamw.h's
// AdamW::constants): fp32 master and moments (on the device for the call), the weight bf16 or fp32.
void adamw_update_exact(const AdamWConstants& constants, const float* grad, float* master, float* exp_avg,
                        float* exp_avg_sq, void* weight, bool bf16_weight, int64_t n, cudaStream_t stream);

// *sum (device double) += sum of x[i]^2 over n values: the gradients' global norm.
void sum_squares(const float* x, int64_t n, double* sum, cudaStream_t stream);

// x *= factor over n values.
void scale_values(float* x, int64_t n, float factor, cudaStream_t stream);

}  // namespace spindle::cuda
