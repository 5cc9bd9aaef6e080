// RMSNorm forward and backward: one block of 256 threads per row, fp32 sums reduced across
// warps in shared memory. Memory-bound: one read of x (and dy) and one write per element.
#include "backend/cuda/check.h"
#include "kernels/cuda/ops.h"

namespace spindle::cuda {

namespace {

constexpr int kThreads = 256;

__device__ float block_sum(float value, float* shared) {
  for (int offset = 16; offset > 0; offset /= 2) value += __shfl_xor_sync(0xffffffffu, value, offset);
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  if (lane == 0) shared[warp] = value;
  __syncthreads();
  value = lane < kThreads / 32 ? shared[lane] : 0.0f;
  if (warp == 0)
    for (int offset = 16; offset > 0; offset /= 2) value += __shfl_xor_sync(0xffffffffu, value, offset);
  if (threadIdx.x == 0) shared[0] = value;
  __syncthreads();
  const float total = shared[0];
  __syncthreads();
  return total;
}

__global__ void rms_norm_forward_kernel(const __nv_bfloat16* x, const __nv_bfloat16* weight, __nv_bfloat16* y,
                                        int64_t D, float eps) {
  __shared__ float shared[32];
  const __nv_bfloat16* xr = x + blockIdx.x * D;
  __nv_bfloat16* yr = y + blockIdx.x * D;
  float sum = 0.0f;
  for (int64_t i = threadIdx.x; i < D; i += kThreads) {
    const float v = __bfloat162float(xr[i]);
    sum += v * v;
  }
  const float inv = rsqrtf(block_sum(sum, shared) / static_cast<float>(D) + eps);
  for (int64_t i = threadIdx.x; i < D; i += kThreads)
    yr[i] = __float2bfloat16(__bfloat162float(weight[i]) * (__bfloat162float(xr[i]) * inv));
}

__global__ void rms_norm_backward_kernel(const __nv_bfloat16* x, const __nv_bfloat16* weight,
                                         const __nv_bfloat16* dy, __nv_bfloat16* dx, float* dweight,
                                         int64_t D, float eps) {
  __shared__ float shared[32];
  const int64_t row = blockIdx.x;
  const __nv_bfloat16* xr = x + row * D;
  const __nv_bfloat16* gr = dy + row * D;
  float sum = 0.0f, dot = 0.0f;
  for (int64_t i = threadIdx.x; i < D; i += kThreads) {
    const float v = __bfloat162float(xr[i]);
    sum += v * v;
    dot += __bfloat162float(weight[i]) * __bfloat162float(gr[i]) * v;
  }
  const float inv = rsqrtf(block_sum(sum, shared) / static_cast<float>(D) + eps);
  dot = block_sum(dot, shared);
  for (int64_t i = threadIdx.x; i < D; i += kThreads) {
    const float v = __bfloat162float(xr[i]), g = __bfloat162float(gr[i]);
    dx[row * D + i] = __float2bfloat16(inv * __bfloat162float(weight[i]) * g - v * inv * inv * inv * dot / D);
    // Rows add into one weight gradient; the atomics are few next to the row's reads.
    atomicAdd(dweight + i, g * v * inv);
  }
}

}  // namespace

void rms_norm_forward(const __nv_bfloat16* x, const __nv_bfloat16* weight, __nv_bfloat16* y, int64_t rows,
                      int64_t D, float eps, cudaStream_t stream) {
  if (rows == 0) return;
  rms_norm_forward_kernel<<<static_cast<unsigned>(rows), kThreads, 0, stream>>>(x, weight, y, D, eps);
  SPINDLE_LAUNCHED("rms_norm_forward_kernel");
}

void rms_norm_backward(const __nv_bfloat16* x, const __nv_bfloat16* weight, const __nv_bfloat16* dy,
                       __nv_bfloat16* dx, float* dweight, int64_t rows, int64_t D, float eps,
                       cudaStream_t stream) {
  if (rows == 0) return;
  rms_norm_backward_kernel<<<static_cast<unsigned>(rows), kThreads, 0, stream>>>(x, weight, dy, dx, dweight,
                                                                                 D, eps);
  SPINDLE_LAUNCHED("rms_norm_backward_kernel");
}

}  // namespace spindle::cuda
