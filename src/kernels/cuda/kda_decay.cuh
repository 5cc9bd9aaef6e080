// The KDA decay's elementwise math, shared by its own passes (kda_gates.cu) and by the KDA
// backward's grad kernel, which takes the decay's backward into its last loop (kda_backward.cu).
#pragma once

#include <cuda_runtime.h>

namespace spindle::cuda {

__device__ __forceinline__ float decay_sigmoid(float a) { return 1.0f / (1.0f + expf(-a)); }

// softplus, passing a through above 20.
__device__ __forceinline__ float softplus_thresholded(float a) {
  const float smooth = log1pf(expf(a));
  return a > 20.0f ? a : smooth;
}

// g's gradient dg taken back to pre = f + dt_bias (returned), with rate = exp(A_log) of the head:
// bounded (g = lower_bound sigmoid(rate pre)), with u = rate pre and sg = sigmoid(u): du = dg lb sg
// (1 - sg), dpre = du rate, and drate += du pre; else (g = -rate softplus(pre)) dpre = -rate
// sigmoid(pre) dg (slope 1 above 20), and drate -= softplus(pre) dg. d_A_log = sum drate rate.
template <bool kBounded>
__device__ __forceinline__ float decay_pre_gradient(float lower_bound, float rate, float pre, float dg,
                                                    float& drate) {
  if constexpr (kBounded) {
    const float sg = decay_sigmoid(rate * pre);
    const float du = dg * lower_bound * sg * (1.0f - sg);
    drate += du * pre;
    return du * rate;
  } else {
    const float slope = decay_sigmoid(pre);
    drate -= softplus_thresholded(pre) * dg;
    return -rate * (pre > 20.0f ? 1.0f : slope) * dg;
  }
}

}  // namespace spindle::cuda
