// What the KDA kernels (kda.cu, kda_backward.cu) share: loading one chunk of a head.
#pragma once

#include <cuda_bf16.h>

#include <cstdint>

namespace spindle::cuda {

// k (and q, unless qs is null) of tokens [t0, t0 + n) of head h as fp32, and G_t = sum_{s<=t} g_s
// (the per-channel prefix sums of the log decays), into [C, stride] shared tiles; glast (unless
// null) gets G of the chunk's last token. Every thread of the CTA calls it; it ends with a barrier.
__device__ inline void load_chunk_with_prefix(const __nv_bfloat16* __restrict__ q,
                                              const __nv_bfloat16* __restrict__ k,
                                              const float* __restrict__ g, int64_t t0, int n, int h,
                                              int heads, int dk, int stride, float* qs, float* ks, float* Gs,
                                              float* glast) {
  for (int idx = threadIdx.x; idx < n * dk; idx += blockDim.x) {
    const int t = idx / dk, i = idx - t * dk;
    const int64_t src = ((t0 + t) * heads + h) * dk + i;
    if (qs != nullptr) qs[t * stride + i] = __bfloat162float(q[src]);
    ks[t * stride + i] = __bfloat162float(k[src]);
    Gs[t * stride + i] = g[src];
  }
  __syncthreads();
  for (int i = threadIdx.x; i < dk; i += blockDim.x) {
    float run = 0.0f;
    for (int t = 0; t < n; ++t) {
      run += Gs[t * stride + i];
      Gs[t * stride + i] = run;
    }
    if (glast != nullptr) glast[i] = run;
  }
  __syncthreads();
}

}  // namespace spindle::cuda
