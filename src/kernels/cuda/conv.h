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

// z = scale * y / sqrt(sum(y^2) + eps) over each head's head_dim channels for y = causal_conv_silu's
// output (l2_normalize_forward of its bf16 values), y's rows from `skip` on: z [tokens - skip,
// channels]; y itself is not stored. One pass where a head fits a warp's lanes at a width the
// alignment allows (head_dim 8 to 128 at 4 values a lane; the KDA's q and k); else the conv into
// workspace, then the norm's own pass, and false is returned.
bool causal_conv_silu_l2(const __nv_bfloat16* x, int64_t x_ld, const float* w, __nv_bfloat16* z, int64_t skip,
                         int64_t tokens, int64_t channels, int64_t kernel, int64_t head_dim, float eps,
                         float scale, cudaStream_t stream);

// Backward: dx (bf16, written; its rows dx_ld >= channels values apart, so that it can fill
// columns of a wider buffer) and dw (fp32 [channels, K], accumulated: the caller zeroes it once
// per step); x's rows x_ld apart as the forward's, dy's channels apart. dw is reduced over a run of
// tokens per thread before one atomic per tap (or per four).
void causal_conv_silu_backward(const __nv_bfloat16* x, int64_t x_ld, const float* w, const __nv_bfloat16* dy,
                               __nv_bfloat16* dx, int64_t dx_ld, float* dw, int64_t tokens, int64_t channels,
                               int64_t kernel, cudaStream_t stream);

// causal_conv_silu_l2's backward, given dz [tokens - skip, channels], the gradient of z: the gradient
// of y, zero in its first skip rows, is formed token by token inside the conv's backward, from y made
// again as the forward rounded it (l2_normalize_backward in fp32), and never stored. dx and dw as
// causal_conv_silu_backward's. One pass where causal_conv_silu_l2's would be one (dz aligned to its
// accesses too); else the conv's output, the norm's backward and the conv's backward in turn, through
// workspace, and false is returned.
bool causal_conv_silu_l2_backward(const __nv_bfloat16* x, int64_t x_ld, const float* w,
                                  const __nv_bfloat16* dz, int64_t skip, __nv_bfloat16* dx, int64_t dx_ld,
                                  float* dw, int64_t tokens, int64_t channels, int64_t kernel,
                                  int64_t head_dim, float eps, float scale, cudaStream_t stream);

}  // namespace spindle::cuda
