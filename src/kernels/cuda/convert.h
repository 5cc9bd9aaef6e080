// Conversions between fp32 and bf16 buffers on the GPU (round to nearest even into bf16; bf16 to
// fp32 is exact), and sums rounded to bf16.
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>

namespace spindle::cuda {

void f32_to_bf16(const float* in, __nv_bfloat16* out, int64_t n, cudaStream_t stream);

void bf16_to_f32(const __nv_bfloat16* in, float* out, int64_t n, cudaStream_t stream);

// out[r, c] = in[r, c] + in[r, half + c] for rows of 2 x half fp32 values, rounded to bf16: the
// gradient of a row that was used twice (MLA's latent, read as both key and value).
void sum_row_halves_to_bf16(const float* in, int64_t rows, int64_t half, __nv_bfloat16* out,
                            cudaStream_t stream);

// y[r, c] += x[r, c] over rows of `cols` values (x's rows x_ld apart, y's y_ld), summed in fp32
// and rounded to bf16: a gradient handed back from a later chunk of a streamed sequence, into
// columns of a wider buffer.
void add_bf16_rows(const __nv_bfloat16* x, int64_t x_ld, __nv_bfloat16* y, int64_t y_ld, int64_t rows,
                   int64_t cols, cudaStream_t stream);

}  // namespace spindle::cuda
