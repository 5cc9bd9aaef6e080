// The two products of KDA's sequential state passes (the forward's kda_fwd_scan_kernel in kda.cu,
// the backward's kda_bwd_state_kernel in kda_backward.cu), on the tensor cores as 3xTF32.
//
// Each pass carries a [dk, 16] tile of a state (the forward's S, the backward's dS) from chunk to
// chunk; per chunk it forms a [C, 16] tile from it (u = U0 - W S, X = Kb dS'), then adds a [dk, C]
// x [C, 16] product to it (Kb^T u, W^T X). On the CUDA cores each thread loaded about one float from
// shared memory per multiply-add, which bound the pass (docs/PERF.md); the mma read their operands
// in fragments, and the state and the [C, 16] tile, the B operands, are split into TF32 hi and lo
// once, when they are written, not at every use. Every product keeps independent accumulators (its
// three TF32 terms, and two halves of k for the longer one), so that no chain of dependent mma is
// longer than 8.
#pragma once

#include <cstdint>

#include "kernels/cuda/kda.h"
#include "kernels/cuda/log2_domain.h"
#include "kernels/cuda/mma.cuh"

namespace spindle::cuda {

// Row strides (in words) of the passes' shared tiles, so that a fragment's 32 lanes (rows g =
// lane / 4, columns c = lane % 4) fall in 32 distinct banks: an A operand read row-major needs 4 mod
// 32, one read transposed and the [k, 16] B operands 8 mod 32.
constexpr int kKdaRowsStride = static_cast<int>(kKdaMaxDim) + 4;
constexpr int kKdaColumnsStride = static_cast<int>(kKdaMaxDim) + 8;
constexpr int kKdaSplitStride = 16 + 8;

// A value's TF32 parts (tf32_split) into the split tiles hi and lo at idx.
__device__ __forceinline__ void store_tf32_split(uint32_t* hi, uint32_t* lo, int idx, float x) {
  tf32_split(x, hi[idx], lo[idx]);
}

// exp(G_last) of the warp's state rows i0 + g and i0 + g + 8, by which each chunk decays them
// (glast: the chunk's G_last [kKdaMaxDim], log2 domain).
__device__ __forceinline__ void kda_state_row_decays(const float* glast, int i0, float (&decay)[2]) {
  const int g = threadIdx.x % 32 / 4;
  decay[0] = exp2_ftz(glast[i0 + g]);
  decay[1] = exp2_ftz(glast[i0 + g + 8]);
}

// out (the C fragment of a 16 x 8 tile: rows m0 + g, m0 + g + 8, columns n0 + 2c, + 1) = A[m0 .. m0
// + 15, 0 .. kKdaMaxDim) B[.., n0 .. n0 + 7], A fp32 row-major (stride kKdaRowsStride), B the split
// tiles [kKdaMaxDim, kKdaSplitStride]. Zero columns of A past dk make the rest of B irrelevant.
__device__ __forceinline__ void kda_rows_times_state(float (&out)[4], const float* A, const uint32_t* Bhi,
                                                     const uint32_t* Blo, int m0, int n0) {
  constexpr int As = kKdaRowsStride, Bs = kKdaSplitStride, K = static_cast<int>(kKdaMaxDim);
  const int lane = threadIdx.x % 32, g = lane / 4, c = lane % 4;
  float acc[6][4] = {};
#pragma unroll
  for (int k0 = 0; k0 < K; k0 += 8) {
    float(&hh)[4] = acc[k0 / 8 % 2 * 3], (&hl)[4] = acc[k0 / 8 % 2 * 3 + 1],
    (&lh)[4] = acc[k0 / 8 % 2 * 3 + 2];
    Tf32Frag<4, true> a;
    a.set(0, A[(m0 + g) * As + k0 + c]);
    a.set(1, A[(m0 + g + 8) * As + k0 + c]);
    a.set(2, A[(m0 + g) * As + k0 + c + 4]);
    a.set(3, A[(m0 + g + 8) * As + k0 + c + 4]);
    const int b0 = (k0 + c) * Bs + n0 + g, b1 = b0 + 4 * Bs;
    mma_tf32(hh, a.hi, Bhi[b0], Bhi[b1]);
    mma_tf32(hl, a.hi, Blo[b0], Blo[b1]);
    mma_tf32(lh, a.lo, Bhi[b0], Bhi[b1]);
  }
#pragma unroll
  for (int e = 0; e < 4; ++e)
    out[e] = (acc[1][e] + acc[2][e] + acc[4][e] + acc[5][e]) + (acc[0][e] + acc[3][e]);
}

// out[nt] (C fragments of the 16 x 8 tiles at rows m0 .., columns 8 nt ..) = A^T[m0 .. m0 + 15, 0 ..
// C) B[0 .. C, 0 .. 15], A fp32 [C, kKdaColumnsStride] row-major and read transposed, B the split
// tiles [C, kKdaSplitStride].
__device__ __forceinline__ void kda_columns_times_chunk(float (&out)[2][4], const float* A,
                                                        const uint32_t* Bhi, const uint32_t* Blo, int m0) {
  constexpr int As = kKdaColumnsStride, Bs = kKdaSplitStride, K = static_cast<int>(kKdaChunk);
  const int lane = threadIdx.x % 32, g = lane / 4, c = lane % 4;
  float acc[2][3][4] = {};
#pragma unroll
  for (int k0 = 0; k0 < K; k0 += 8) {
    Tf32Frag<4, true> a;
    a.set(0, A[(k0 + c) * As + m0 + g]);
    a.set(1, A[(k0 + c) * As + m0 + g + 8]);
    a.set(2, A[(k0 + c + 4) * As + m0 + g]);
    a.set(3, A[(k0 + c + 4) * As + m0 + g + 8]);
#pragma unroll
    for (int nt = 0; nt < 2; ++nt) {
      const int b0 = (k0 + c) * Bs + 8 * nt + g, b1 = b0 + 4 * Bs;
      mma_tf32(acc[nt][0], a.hi, Bhi[b0], Bhi[b1]);
      mma_tf32(acc[nt][1], a.hi, Blo[b0], Blo[b1]);
      mma_tf32(acc[nt][2], a.lo, Bhi[b0], Bhi[b1]);
    }
  }
#pragma unroll
  for (int nt = 0; nt < 2; ++nt)
#pragma unroll
    for (int e = 0; e < 4; ++e) out[nt][e] = (acc[nt][1][e] + acc[nt][2][e]) + acc[nt][0][e];
}

}  // namespace spindle::cuda
