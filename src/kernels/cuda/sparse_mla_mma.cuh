// The mma.sync sparse MLA kernels' pieces (sparse_mla.cu's forward and backward, one query a CTA):
// 16 warps, the query rows of a CTA in padded shared rows, a tile's selected rows gathered by
// cp.async, and the products of the scores and of the values.
#pragma once

#include <cuda_bf16.h>

#include <cstdint>

#include "kernels/cuda/mma.cuh"

namespace spindle::cuda::mla {

// 16 warps, so that each scheduler has 4 to hide the latencies of one CTA per SM (its shared
// memory allows no more).
constexpr int kThreads = 512, kWarps = kThreads / 32;
constexpr int kPad = 8;       // bf16 per shared row past the data: ldmatrix rows in distinct banks
constexpr int kMaxDim = 512;  // dk, dv <= this (shared memory)
// Output columns go to the warps in units of 16 (unit u to warp u % 16): at most 2 units, 4 n8
// tiles, per warp.
constexpr int kMaxColTiles = kMaxDim / kWarps / 8;
// The backward's scores: the second halves' partial sums of S and dP pass through shared memory,
// [8 warps][4 float4][32 lanes].
constexpr size_t kPartialBytes = 8 * 4 * 32 * 16;

// Rows h0 .. h0 + rows - 1 of token t of `src` ([tokens, heads, dim]) into shared rows of `stride`,
// zero past the last head.
__device__ __forceinline__ void load_rows(__nv_bfloat16* dst, const __nv_bfloat16* src, int64_t t, int h0,
                                          int rows, int heads, int dim, int stride) {
  const int chunks = dim / 8;
  for (int i = threadIdx.x; i < rows * chunks; i += kThreads) {
    const int row = i / chunks, chunk = i % chunks;
    const bool valid = h0 + row < heads;
    const __nv_bfloat16* from = valid ? src + ((t * heads + h0 + row) * dim + chunk * 8) : src;
    copy16(dst + row * stride + chunk * 8, from, valid);
  }
}

// `rows` selected rows of the latent (their first dk values, rows `stride` apart) by their indices
// `idx` (shared memory) into `dst` (rows dk + kPad apart), zero for unused slots: a warp per row,
// its lanes over the row's 16-byte pieces.
__device__ __forceinline__ void load_tile(__nv_bfloat16* dst, const int32_t* idx, int rows,
                                          const __nv_bfloat16* latent, int64_t stride, int dk) {
  const int chunks = dk / 8, lane = threadIdx.x % 32;
  for (int row = threadIdx.x / 32; row < rows; row += kWarps) {
    const int32_t index = idx[row];
    const bool valid = index >= 0;
    const __nv_bfloat16* from = latent + (valid ? static_cast<int64_t>(index) * stride : 0);
    __nv_bfloat16* to = dst + row * (dk + kPad);
    for (int chunk = lane; chunk < chunks; chunk += 32) copy16(to + chunk * 8, from + chunk * 8, valid);
  }
}

// acc[n] += rows [16, k:k+32) . keys [8 n .. 8 n + 7, k:k+32)^T for n = 0, 1: the rows' two k16
// fragments from row_address (row k's), the keys' from b (one x4 per n8 tile).
__device__ __forceinline__ void rows_by_keys_k32(float (&acc)[2][4], uint32_t row_address,
                                                 const uint32_t (&b)[2][4]) {
  uint32_t a0[4], a1[4];
  ldmatrix_x4(a0, row_address);
  ldmatrix_x4(a1, row_address + 32);
#pragma unroll
  for (int n = 0; n < 2; ++n) {
    mma_bf16(acc[n], a0, b[n][0], b[n][1]);
    mma_bf16(acc[n], a1, b[n][2], b[n][3]);
  }
}

// The backward's scores over one range of the reduction: s[n] += q[16, k0:k1) . keys[8 n .. 8 n + 7,
// k0:k1)^T and dp[n] += dO[16, k0:kv) . keys[.., k0:kv)^T for n = 0, 1 (the warp's 16 keys), kv =
// min(k1, dv): both products read each key fragment once, and each row fragment serves both n8
// tiles. k0, k1 and dv multiples of 16.
__device__ __forceinline__ void scores_over_range(float (&s)[2][4], float (&dp)[2][4], const __nv_bfloat16* q,
                                                  int q_stride, const __nv_bfloat16* dout, int do_stride,
                                                  const __nv_bfloat16* keys, int key_stride, int k0, int k1,
                                                  int dv) {
  const int lane = threadIdx.x % 32;
  const uint32_t q_address = shared_address(q + (lane % 16) * q_stride + (lane / 16) * 8);
  const uint32_t do_address = shared_address(dout + (lane % 16) * do_stride + (lane / 16) * 8);
  // x4: 8 key rows at k, k + 8, k + 16, k + 24 (b0, b1 of two k16 steps), for keys 0-7 and 8-15.
  const uint32_t key_address = shared_address(keys + (lane % 8) * key_stride + (lane / 8) * 8);
  const uint32_t key_step = 8 * key_stride * 2;  // bytes from keys 0-7 to 8-15
  int k = k0;
  for (; k + 32 <= k1; k += 32) {
    uint32_t b[2][4];
#pragma unroll
    for (int n = 0; n < 2; ++n) ldmatrix_x4(b[n], key_address + n * key_step + k * 2);
    rows_by_keys_k32(s, q_address + k * 2, b);
    if (k + 32 <= dv) {
      rows_by_keys_k32(dp, do_address + k * 2, b);
    } else if (k < dv) {  // dv ends inside this k32 step
      uint32_t a0[4];
      ldmatrix_x4(a0, do_address + k * 2);
#pragma unroll
      for (int n = 0; n < 2; ++n) mma_bf16(dp[n], a0, b[n][0], b[n][1]);
    }
  }
  if (k < k1) {  // a last 16
    uint32_t b[2][2], a0[4];
#pragma unroll
    for (int n = 0; n < 2; ++n) ldmatrix_x2(b[n], key_address + n * key_step + k * 2);
    ldmatrix_x4(a0, q_address + k * 2);
#pragma unroll
    for (int n = 0; n < 2; ++n) mma_bf16(s[n], a0, b[n][0], b[n][1]);
    if (k < dv) {
      ldmatrix_x4(a0, do_address + k * 2);
#pragma unroll
      for (int n = 0; n < 2; ++n) mma_bf16(dp[n], a0, b[n][0], b[n][1]);
    }
  }
}

// The first column of the warp's n8 tile j: unit warp + kWarps (j / 2), then its half.
__device__ __forceinline__ int tile_column(int j) {
  return (threadIdx.x / 32 + kWarps * (j / 2)) * 16 + (j % 2) * 8;
}

// acc[m][j] += probs [16 MT rows, Keys] . values [Keys, the warp's columns tile_column(j) ..], probs
// rows Keys + kPad apart, values the tile's rows ([key][column], stride bf16) with `units` 16-column
// units in all.
template <int MT, int Keys>
__device__ __forceinline__ void probs_times_values(float (&acc)[MT][kMaxColTiles][4],
                                                   const __nv_bfloat16* probs, const __nv_bfloat16* values,
                                                   int stride, int units) {
  constexpr int prob_stride = Keys + kPad;
  const int lane = threadIdx.x % 32;
  const uint32_t a_address = shared_address(probs + (lane % 16) * prob_stride + (lane / 16) * 8);
  // x4.trans: keys k .. k + 7 and k + 8 .. k + 15 at columns n and n + 8: b0, b1 of two n8 tiles.
  const uint32_t b_address =
      shared_address(values + ((lane % 8) + ((lane / 8) % 2) * 8) * stride + (lane / 16) * 8);
#pragma unroll
  for (int k = 0; k < Keys; k += 16) {
    uint32_t a[MT][4];
#pragma unroll
    for (int m = 0; m < MT; ++m) ldmatrix_x4(a[m], a_address + (m * 16 * prob_stride + k) * 2);
#pragma unroll
    for (int j = 0; j < kMaxColTiles; j += 2) {
      if (threadIdx.x / 32 + kWarps * (j / 2) >= units) break;
      uint32_t b[4];
      ldmatrix_x4_trans(b, b_address + (k * stride + tile_column(j)) * 2);
#pragma unroll
      for (int m = 0; m < MT; ++m) {
        mma_bf16(acc[m][j], a[m], b[0], b[1]);
        mma_bf16(acc[m][j + 1], a[m], b[2], b[3]);
      }
    }
  }
}

// From the scores S and dP of the warp's m16 tile of head rows (row0 ..) and 16 keys (key16 ..,
// the accumulators of two n8 tiles): P = exp2(S scale2 - lse) and dS = P (dP - delta) scale into
// probs and dprobs (bf16, rows Keys + kPad apart), zero for keys whose `keys` entry is negative;
// lse (log2 domain, +inf for rows past the last head: P = 0) and delta by head row. mass, unless
// null: the fp32 probabilities summed over the tile's rows, by key.
template <int Keys>
__device__ __forceinline__ void probabilities_and_gradients(const float (&s)[2][4], const float (&dp)[2][4],
                                                            int row0, int key16, const int32_t* keys,
                                                            const float* lse, const float* delta,
                                                            float scale2, float scale, __nv_bfloat16* probs,
                                                            __nv_bfloat16* dprobs, float* mass) {
  constexpr int prob_stride = Keys + kPad;
  const int lane = threadIdx.x % 32, g = lane / 4, c = lane % 4;
#pragma unroll
  for (int n = 0; n < 2; ++n) {
    const int key0 = key16 + 8 * n + 2 * c;
    const bool valid[2] = {keys[key0] >= 0, keys[key0 + 1] >= 0};
    float column[2] = {};  // the fp32 probabilities of the lane's two keys over its two rows
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      const int row = row0 + g + 8 * half;
      float p[2], d[2];
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        // exp2f, not exp2_ftz: the one-query kernel, DRAM-bound, measured 0.2% slower with it.
        p[e] = valid[e] ? exp2f(s[n][2 * half + e] * scale2 - lse[row]) : 0.0f;
        d[e] = p[e] * (dp[n][2 * half + e] - delta[row]) * scale;
        column[e] += p[e];
      }
      *reinterpret_cast<uint32_t*>(probs + row * prob_stride + key0) = pack_bf16(p[0], p[1]);
      *reinterpret_cast<uint32_t*>(dprobs + row * prob_stride + key0) = pack_bf16(d[0], d[1]);
    }
    if (mass != nullptr) {  // over the m16 tile's rows: the lanes of equal c
#pragma unroll
      for (int e = 0; e < 2; ++e) {
#pragma unroll
        for (int offset = 4; offset < 32; offset *= 2)
          column[e] += __shfl_xor_sync(0xffffffffu, column[e], offset);
      }
      if (g == 0) *reinterpret_cast<float2*>(mass + key0) = make_float2(column[0], column[1]);
    }
  }
}

// The lane's shared addresses for the selected rows' gradient, dS^T Q + P^T dO: A = dS^T and P^T
// from dprobs and probs ([row][key], rows Keys + kPad apart) by transposed loads, matrices (keys
// m0.., rows k0..), (keys m0 + 8.., rows k0..), (keys m0.., rows k0 + 8..), (keys m0 + 8.., rows
// k0 + 8..); B = Q or dO ([row][column]) by transposed loads, as probs_times_values reads values.
struct GradientOperands {
  uint32_t ds, p, q, dout;
};

template <int Keys>
__device__ __forceinline__ GradientOperands gradient_operands(const __nv_bfloat16* dprobs,
                                                              const __nv_bfloat16* probs,
                                                              const __nv_bfloat16* q, int q_stride,
                                                              const __nv_bfloat16* dout, int do_stride) {
  constexpr int prob_stride = Keys + kPad;
  const int lane = threadIdx.x % 32;
  const int a_row = (lane % 8) + (lane / 16) * 8, a_key = ((lane / 8) % 2) * 8;
  const int b_row = (lane % 8) + ((lane / 8) % 2) * 8, b_col = (lane / 16) * 8;
  return {shared_address(dprobs + a_row * prob_stride + a_key),
          shared_address(probs + a_row * prob_stride + a_key), shared_address(q + b_row * q_stride + b_col),
          shared_address(dout + b_row * do_stride + b_col)};
}

}  // namespace spindle::cuda::mla
