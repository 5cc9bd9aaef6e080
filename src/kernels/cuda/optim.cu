// Fused AdamW: one pass over master, moments and gradient, writing the bf16 weight.
#include <algorithm>
#include <cmath>

#include "backend/cuda/check.h"
#include "kernels/cuda/launch.cuh"
#include "kernels/cuda/ops.h"

namespace spindle::cuda {

namespace {

__global__ void adamw_kernel(float* master, float* exp_avg, float* exp_avg_sq, const float* grad,
                             __nv_bfloat16* weight, int64_t n, AdamWStep s, float step_size,
                             float root_correction) {
  wait_for_earlier_kernels();
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    float p = master[i];
    const float g = grad[i];
    p -= s.lr * s.weight_decay * p;
    const float m = s.beta1 * exp_avg[i] + (1.0f - s.beta1) * g;
    const float v = s.beta2 * exp_avg_sq[i] + (1.0f - s.beta2) * g * g;
    p -= step_size * m / (sqrtf(v) / root_correction + s.eps);
    exp_avg[i] = m;
    exp_avg_sq[i] = v;
    master[i] = p;
    if (weight != nullptr) weight[i] = __float2bfloat16(p);
  }
}

// The host AdamW's update (train/adamw.cpp's update_range) on the device, for its device share: the
// same fp64 operations in the same order, each rounded alone (the _rn intrinsics: no contraction into
// fused multiply-adds), so the same bits. The weight is bf16 (rounded from the master) or fp32.
__global__ void adamw_exact_kernel(AdamWConstants c, const float* grad, float* master, float* exp_avg,
                                   float* exp_avg_sq, void* weight, bool bf16_weight, int64_t n) {
  wait_for_earlier_kernels();
  const double b1 = c.beta1, b2 = c.beta2, one_minus_b1 = __dsub_rn(1.0, b1),
               one_minus_b2 = __dsub_rn(1.0, b2);
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const double g = grad[i];
    const double m = __dadd_rn(__dmul_rn(b1, exp_avg[i]), __dmul_rn(one_minus_b1, g));
    const double v = __dadd_rn(__dmul_rn(b2, exp_avg_sq[i]), __dmul_rn(__dmul_rn(one_minus_b2, g), g));
    const double denominator = __dadd_rn(__ddiv_rn(__dsqrt_rn(v), c.bc2_sqrt), c.eps);
    const double p =
        __dsub_rn(__dmul_rn(c.decay, master[i]), __ddiv_rn(__dmul_rn(c.step_size, m), denominator));
    exp_avg[i] = __double2float_rn(m);
    exp_avg_sq[i] = __double2float_rn(v);
    const float p32 = __double2float_rn(p);
    master[i] = p32;
    if (bf16_weight)
      static_cast<__nv_bfloat16*>(weight)[i] = __float2bfloat16_rn(p32);
    else
      static_cast<float*>(weight)[i] = p32;
  }
}

// A grid-stride sum per thread, a warp then block reduction, one double atomic per block.
__global__ void sum_squares_kernel(const float* x, int64_t n, double* sum) {
  wait_for_earlier_kernels();
  double local = 0;
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x)
    local += static_cast<double>(x[i]) * x[i];
  for (int offset = 16; offset > 0; offset /= 2) local += __shfl_down_sync(0xffffffffu, local, offset);
  __shared__ double warp_sums[32];
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  if (lane == 0) warp_sums[warp] = local;
  __syncthreads();
  if (warp == 0) {
    local = lane < static_cast<int>(blockDim.x / 32) ? warp_sums[lane] : 0.0;
    for (int offset = 16; offset > 0; offset /= 2) local += __shfl_down_sync(0xffffffffu, local, offset);
    if (lane == 0) atomicAdd(sum, local);
  }
}

__global__ void scale_kernel(float* x, int64_t n, float factor) {
  wait_for_earlier_kernels();
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x)
    x[i] *= factor;
}

// A grid-stride loop's blocks: one a `threads` values, at most `waves` blocks an SM (132 SMs).
int64_t grid_for(int64_t n, int threads, int waves = 8) {
  return std::max<int64_t>(1, std::min<int64_t>((n + threads - 1) / threads, int64_t{132} * waves));
}

}  // namespace

void sum_squares(const float* x, int64_t n, double* sum, cudaStream_t stream) {
  if (n == 0) return;
  launch_kernel(sum_squares_kernel, static_cast<unsigned>(grid_for(n, 256)), 256, 0, stream, x, n, sum);
  SPINDLE_LAUNCHED("sum_squares_kernel");
}

void scale_values(float* x, int64_t n, float factor, cudaStream_t stream) {
  if (n == 0) return;
  launch_kernel(scale_kernel, static_cast<unsigned>(grid_for(n, 256)), 256, 0, stream, x, n, factor);
  SPINDLE_LAUNCHED("scale_kernel");
}

void adamw_update(float* master, float* exp_avg, float* exp_avg_sq, const float* grad, __nv_bfloat16* weight,
                  int64_t n, const AdamWStep& step, cudaStream_t stream) {
  if (n == 0) return;
  const double t = static_cast<double>(step.step);
  const float step_size = static_cast<float>(step.lr / (1.0 - std::pow(static_cast<double>(step.beta1), t)));
  const float root_correction =
      static_cast<float>(std::sqrt(1.0 - std::pow(static_cast<double>(step.beta2), t)));
  launch_kernel(adamw_kernel, static_cast<unsigned>(grid_for(n, 256, 16)), 256, 0, stream, master, exp_avg,
                exp_avg_sq, grad, weight, n, step, step_size, root_correction);
  SPINDLE_LAUNCHED("adamw_kernel");
}

void adamw_update_exact(const AdamWConstants& constants, const float* grad, float* master, float* exp_avg,
                        float* exp_avg_sq, void* weight, bool bf16_weight, int64_t n, cudaStream_t stream) {
  if (n == 0) return;
  launch_kernel(adamw_exact_kernel, static_cast<unsigned>(grid_for(n, 256, 16)), 256, 0, stream, constants,
                grad, master, exp_avg, exp_avg_sq, weight, bf16_weight, n);
  SPINDLE_LAUNCHED("adamw_exact_kernel");
}

}  // namespace spindle::cuda
