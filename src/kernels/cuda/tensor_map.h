// Tensor maps for Hopper's bulk tensor copies (TMA, cp.async.bulk.tensor): the driver's encoding of
// a global matrix and the box one copy moves, made on the host and passed to a kernel as a
// __grid_constant__ parameter (kernels/cuda/tma.cuh copies with it).
#pragma once

#include <cuda.h>

#include <cstdint>

namespace spindle::cuda {

// A row-major bf16 matrix of `rows` rows of `cols` values, rows `row_stride` values apart (16-byte
// aligned base and stride), copied in boxes of box_rows x box_cols with the 128-byte swizzle
// (box_cols * 2 must be 128: one swizzle atom wide). Rows past `rows` read as zero.
CUtensorMap bf16_tensor_map_128b(const void* base, int64_t rows, int64_t cols, int64_t row_stride,
                                 int box_rows, int box_cols);

}  // namespace spindle::cuda
