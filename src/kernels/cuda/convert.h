// Conversions between fp32 and bf16 buffers on the GPU (round to nearest even into bf16; bf16 to
// fp32 is exact).
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>

namespace spindle::cuda {

void f32_to_bf16(const float* in, __nv_bfloat16* out, int64_t n, cudaStream_t stream);

void bf16_to_f32(const __nv_bfloat16* in, float* out, int64_t n, cudaStream_t stream);

}  // namespace spindle::cuda
