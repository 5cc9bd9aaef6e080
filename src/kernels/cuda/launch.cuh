// Kernel launches with programmatic dependent launch (PDL): a kernel may be launched while the one
// before it in its stream finishes, and waits for that kernel's results (wait_for_earlier_kernels,
// the first statement of every kernel here) before it touches global memory. That hides the gap
// between dependent kernels: 547,177 gaps of 2.8 us on average, 1.54 s of GPU idle time in the 1M
// step from random weights (docs/PERF.md, 2026-12-05). SPINDLE_NO_PDL=1 launches every kernel
// plainly: a profile's kernel spans are then the kernels' own, where a programmatic dependent's span
// also holds its wait for the kernel before it (bench/step_profile.sh).
#pragma once

#include <cuda_runtime.h>

#include <cstdlib>
#include <string_view>
#include <utility>

#include "backend/cuda/check.h"

namespace spindle::cuda {

// Waits until every kernel this one depends on has finished and its writes are visible (at once
// where the launch was not programmatic), then lets the next kernel in the stream be launched:
// its CTAs wait in turn, so it may take only the multiprocessors this one leaves free.
__device__ __forceinline__ void wait_for_earlier_kernels() {
  asm volatile("griddepcontrol.wait;" ::: "memory");
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
}

// Whether kernels launch as programmatic dependents: unless SPINDLE_NO_PDL=1, read once.
inline bool programmatic_launches() {
  static const bool on = [] {
    const char* value = std::getenv("SPINDLE_NO_PDL");
    return value == nullptr || std::string_view(value) != "1";
  }();
  return on;
}

// kernel<<<grid, block, shared_bytes, stream>>>(args...), launched as a programmatic dependent of the
// stream's previous kernel. The default streams launch plainly, and every stream under SPINDLE_NO_PDL=1.
template <class... Params, class... Args>
void launch_kernel(void (*kernel)(Params...), dim3 grid, dim3 block, size_t shared_bytes, cudaStream_t stream,
                   Args&&... args) {
  cudaLaunchAttribute dependent{};
  dependent.id = cudaLaunchAttributeProgrammaticStreamSerialization;
  dependent.val.programmaticStreamSerializationAllowed = 1;
  cudaLaunchConfig_t config{};
  config.gridDim = grid;
  config.blockDim = block;
  config.dynamicSmemBytes = shared_bytes;
  config.stream = stream;
  config.attrs = &dependent;
  const bool default_stream =
      stream == nullptr || stream == cudaStreamLegacy || stream == cudaStreamPerThread;
  config.numAttrs = default_stream || !programmatic_launches() ? 0 : 1;
  SPINDLE_CUDA(cudaLaunchKernelEx(&config, kernel, std::forward<Args>(args)...));
}

}  // namespace spindle::cuda
