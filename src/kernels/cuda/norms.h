// Normalisations per row of D on the GPU: RMSNorm (plain and gated), LayerNorm and L2. Rows in
// bf16, math in fp32, weight gradients fp32 and accumulated (the caller zeroes them once per
// step). 1 <= D <= kMaxNormD. CPU references: kernels/cpu/norms.h (same names).
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>

namespace spindle::cuda {

// A thread keeps up to 16 elements of its row in registers, a row has at most 512 threads.
constexpr int64_t kMaxNormD = 8192;

// y = weight * x / sqrt(mean(x^2) + eps).
void rms_norm_forward(const __nv_bfloat16* x, const __nv_bfloat16* weight, __nv_bfloat16* y, int64_t rows,
                      int64_t D, float eps, cudaStream_t stream);
// The same where x's and y's rows are columns of wider buffers, x_ld and y_ld values apart.
void rms_norm_forward(const __nv_bfloat16* x, int64_t x_ld, const __nv_bfloat16* weight, __nv_bfloat16* y,
                      int64_t y_ld, int64_t rows, int64_t D, float eps, cudaStream_t stream);

// dx (bf16, written) and dweight (fp32, accumulated) of rms_norm_forward.
void rms_norm_backward(const __nv_bfloat16* x, const __nv_bfloat16* weight, const __nv_bfloat16* dy,
                       __nv_bfloat16* dx, float* dweight, int64_t rows, int64_t D, float eps,
                       cudaStream_t stream);
// The same where x's and dx's rows are columns of wider buffers, x_ld and dx_ld values apart.
void rms_norm_backward(const __nv_bfloat16* x, int64_t x_ld, const __nv_bfloat16* weight,
                       const __nv_bfloat16* dy, __nv_bfloat16* dx, int64_t dx_ld, float* dweight,
                       int64_t rows, int64_t D, float eps, cudaStream_t stream);
// The same from an fp32 dy (a gradient summed in fp32, used as it is rather than rounded first).
void rms_norm_backward(const __nv_bfloat16* x, const __nv_bfloat16* weight, const float* dy,
                       __nv_bfloat16* dx, float* dweight, int64_t rows, int64_t D, float eps,
                       cudaStream_t stream);

// y = (x - mean) / sqrt(var + eps) * weight + bias, biased variance (cpu::layer_norm).
void layer_norm_forward(const __nv_bfloat16* x, const __nv_bfloat16* weight, const __nv_bfloat16* bias,
                        __nv_bfloat16* y, int64_t rows, int64_t D, float eps, cudaStream_t stream);
// The same where x's rows are columns of a wider buffer, x_ld values apart.
void layer_norm_forward(const __nv_bfloat16* x, int64_t x_ld, const __nv_bfloat16* weight,
                        const __nv_bfloat16* bias, __nv_bfloat16* y, int64_t rows, int64_t D, float eps,
                        cudaStream_t stream);

// dx written; dweight, dbias accumulated.
void layer_norm_backward(const __nv_bfloat16* x, const __nv_bfloat16* weight, const __nv_bfloat16* dy,
                         __nv_bfloat16* dx, float* dweight, float* dbias, int64_t rows, int64_t D, float eps,
                         cudaStream_t stream);

// y = rms_norm(x, weight) * sigmoid(gate), gate [rows, D] (cpu::gated_rms_norm).
void gated_rms_norm_forward(const __nv_bfloat16* x, const __nv_bfloat16* weight, const __nv_bfloat16* gate,
                            __nv_bfloat16* y, int64_t rows, int64_t D, float eps, cudaStream_t stream);

// dx, dgate written; dweight accumulated.
void gated_rms_norm_backward(const __nv_bfloat16* x, const __nv_bfloat16* weight, const __nv_bfloat16* gate,
                             const __nv_bfloat16* dy, __nv_bfloat16* dx, __nv_bfloat16* dgate, float* dweight,
                             int64_t rows, int64_t D, float eps, cudaStream_t stream);

// y = scale * x / sqrt(sum(x^2) + eps) (cpu::l2_normalize, then the scale).
void l2_normalize_forward(const __nv_bfloat16* x, __nv_bfloat16* y, int64_t rows, int64_t D, float eps,
                          float scale, cudaStream_t stream);

// dx (written) from x, the input before normalising, and dy, the gradient of y.
void l2_normalize_backward(const __nv_bfloat16* x, const __nv_bfloat16* dy, __nv_bfloat16* dx, int64_t rows,
                           int64_t D, float eps, float scale, cudaStream_t stream);

}  // namespace spindle::cuda
