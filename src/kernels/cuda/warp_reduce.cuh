// Reductions over a warp's 32 lanes by xor butterflies: every lane ends with the same bits (the
// partners combine in the same order), so a branch on the result keeps the warp converged.
#pragma once

#include <cuda_runtime.h>

namespace spindle::cuda {

// op over the warp's values, op(a, b) == op(b, a) bit for bit (a sum, a maximum).
template <class T, class Op>
__device__ __forceinline__ T warp_reduce(T value, Op op) {
  for (int offset = 16; offset > 0; offset /= 2)
    value = op(value, __shfl_xor_sync(0xffffffffu, value, offset));
  return value;
}

template <class T>
__device__ __forceinline__ T warp_sum(T value) {
  return warp_reduce(value, [](T a, T b) { return a + b; });
}

__device__ __forceinline__ float warp_max(float value) {
  return warp_reduce(value, [](float a, float b) { return fmaxf(a, b); });
}

// Over (value, index) pairs: the larger value wins, a tie goes to the lower index.
__device__ __forceinline__ void warp_argmax(float& value, int& index) {
  for (int offset = 16; offset > 0; offset /= 2) {
    const float v = __shfl_xor_sync(0xffffffffu, value, offset);
    const int i = __shfl_xor_sync(0xffffffffu, index, offset);
    if (v > value || (v == value && i < index)) {
      value = v;
      index = i;
    }
  }
}

}  // namespace spindle::cuda
