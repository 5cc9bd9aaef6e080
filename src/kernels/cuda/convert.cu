// fp32 <-> bf16 and bf16 sums: elementwise maps (the rounding is in the stores of memory_bound.cuh).
#include "kernels/cuda/convert.h"
#include "kernels/cuda/launch.cuh"
#include "kernels/cuda/memory_bound.cuh"

namespace spindle::cuda {

namespace {

struct Identity {
  __device__ float operator()(float x) const { return x; }
};

__global__ void sum_row_halves_kernel(const float* __restrict__ in, int64_t rows, int64_t half,
                                      __nv_bfloat16* __restrict__ out) {
  wait_for_earlier_kernels();
  const int64_t n = rows * half;
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t r = i / half, c = i % half;
    out[i] = __float2bfloat16(in[r * 2 * half + c] + in[r * 2 * half + half + c]);
  }
}

// A few rows at a time (a conv's carried rows): one thread a value, no vector path.
__global__ void add_bf16_rows_kernel(const __nv_bfloat16* __restrict__ x, int64_t x_ld,
                                     __nv_bfloat16* __restrict__ y, int64_t y_ld, int64_t rows,
                                     int64_t cols) {
  wait_for_earlier_kernels();
  const int64_t n = rows * cols;
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t r = i / cols, c = i % cols;
    __nv_bfloat16& out = y[r * y_ld + c];
    out = __float2bfloat16(__bfloat162float(x[r * x_ld + c]) + __bfloat162float(out));
  }
}

}  // namespace

void sum_row_halves_to_bf16(const float* in, int64_t rows, int64_t half, __nv_bfloat16* out,
                            cudaStream_t stream) {
  if (rows * half == 0) return;
  launch_kernel(sum_row_halves_kernel, grid_blocks(rows * half, kMapThreads), kMapThreads, 0, stream, in,
                rows, half, out);
  SPINDLE_LAUNCHED("sum_row_halves_kernel");
}

void f32_to_bf16(const float* in, __nv_bfloat16* out, int64_t n, cudaStream_t stream) {
  launch_map("f32_to_bf16", Identity{}, out, n, stream, in);
}

void bf16_to_f32(const __nv_bfloat16* in, float* out, int64_t n, cudaStream_t stream) {
  launch_map("bf16_to_f32", Identity{}, out, n, stream, in);
}

void add_bf16_rows(const __nv_bfloat16* x, int64_t x_ld, __nv_bfloat16* y, int64_t y_ld, int64_t rows,
                   int64_t cols, cudaStream_t stream) {
  if (rows * cols == 0) return;
  launch_kernel(add_bf16_rows_kernel, grid_blocks(rows * cols, kMapThreads), kMapThreads, 0, stream, x, x_ld,
                y, y_ld, rows, cols);
  SPINDLE_LAUNCHED("add_bf16_rows_kernel");
}

}  // namespace spindle::cuda
