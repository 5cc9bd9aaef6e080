// Raising a kernel's dynamic shared memory limit, for the launchers of every kernel that takes
// more than the default 48 KiB.
#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <utility>

#include "backend/cuda/check.h"
#include "core/error.h"

namespace spindle::cuda {

// The dynamic shared memory a block may opt into on sm_90 (H100, H200), for layouts sized at compile
// time or chosen before the launch.
constexpr size_t kMaxDynamicShared = 227 * 1024;

// Lets `kernel` take `bytes` of dynamic shared memory: past the default 48 KiB the limit is raised
// up to the device's opt-in maximum (less the kernel's static shared memory); beyond that it fails,
// naming what asked for it (`what...`, the kernel and its shape).
template <class Kernel, class... What>
void allow_shared_memory(Kernel kernel, size_t bytes, What&&... what) {
  if (bytes <= (48u << 10)) return;
  int device = 0, optin = 0;
  SPINDLE_CUDA(cudaGetDevice(&device));
  SPINDLE_CUDA(cudaDeviceGetAttribute(&optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, device));
  cudaFuncAttributes attributes{};
  SPINDLE_CUDA(cudaFuncGetAttributes(&attributes, kernel));
  check(bytes + attributes.sharedSizeBytes <= static_cast<size_t>(optin), std::forward<What>(what)...,
        " need ", bytes, " bytes of shared memory, over the device's limit of ", optin);
  SPINDLE_CUDA(
      cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(bytes)));
}

}  // namespace spindle::cuda
