// KDA's gate activations on the GPU (model/kda.cpp, kda_forward and kda_backward): the per-channel
// log decay g from the forget-gate projection, and the sigmoid of beta. fp32 in, fp32 math;
// gradients with respect to projection outputs in bf16 (they feed bf16 GEMMs), parameter
// gradients fp32 and accumulated (the caller zeroes them once per step).
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>

namespace spindle::cuda {

// bounded: the config has linear_lower_bound (lower_bound is its value).
struct KdaDecayShape {
  int64_t tokens, heads, head_dim;
  bool bounded;
  float lower_bound;
};

// f: [tokens, heads * head_dim] (f_b_proj's output), dt_bias [heads * head_dim], A_log [heads].
// With pre = f + dt_bias and rate = exp(A_log[h]): g = lower_bound * sigmoid(rate * pre) if
// bounded, else -rate * softplus(pre) (softplus passes pre through above 20). g written (it must not
// alias f).
void kda_decay_forward(const KdaDecayShape& s, const float* f, const float* dt_bias, const float* A_log,
                       float* g, cudaStream_t stream);

// From dg (the gradient of g): df (the gradient of pre, so of f and of dt_bias) written;
// d_dt_bias and d_A_log accumulated. No output aliases an input.
void kda_decay_backward(const KdaDecayShape& s, const float* f, const float* dt_bias, const float* A_log,
                        const float* dg, __nv_bfloat16* df, float* d_dt_bias, float* d_A_log,
                        cudaStream_t stream);

// y = 1 / (1 + exp(-x)) over n values.
void sigmoid_forward(const float* x, float* y, int64_t n, cudaStream_t stream);

// dx = dy * y * (1 - y) from the forward output y.
void sigmoid_backward(const float* y, const float* dy, __nv_bfloat16* dx, int64_t n, cudaStream_t stream);

}  // namespace spindle::cuda
