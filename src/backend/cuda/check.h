// Every CUDA runtime and cuBLAS call, and every kernel launch, is checked: a failure names the
// call, the file and line, and the error.
#pragma once

#include <cublasLt.h>
#include <cuda_runtime.h>

#include "core/error.h"

namespace spindle::cuda {

inline void check_cuda(cudaError_t status, const char* call, const char* file, int line) {
  if (status != cudaSuccess)
    fail("CUDA error ", cudaGetErrorName(status), " (", cudaGetErrorString(status), ") in ", call, " at ",
         file, ":", line);
}

inline void check_cublas(cublasStatus_t status, const char* call, const char* file, int line) {
  if (status != CUBLAS_STATUS_SUCCESS)
    fail("cuBLAS error ", static_cast<int>(status), " in ", call, " at ", file, ":", line);
}

}  // namespace spindle::cuda

#define SPINDLE_CUDA(call) ::spindle::cuda::check_cuda((call), #call, __FILE__, __LINE__)
#define SPINDLE_CUBLAS(call) ::spindle::cuda::check_cublas((call), #call, __FILE__, __LINE__)
// After a launch: configuration errors show at once, execution errors at the next sync.
#define SPINDLE_LAUNCHED(name) ::spindle::cuda::check_cuda(cudaGetLastError(), name, __FILE__, __LINE__)
