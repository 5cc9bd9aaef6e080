// Depthwise causal convolution + SiLU (the KDA short conv) on the GPU: activations in bf16
// [tokens, channels], weights in fp32 [channels, K] with K <= 8, math in fp32. CPU reference:
// cpu::causal_conv_silu and cpu::causal_conv_silu_backward (kernels/cpu/kda.h).
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>

namespace spindle::cuda {

// y[t, c] = silu(sum_j w[c, j] * x[t - (K - 1) + j, c]), zeros before the first token. x's rows are
// x_ld >= channels values apart, so that it can be columns of a wider buffer (the KDA projections
// side by side); y's are channels apart.
void causal_conv_silu(const __nv_bfloat16* x, int64_t x_ld, const float* w, __nv_bfloat16* y, int64_t tokens,
                      int64_t channels, int64_t kernel, cudaStream_t stream);

// causal_conv_silu, and also z = scale * y / sqrt(sum(y^2) + eps) over each head's head_dim channels
// (l2_normalize_forward of y's bf16 values) for y's rows from `skip` on: z [tokens - skip, channels].
// One pass where a head is 32, 64 or 128 channels and the alignment allows (the KDA's q and k).
void causal_conv_silu_l2(const __nv_bfloat16* x, int64_t x_ld, const float* w, __nv_bfloat16* y,
                         __nv_bfloat16* z, int64_t skip, int64_t tokens, int64_t channels, int64_t kernel,
                         int64_t head_dim, float eps, float scale, cudaStream_t stream);

// Backward: dx (bf16, written; its rows dx_ld >= channels values apart, so that it can fill
// columns of a wider buffer) and dw (fp32 [channels, K], accumulated: the caller zeroes it once
// per step); x's rows x_ld apart as the forward's, dy's channels apart. dw is reduced over a run of
// tokens per thread before one atomic per tap (or per four).
void causal_conv_silu_backward(const __nv_bfloat16* x, int64_t x_ld, const float* w, const __nv_bfloat16* dy,
                               __nv_bfloat16* dx, int64_t dx_ld, float* dw, int64_t tokens, int64_t channels,
                               int64_t kernel, cudaStream_t stream);

}  // namespace spindle::cuda
