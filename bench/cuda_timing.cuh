// What the kernel benchmarks share: deterministic pseudo-random bf16 inputs made on the device, and
// the median of a few timed launches by CUDA events (after one warm-up).
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <functional>
#include <vector>

#include "backend/cuda/check.h"
#include "backend/cuda/device_memory.h"

namespace spindle::cuda {

__global__ inline void fill_uniform(__nv_bfloat16* x, int64_t n, uint32_t seed) {
  for (int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; i < n;
       i += int64_t{gridDim.x} * blockDim.x) {
    const uint32_t h = (static_cast<uint32_t>(i) ^ seed) * 2654435761u;
    x[i] = __float2bfloat16(static_cast<float>(h >> 8) / 16777216.0f - 0.5f);
  }
}

__global__ inline void fill_uniform_f32(float* x, int64_t n, uint32_t seed, float low, float high) {
  for (int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; i < n;
       i += int64_t{gridDim.x} * blockDim.x) {
    const uint32_t h = (static_cast<uint32_t>(i) ^ seed) * 2654435761u;
    x[i] = low + (high - low) * (static_cast<float>(h >> 8) / 16777216.0f);
  }
}

// n values in [-0.5, 0.5) from a hash of (index, seed).
inline DeviceBuffer<__nv_bfloat16> random_bf16(int64_t n, uint32_t seed) {
  DeviceBuffer<__nv_bfloat16> b(static_cast<size_t>(n), MemoryCategory::Activations);
  fill_uniform<<<1024, 256>>>(b.data(), n, seed);
  SPINDLE_LAUNCHED("fill_uniform");
  return b;
}

// n fp32 values in [low, high) from a hash of (index, seed).
inline DeviceBuffer<float> random_f32(int64_t n, uint32_t seed, float low, float high) {
  DeviceBuffer<float> b(static_cast<size_t>(n), MemoryCategory::Activations);
  fill_uniform_f32<<<1024, 256>>>(b.data(), n, seed, low, high);
  SPINDLE_LAUNCHED("fill_uniform_f32");
  return b;
}

// Milliseconds that one run of `run` takes on the legacy stream, by CUDA events.
inline double elapsed_ms(const std::function<void()>& run) {
  cudaEvent_t start, stop;
  SPINDLE_CUDA(cudaEventCreate(&start));
  SPINDLE_CUDA(cudaEventCreate(&stop));
  SPINDLE_CUDA(cudaEventRecord(start));
  run();
  SPINDLE_CUDA(cudaEventRecord(stop));
  SPINDLE_CUDA(cudaEventSynchronize(stop));
  float ms = 0;
  SPINDLE_CUDA(cudaEventElapsedTime(&ms, start, stop));
  SPINDLE_CUDA(cudaEventDestroy(start));
  SPINDLE_CUDA(cudaEventDestroy(stop));
  return ms;
}

inline double median_ms(const std::function<void()>& run, int repeats) {
  run();  // warm-up
  std::vector<double> ms;
  for (int i = 0; i < repeats; ++i) ms.push_back(elapsed_ms(run));
  std::sort(ms.begin(), ms.end());
  return ms[ms.size() / 2];
}

// FNV-1a over the bytes of n device values, continuing from `digest`: equal digests from two builds
// say that a change left the outputs bit for bit as they were.
template <class T>
uint64_t bits_digest(const T* device, int64_t n, uint64_t digest = 14695981039346656037ull) {
  std::vector<unsigned char> bytes(static_cast<size_t>(n) * sizeof(T));
  SPINDLE_CUDA(cudaMemcpy(bytes.data(), device, bytes.size(), cudaMemcpyDeviceToHost));
  for (const unsigned char b : bytes) digest = (digest ^ b) * 1099511628211ull;
  return digest;
}

}  // namespace spindle::cuda
