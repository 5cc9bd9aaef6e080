#include "kernels/cuda/tensor_map.h"

#include <cudaTypedefs.h>
#include <cuda_runtime.h>

#include "backend/cuda/check.h"
#include "core/error.h"

namespace spindle::cuda {

namespace {

// The driver's encoder through the runtime, so that nothing links libcuda itself.
PFN_cuTensorMapEncodeTiled_v12000 encoder() {
  static const PFN_cuTensorMapEncodeTiled_v12000 encode = [] {
    void* fn = nullptr;
    cudaDriverEntryPointQueryResult found{};
    SPINDLE_CUDA(
        cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &fn, 12000, cudaEnableDefault, &found));
    check(found == cudaDriverEntryPointSuccess && fn != nullptr,
          "the CUDA driver has no cuTensorMapEncodeTiled (TMA needs driver 12.0 or later)");
    return reinterpret_cast<PFN_cuTensorMapEncodeTiled_v12000>(fn);
  }();
  return encode;
}

}  // namespace

CUtensorMap bf16_tensor_map_128b(const void* base, int64_t rows, int64_t cols, int64_t row_stride,
                                 int box_rows, int box_cols) {
  check(box_cols * 2 == 128 && box_rows >= 1 && box_rows <= 256, "tensor map: box ", box_rows, " x ",
        box_cols, " (expected 128 bytes wide, 1 to 256 rows)");
  check(reinterpret_cast<uintptr_t>(base) % 16 == 0 && row_stride * 2 % 16 == 0 && rows >= 1 && cols >= 1,
        "tensor map: base and row stride must be 16-byte aligned");
  CUtensorMap map{};
  const cuuint64_t dims[2] = {static_cast<cuuint64_t>(cols), static_cast<cuuint64_t>(rows)};
  const cuuint64_t strides[1] = {static_cast<cuuint64_t>(row_stride) * 2};
  const cuuint32_t box[2] = {static_cast<cuuint32_t>(box_cols), static_cast<cuuint32_t>(box_rows)};
  const cuuint32_t element_strides[2] = {1, 1};
  const CUresult r =
      encoder()(&map, CU_TENSOR_MAP_DATA_TYPE_BFLOAT16, 2, const_cast<void*>(base), dims, strides, box,
                element_strides, CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B,
                CU_TENSOR_MAP_L2_PROMOTION_L2_256B, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  check(r == CUDA_SUCCESS, "cuTensorMapEncodeTiled failed (", static_cast<int>(r), ") for ", rows, " x ",
        cols, " bf16, stride ", row_stride);
  return map;
}

}  // namespace spindle::cuda
