// The CUDA backend's operations (device pointers; bf16 storage, fp32 accumulation, fp32
// optimizer state). Each has a CPU reference in kernels/cpu that tests compare it with.
#pragma once

#include <cublasLt.h>
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>

namespace spindle::cuda {

// y = weight * x / sqrt(mean(x^2) + eps) per row of D; x, y, weight in bf16, math in fp32.
void rms_norm_forward(const __nv_bfloat16* x, const __nv_bfloat16* weight, __nv_bfloat16* y, int64_t rows,
                      int64_t D, float eps, cudaStream_t stream);

// dx (bf16, written) and dweight (fp32, accumulated) of rms_norm_forward.
void rms_norm_backward(const __nv_bfloat16* x, const __nv_bfloat16* weight, const __nv_bfloat16* dy,
                       __nv_bfloat16* dx, float* dweight, int64_t rows, int64_t D, float eps,
                       cudaStream_t stream);

struct AdamWStep {
  float lr, beta1, beta2, eps, weight_decay;
  int64_t step;  // 1-based update number, for the bias correction
};

// One fused AdamW update of n values: fp32 master, moments and gradient; the bf16 weight is
// written from the master. PyTorch semantics (decoupled decay, bias correction).
void adamw_update(float* master, float* exp_avg, float* exp_avg_sq, const float* grad, __nv_bfloat16* weight,
                  int64_t n, const AdamWStep& step, cudaStream_t stream);

// cuBLASLt: y[M, N] = x[M, K] * w[N, K]^T with bf16 operands and fp32 accumulation; y in bf16
// (y_bf16) or fp32 (y_f32), exactly one of them non-null.
class Gemm {
 public:
  Gemm();
  ~Gemm();
  Gemm(const Gemm&) = delete;
  Gemm& operator=(const Gemm&) = delete;
  void linear(const __nv_bfloat16* x, const __nv_bfloat16* w, __nv_bfloat16* y_bf16, float* y_f32, int64_t M,
              int64_t K, int64_t N, cudaStream_t stream);

 private:
  cublasLtHandle_t handle_ = nullptr;
  void* workspace_ = nullptr;
  size_t workspace_bytes_ = 32u << 20;
};

}  // namespace spindle::cuda
