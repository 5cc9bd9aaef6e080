// What every GPU test shares: fresh random inputs (the seed is printed so a failure can be
// replayed), bf16 rounding, device buffers, NaN-poisoned outputs and the relative error.
#pragma once

#include <cuda_bf16.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <random>
#include <type_traits>
#include <vector>

#include "backend/cuda/check.h"
#include "backend/cuda/device_memory.h"

namespace spindle::cuda {

using bf16 = __nv_bfloat16;

inline std::mt19937_64& rng() {
  static std::mt19937_64 engine = [] {
    const uint64_t seed = std::random_device{}();
    std::printf("random seed %llu\n", static_cast<unsigned long long>(seed));
    return std::mt19937_64(seed);
  }();
  return engine;
}

inline std::vector<float> random_floats(size_t n, float scale = 1.0f) {
  std::normal_distribution<float> normal(0.0f, scale);
  std::vector<float> v(n);
  for (float& x : v) x = normal(rng());
  return v;
}

inline std::vector<float> random_uniform(size_t n, float lo, float hi) {
  std::uniform_real_distribution<float> uniform(lo, hi);
  std::vector<float> v(n);
  for (float& x : v) x = uniform(rng());
  return v;
}

inline std::vector<bf16> to_bf16(const std::vector<float>& v) {
  std::vector<bf16> out(v.size());
  for (size_t i = 0; i < v.size(); ++i) out[i] = __float2bfloat16(v[i]);
  return out;
}

// The values the GPU actually sees, back in float (inputs are rounded to bf16 first).
inline std::vector<float> rounded(const std::vector<float>& v) {
  std::vector<float> out(v.size());
  for (size_t i = 0; i < v.size(); ++i) out[i] = __bfloat162float(__float2bfloat16(v[i]));
  return out;
}

inline std::vector<double> to_double(const std::vector<float>& v) {
  return std::vector<double>(v.begin(), v.end());
}

// A buffer the test may write from the host or the legacy stream. The allocator hands out a block
// as soon as it is released, and a kernel under test may still be reading a temporary its launcher
// released (hc_coefficients' split fn): wait for the device first, as only work queued after on
// the kernel's own stream may reuse such a block.
template <class T>
DeviceBuffer<T> fresh_buffer(size_t n, MemoryCategory category) {
  SPINDLE_CUDA(cudaDeviceSynchronize());
  return DeviceBuffer<T>(n, category);
}

template <class T>
DeviceBuffer<T> device(const std::vector<T>& host, MemoryCategory category = MemoryCategory::Activations) {
  DeviceBuffer<T> buffer = fresh_buffer<T>(host.size(), category);
  buffer.upload(host);
  return buffer;
}

// An output buffer filled with NaN (bf16 and fp32; -1 for int32), so unwritten elements show.
template <class T>
DeviceBuffer<T> poisoned(size_t n) {
  DeviceBuffer<T> buffer = fresh_buffer<T>(n, MemoryCategory::Activations);
  SPINDLE_CUDA(cudaMemset(buffer.data(), 0xff, n * sizeof(T)));
  // cudaMemset is asynchronous on the legacy stream; the kernels under test run on their own.
  SPINDLE_CUDA(cudaStreamSynchronize(cudaStreamLegacy));
  return buffer;
}

// ||got - want|| / ||want||; infinite when `got` holds a non-finite value.
template <class T>
double relative_error(const std::vector<T>& got, const std::vector<double>& want) {
  double diff = 0, norm = 0;
  for (size_t i = 0; i < got.size(); ++i) {
    double g;
    if constexpr (std::is_same_v<T, bf16>)
      g = __bfloat162float(got[i]);
    else
      g = got[i];
    if (!std::isfinite(g)) return INFINITY;
    diff += (g - want[i]) * (g - want[i]);
    norm += want[i] * want[i];
  }
  return std::sqrt(diff / std::max(norm, 1e-300));
}

// The relative error of an accumulated output: got - start against the reference increment.
inline double increment_error(const std::vector<float>& got, const std::vector<float>& start,
                              const std::vector<double>& want) {
  std::vector<double> delta(got.size());
  for (size_t i = 0; i < got.size(); ++i) delta[i] = double(got[i]) - double(start[i]);
  return relative_error(delta, want);
}

}  // namespace spindle::cuda
