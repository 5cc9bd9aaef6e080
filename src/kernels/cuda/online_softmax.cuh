// The online softmax's steps on an m64n64k16 accumulator of scores (wgmma.cuh's layout: a thread
// holds two rows, h = 0 and 1, a quad of threads a row), in the log2 domain: the kernels that run
// flash-style attention over tiles of 64 keys share them.
#pragma once

#include <cmath>
#include <cstdint>

#include "kernels/cuda/log2_domain.h"
#include "kernels/cuda/mma.cuh"

namespace spindle::cuda {

// Each of this thread's two rows' maximum over the tile's keys (the quad's), at least `floor`.
__device__ __forceinline__ void row_maxima(const float (&s)[32], const float (&floor)[2], float (&m)[2]) {
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    m[h] = floor[h];
#pragma unroll
    for (int j = 0; j < 8; ++j) m[h] = fmaxf(m[h], fmaxf(s[4 * j + 2 * h], s[4 * j + 2 * h + 1]));
    m[h] = fmaxf(m[h], __shfl_xor_sync(0xffffffffu, m[h], 1));
    m[h] = fmaxf(m[h], __shfl_xor_sync(0xffffffffu, m[h], 2));
  }
}

// exp2(from - to): what a sum or output kept against the running maximum `from` is multiplied by
// when the maximum becomes `to` (1 while both are -inf: nothing is kept yet).
__device__ __forceinline__ float rescale(float from, float to) {
  return to == -INFINITY ? 1.0f : exp2_ftz(from - to);
}

// P = exp2(s - m) in place (0 where m is -inf), each row's sum added to l, and P as bf16 A
// fragments of the values' 4 k-steps.
__device__ __forceinline__ void probabilities(float (&s)[32], const float (&m)[2], float (&l)[2],
                                              uint32_t (&p)[4][4]) {
#pragma unroll
  for (int j = 0; j < 32; ++j) {
    const int h = (j / 2) % 2;
    s[j] = m[h] == -INFINITY ? 0.0f : exp2_ftz(s[j] - m[h]);
    l[h] += s[j];
  }
#pragma unroll
  for (int k = 0; k < 4; ++k) {
#pragma unroll
    for (int r = 0; r < 4; ++r) p[k][r] = pack_bf16(s[8 * k + 2 * r], s[8 * k + 2 * r + 1]);
  }
}

}  // namespace spindle::cuda
