#include "backend/cuda/pinned_memory.h"

#include <cuda_runtime.h>

#include "core/error.h"

namespace spindle::cuda {

std::shared_ptr<void> allocate_pinned(size_t bytes, const std::string& what) {
  void* pointer = nullptr;
  const cudaError_t status = cudaHostAlloc(&pointer, bytes, cudaHostAllocDefault);
  if (status != cudaSuccess) {
    (void)cudaGetLastError();
    fail("cannot pin ", bytes, " bytes of host memory for ", what, " (", cudaGetErrorString(status),
         "): spindle plan shows the policies that need less host memory");
  }
  return std::shared_ptr<void>(pointer, [](void* p) { cudaFreeHost(p); });
}

}  // namespace spindle::cuda
