// What the KDA kernels (kda.cu, kda_backward.cu) share: loading one chunk of a head and its
// intra-chunk matrices.
#pragma once

#include <cuda_bf16.h>

#include <cstdint>

#include "kernels/cuda/kda.h"

namespace spindle::cuda {

// k (unless ks is null; q unless qs is null) of tokens [t0, t0 + n) of head h as fp32, and G_t = sum_{s<=t}
// g_s (the per-channel prefix sums of the log decays), into [C, stride] shared tiles; glast (unless null)
// gets G of the chunk's last token. Every thread of the CTA calls it; it ends with a barrier.
__device__ inline void load_chunk_with_prefix(const __nv_bfloat16* __restrict__ q,
                                              const __nv_bfloat16* __restrict__ k,
                                              const float* __restrict__ g, int64_t t0, int n, int h,
                                              int heads, int dk, int stride, float* qs, float* ks, float* Gs,
                                              float* glast) {
  for (int idx = threadIdx.x; idx < n * dk; idx += blockDim.x) {
    const int t = idx / dk, i = idx - t * dk;
    const int64_t src = ((t0 + t) * heads + h) * dk + i;
    if (qs != nullptr) qs[t * stride + i] = __bfloat162float(q[src]);
    if (ks != nullptr) ks[t * stride + i] = __bfloat162float(k[src]);
    Gs[t * stride + i] = g[src];
  }
  __syncthreads();
  for (int i = threadIdx.x; i < dk; i += blockDim.x) {
    float run = 0.0f;
    for (int t = 0; t < n; ++t) {
      run += Gs[t * stride + i];
      Gs[t * stride + i] = run;
    }
    if (glast != nullptr) glast[i] = run;
  }
  __syncthreads();
}

constexpr int kKdaSolveStride = static_cast<int>(kKdaChunk) + 8;  // Tinv's rows: 4 x 8 lanes, 32 banks

// Threads of both prep kernels: one CTA per SM fits their shared memory, so 16 warps, not 8, hide
// the latencies of its shared-memory loops.
constexpr int kKdaPrepThreads = 512;

// The intra-chunk matrices of one chunk of n tokens, from q, k and G as load_chunk_with_prefix
// left them (row stride `stride`) and bt (beta of the n tokens), into shared memory:
//   A[t][s] = sum_i k_t,i exp(G_t,i - G_s,i) k_s,i for s < t (row stride C),
//   Aq[t][s] likewise with q_t, s <= t (row stride C),
//   Tinv = (I + diag(beta) A)^-1, unit lower (row stride kKdaSolveStride),
// all zero past token n. Exponents are differences <= 0 (G only falls along the chunk; the
// clamp at 0 only touches the diagonal tiles' unused upper entries). A and Aq go by 4 x 4 tiles
// of (t, s), one lower-triangular tile per thread (136 of the 256), so that each step over i
// loads 20 values for 16 pairs instead of 5 per pair. Needs at least 256 threads, whole warps (the
// solve's lanes are the first 256); ends with a barrier.
__device__ inline void chunk_matrices(const float* qs, const float* ks, const float* Gs, int stride,
                                      const float* bt, int n, int dk, float* As, float* Aqs, float* Ts) {
  constexpr int C = static_cast<int>(kKdaChunk), R = 4, kTileRows = C / R;
  const int tid = threadIdx.x;
  if (tid < kTileRows * (kTileRows + 1) / 2) {
    int tr = 0;  // tile row: tiles are numbered row by row, tr + 1 of them in row tr
    while ((tr + 1) * (tr + 2) / 2 <= tid) ++tr;
    const int t0 = tr * R, s0 = (tid - tr * (tr + 1) / 2) * R;
    float a[R][R], aq[R][R];
#pragma unroll
    for (int x = 0; x < R; ++x)
#pragma unroll
      for (int y = 0; y < R; ++y) a[x][y] = aq[x][y] = 0.0f;
    if (t0 < n) {
#pragma unroll 2
      for (int i = 0; i < dk; ++i) {
        float gt[R], kt[R], qt[R], gs[R], kv[R];
#pragma unroll
        for (int x = 0; x < R; ++x) {
          gt[x] = Gs[(t0 + x) * stride + i];
          kt[x] = ks[(t0 + x) * stride + i];
          qt[x] = qs[(t0 + x) * stride + i];
          gs[x] = Gs[(s0 + x) * stride + i];
          kv[x] = ks[(s0 + x) * stride + i];
        }
#pragma unroll
        for (int x = 0; x < R; ++x)
#pragma unroll
          for (int y = 0; y < R; ++y) {
            const float w = expf(fminf(gt[x] - gs[y], 0.0f)) * kv[y];
            a[x][y] = fmaf(kt[x], w, a[x][y]);
            aq[x][y] = fmaf(qt[x], w, aq[x][y]);
          }
      }
    }
#pragma unroll
    for (int x = 0; x < R; ++x)
#pragma unroll
      for (int y = 0; y < R; ++y) {
        const int t = t0 + x, s = s0 + y;
        As[t * C + s] = t < n && s < t ? a[x][y] : 0.0f;
        Aqs[t * C + s] = t < n && s <= t ? aq[x][y] : 0.0f;
      }
  }
  for (int idx = tid; idx < C * C; idx += blockDim.x) {  // the tiles above the diagonal
    const int t = idx / C, s = idx - t * C;
    if (s / R > t / R) As[idx] = Aqs[idx] = 0.0f;
  }
  __syncthreads();
  // Column s of Tinv by forward substitution, (I + diag(beta) A) x = e_s: x_t = -beta_t sum_{r<t}
  // A[t][r] x_r below the diagonal. Four lanes of one warp per column split each row's sum, so
  // rows follow each other with only a warp barrier. Every lane runs all C rows: the shuffles
  // need the whole warp.
  const int s = tid / 4, sub = tid % 4;
  if (tid < 4 * C) {
    for (int t = 0; t < C; ++t) {
      float acc = 0.0f;
      for (int r = sub; r < t; r += 4) acc = fmaf(As[t * C + r], Ts[r * kKdaSolveStride + s], acc);
      acc += __shfl_xor_sync(0xffffffffu, acc, 1);
      acc += __shfl_xor_sync(0xffffffffu, acc, 2);
      if (sub == 0) {
        float x = 0.0f;
        if (t < n && s < n) x = t == s ? 1.0f : (t > s ? -bt[t] * acc : 0.0f);
        Ts[t * kKdaSolveStride + s] = x;
      }
      __syncwarp();
    }
  }
  __syncthreads();
}

// The prep kernels' shared memory (both preps, kda.cu and kda_backward.cu): q, k and G as [C,
// kKdaMaxDim + 1] tiles (the odd stride keeps column walks free of bank conflicts), A, Aq, Tinv,
// beta and G_last.
struct ChunkPrepTiles {
  static constexpr int kStride = static_cast<int>(kKdaMaxDim) + 1;
  static constexpr int kC = static_cast<int>(kKdaChunk);
  static constexpr size_t floats() {
    return 3 * kC * kStride + 2 * kC * kC + kC * kKdaSolveStride + kC + static_cast<int>(kKdaMaxDim);
  }
  explicit __device__ ChunkPrepTiles(float* smem)
      : qs(smem),
        ks(qs + kC * kStride),
        Gs(ks + kC * kStride),
        As(Gs + kC * kStride),
        Aqs(As + kC * kC),
        Ts(Aqs + kC * kC),
        bt(Ts + kC * kKdaSolveStride),
        gl(bt + kC) {}
  float* qs;   // [C, kStride]: q (then as each prep uses it)
  float* ks;   // [C, kStride]: k, then exp(G) k
  float* Gs;   // [C, kStride]: G
  float* As;   // [C, C]
  float* Aqs;  // [C, C]
  float* Ts;   // [C, kKdaSolveStride]: Tinv, then Tinv diag(beta)
  float* bt;   // [C]: beta
  float* gl;   // [kKdaMaxDim]: G of the chunk's last token
};

// The first steps of both preps for the chunk of n tokens from t0, head h: q, k, G, beta, then A,
// Aq and Tinv (chunk_matrices); Kb = exp(G_last - G) k and G_last out to kb_out [C, kKdaMaxDim]
// and glast_out [kKdaMaxDim] (zero past the chunk and past dk); `keep(tiles)` (every thread) while
// A, Aq and Tinv are as computed; then k becomes exp(G) k, q exp(G) q if scale_q, and Tinv
// Tinv diag(beta). Needs at least 256 threads, whole warps; ends with a barrier.
template <class Keep>
__device__ void chunk_prep(const __nv_bfloat16* __restrict__ q, const __nv_bfloat16* __restrict__ k,
                           const float* __restrict__ g, const float* __restrict__ beta, int64_t t0, int n,
                           int h, int heads, int dk, const ChunkPrepTiles& m, float* kb_out, float* glast_out,
                           bool scale_q, Keep keep) {
  constexpr int C = ChunkPrepTiles::kC, S = ChunkPrepTiles::kStride, D = static_cast<int>(kKdaMaxDim);
  const int tid = threadIdx.x;
  for (int t = tid; t < n; t += blockDim.x) m.bt[t] = beta[(t0 + t) * heads + h];
  load_chunk_with_prefix(q, k, g, t0, n, h, heads, dk, S, m.qs, m.ks, m.Gs, m.gl);
  chunk_matrices(m.qs, m.ks, m.Gs, S, m.bt, n, dk, m.As, m.Aqs, m.Ts);
  keep(m);
  for (int idx = tid; idx < C * D; idx += blockDim.x) {
    const int t = idx / D, i = idx - t * D;
    const bool live = t < n && i < dk;
    kb_out[idx] = live ? expf(m.gl[i] - m.Gs[t * S + i]) * m.ks[t * S + i] : 0.0f;
  }
  for (int i = tid; i < D; i += blockDim.x) glast_out[i] = i < dk ? m.gl[i] : 0.0f;
  __syncthreads();  // Kb read k and G, `keep` A, Aq and Tinv
  for (int idx = tid; idx < n * dk; idx += blockDim.x) {
    const int t = idx / dk, i = idx - t * dk, x = t * S + i;
    const float e = expf(m.Gs[x]);
    m.ks[x] *= e;
    if (scale_q) m.qs[x] *= e;
  }
  for (int idx = tid; idx < n * C; idx += blockDim.x) {
    const int t = idx / C, s = idx - t * C;
    if (s < n) m.Ts[t * kKdaSolveStride + s] *= m.bt[s];
  }
  __syncthreads();
}

}  // namespace spindle::cuda
