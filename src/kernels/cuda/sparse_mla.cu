// MLA's absorbed sparse attention on the tensor cores. See sparse_mla.h for the contract and the
// launch shape. Scores are kept in the log2 domain (scaled by scale * log2(e)) so that each
// exponential is one instruction (exp2_ftz in the forward).
#include <cmath>
#include <sstream>

#include "backend/cuda/check.h"
#include "core/error.h"
#include "kernels/cuda/launch.cuh"
#include "kernels/cuda/mma.cuh"
#include "kernels/cuda/shared_memory_limit.h"
#include "kernels/cuda/sparse_mla.h"
#include "kernels/cuda/sparse_mla_backward_hopper.h"
#include "kernels/cuda/sparse_mla_hopper.h"
#include "kernels/cuda/sparse_mla_tile.cuh"

namespace spindle::cuda {

namespace {

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
constexpr int kKeys = 64;  // selected rows per tile: in the score phase, 8 per warp and m16 tile
static_assert(kThreads >= kKeys, "a tile's indices are read by one thread each");
constexpr int kScoreStride = kKeys + 4;    // fp32 scores per shared row
constexpr int kProbStride = kKeys + kPad;  // bf16 probabilities per shared row

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

// acc[m][j] += probs [16 MT rows, kKeys] . values [kKeys, the warp's columns tile_column(j) ..], probs
// rows kProbStride apart, values the tile's rows ([key][column], stride bf16) with `units` 16-column
// units in all.
template <int MT>
__device__ __forceinline__ void probs_times_values(float (&acc)[MT][kMaxColTiles][4],
                                                   const __nv_bfloat16* probs, const __nv_bfloat16* values,
                                                   int stride, int units) {
  const int lane = threadIdx.x % 32;
  const uint32_t a_address = shared_address(probs + (lane % 16) * kProbStride + (lane / 16) * 8);
  // x4.trans: keys k .. k + 7 and k + 8 .. k + 15 at columns n and n + 8: b0, b1 of two n8 tiles.
  const uint32_t b_address =
      shared_address(values + ((lane % 8) + ((lane / 8) % 2) * 8) * stride + (lane / 16) * 8);
#pragma unroll
  for (int k = 0; k < kKeys; k += 16) {
    uint32_t a[MT][4];
#pragma unroll
    for (int m = 0; m < MT; ++m) ldmatrix_x4(a[m], a_address + (m * 16 * kProbStride + k) * 2);
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
// probs and dprobs (bf16, rows kProbStride apart), zero for keys whose `keys` entry is negative;
// lse (log2 domain, +inf for rows past the last head: P = 0) and delta by head row. mass, unless
// null: the fp32 probabilities summed over the tile's rows, by key.
__device__ __forceinline__ void probabilities_and_gradients(const float (&s)[2][4], const float (&dp)[2][4],
                                                            int row0, int key16, const int32_t* keys,
                                                            const float* lse, const float* delta,
                                                            float scale2, float scale, __nv_bfloat16* probs,
                                                            __nv_bfloat16* dprobs, float* mass) {
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
      *reinterpret_cast<uint32_t*>(probs + row * kProbStride + key0) = pack_bf16(p[0], p[1]);
      *reinterpret_cast<uint32_t*>(dprobs + row * kProbStride + key0) = pack_bf16(d[0], d[1]);
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
// from dprobs and probs ([row][key], rows kProbStride apart) by transposed loads, matrices (keys
// m0.., rows k0..), (keys m0 + 8.., rows k0..), (keys m0.., rows k0 + 8..), (keys m0 + 8.., rows
// k0 + 8..); B = Q or dO ([row][column]) by transposed loads, as probs_times_values reads values.
struct GradientOperands {
  uint32_t ds, p, q, dout;
};

__device__ __forceinline__ GradientOperands gradient_operands(const __nv_bfloat16* dprobs,
                                                              const __nv_bfloat16* probs,
                                                              const __nv_bfloat16* q, int q_stride,
                                                              const __nv_bfloat16* dout, int do_stride) {
  const int lane = threadIdx.x % 32;
  const int a_row = (lane % 8) + (lane / 16) * 8, a_key = ((lane / 8) % 2) * 8;
  const int b_row = (lane % 8) + ((lane / 8) % 2) * 8, b_col = (lane / 16) * 8;
  return {shared_address(dprobs + a_row * kProbStride + a_key),
          shared_address(probs + a_row * kProbStride + a_key), shared_address(q + b_row * q_stride + b_col),
          shared_address(dout + b_row * do_stride + b_col)};
}

struct Layout {
  int rows;  // heads per CTA: 16 * MT
  int qk_stride, v_stride;
  size_t q_bytes, do_bytes, kv_bytes, s_bytes, p_bytes, partial_bytes, total;
};

// The backward's scores: warp w takes row tile w % 2, keys 16 ((w / 2) % 4) .. + 15 and half w / 8
// of the reduction (dk for S, dv for dP); the second halves' partial sums pass through shared
// memory (kPartialBytes).
Layout layout(const SparseMlaShape& s, int mt, bool backward) {
  Layout l{};
  l.rows = 16 * mt;
  l.qk_stride = static_cast<int>(s.dk) + kPad;
  l.v_stride = static_cast<int>(s.dv) + kPad;
  l.q_bytes = static_cast<size_t>(l.rows) * l.qk_stride * 2;
  l.do_bytes = backward ? static_cast<size_t>(l.rows) * l.v_stride * 2 : 0;
  l.kv_bytes = 2 * static_cast<size_t>(kKeys) * l.qk_stride * 2;
  l.s_bytes = backward ? 0 : static_cast<size_t>(l.rows) * kScoreStride * 4;
  l.p_bytes = static_cast<size_t>(backward ? 2 : 1) * l.rows * kProbStride * 2;
  l.partial_bytes = backward ? kPartialBytes : 0;
  // + per-row statistics (3 floats), three tiles' selected indices and, backward, a tile's
  // probability mass per m16 tile of heads
  l.total = l.q_bytes + l.do_bytes + l.kv_bytes + l.s_bytes + l.p_bytes + l.partial_bytes + 3 * l.rows * 4 +
            3 * kKeys * 4 + (backward ? 2 * kKeys * 4 : 0);
  return l;
}

// The call's inputs and sizes (sparse_mla_tile.cuh, shared with the wgmma forward) and the outputs
// of either direction.
struct MlaArgs : SparseMlaInputs {
  const __nv_bfloat16* out_in;  // backward: the forward's output
  const float* lse_in;          // backward
  const __nv_bfloat16* dout;    // backward
  __nv_bfloat16* out;           // forward
  float* lse;                   // forward
  __nv_bfloat16* dq;            // backward
  float* d_latent;              // backward
  float* mass;                  // backward, optional: the probabilities summed over the heads
};

// Slot tile * kKeys + threadIdx.x of query t's selection for the first kKeys threads (-1 past the
// width and for the other threads). Read a tile ahead of its use, so that the load's latency hides
// behind a tile's work.
__device__ __forceinline__ int32_t tile_index(const MlaArgs& a, int64_t t, int64_t tile) {
  const int64_t slot = tile * kKeys + threadIdx.x;
  return threadIdx.x < kKeys && slot < a.width ? a.selected[t * a.width + slot] : -1;
}

// The score phase's share of warp w: m16 tile w / 8 of the rows (none past MT), keys 8 (w % 8) ..
// 8 (w % 8) + 7 of the tile.
__device__ __forceinline__ int score_tile() { return threadIdx.x / 32 / (kKeys / 8); }
__device__ __forceinline__ int score_key0() { return threadIdx.x / 32 % (kKeys / 8) * 8; }

// acc += rows[16, :dim] . keys[8, :dim]^T: the warp's m16 tile of rows against its 8 keys, both in
// shared memory with the given strides (bf16).
__device__ __forceinline__ void rows_times_keys(float (&acc)[4], const __nv_bfloat16* rows, int row_stride,
                                                const __nv_bfloat16* keys, int key_stride, int dim) {
  const int lane = threadIdx.x % 32;
  const uint32_t a_address = shared_address(rows + (lane % 16) * row_stride + (lane / 16) * 8);
  // x4: the warp's 8 key rows at k, k + 8, k + 16, k + 24: b0, b1 of two k16 steps.
  const uint32_t b_address = shared_address(keys + (lane % 8) * key_stride + (lane / 8) * 8);
  float odd[4] = {};  // the k + 16 steps: a second chain of dependent mma
  int k = 0;
  for (; k + 32 <= dim; k += 32) {
    uint32_t b[4], a0[4], a1[4];
    ldmatrix_x4(b, b_address + k * 2);
    ldmatrix_x4(a0, a_address + k * 2);
    ldmatrix_x4(a1, a_address + (k + 16) * 2);
    mma_bf16(acc, a0, b[0], b[1]);
    mma_bf16(odd, a1, b[2], b[3]);
  }
#pragma unroll
  for (int e = 0; e < 4; ++e) acc[e] += odd[e];
  if (k < dim) {  // a last 16
    uint32_t b[2], a0[4];
    ldmatrix_x2(b, b_address + k * 2);
    ldmatrix_x4(a0, a_address + k * 2);
    mma_bf16(acc, a0, b[0], b[1]);
  }
}

template <int MT>
__global__ void __launch_bounds__(kThreads, 1) sparse_mla_forward_kernel(const MlaArgs a) {
  wait_for_earlier_kernels();
  extern __shared__ __align__(16) unsigned char shared[];
  constexpr int R = 16 * MT;
  const int64_t t = blockIdx.x;
  const int h0 = blockIdx.y * R, tid = threadIdx.x, lane = tid % 32, warp = tid / 32, g = lane / 4,
            c = lane % 4;
  const int qk_stride = a.dk + kPad;
  __nv_bfloat16* q_s = reinterpret_cast<__nv_bfloat16*>(shared);                  // [R][qk_stride]
  __nv_bfloat16* kv_s = q_s + R * qk_stride;                                      // [2][kKeys][qk_stride]
  float* s_s = reinterpret_cast<float*>(kv_s + 2 * kKeys * qk_stride);            // [R][kScoreStride]
  __nv_bfloat16* p_s = reinterpret_cast<__nv_bfloat16*>(s_s + R * kScoreStride);  // [R][kProbStride]
  float* m_s = reinterpret_cast<float*>(p_s + R * kProbStride);                   // [R] running max (log2)
  float* l_s = m_s + R;                                                           // [R] running sum
  float* alpha_s = l_s + R;                                                       // [R] this tile's rescale
  int32_t* idx_s = reinterpret_cast<int32_t*>(alpha_s + R);                       // [3][kKeys]

  const int64_t tiles = (a.width + kKeys - 1) / kKeys;
  load_rows(q_s, a.q, t, h0, R, a.heads, a.dk, qk_stride);
  if (tid < kKeys) idx_s[tid] = tile_index(a, t, 0);
  int32_t next_index = tile_index(a, t, 1);
  __syncthreads();
  if (tiles > 0) load_tile(kv_s, idx_s, kKeys, a.latent, a.latent_stride, a.dk);
  copy_commit();
  for (int r = tid; r < R; r += kThreads) {
    m_s[r] = -INFINITY;
    l_s[r] = 0.0f;
  }
  const int v_units = a.dv / 16;
  float acc[MT][kMaxColTiles][4] = {};
  // Softmax rows: `per_row` consecutive threads (of one warp) share a row, each over kKeys /
  // per_row keys.
  constexpr int per_row = kThreads / R, keys_per_thread = kKeys / per_row;
  static_assert(per_row <= 32 && keys_per_thread >= 1, "a softmax row within one warp");
  const int srow = tid / per_row, spart = tid % per_row;

  // Tile i's rows are in buffer i % 2, its indices in idx_s's slot i % 3: the slot written for
  // tile + 1 was last read for tile - 2, before the barrier of tile - 1.
  for (int64_t tile = 0; tile < tiles; ++tile) {
    const int buf = static_cast<int>(tile & 1);
    int32_t* next_idx = idx_s + ((tile + 1) % 3) * kKeys;
    if (tid < kKeys) next_idx[tid] = next_index;
    copy_wait_all();
    __syncthreads();  // the tile (and q) landed for every thread; the other buffer is free
    if (tile + 1 < tiles)
      load_tile(kv_s + (buf ^ 1) * kKeys * qk_stride, next_idx, kKeys, a.latent, a.latent_stride, a.dk);
    copy_commit();
    next_index = tile_index(a, t, tile + 2);
    const __nv_bfloat16* keys = kv_s + buf * kKeys * qk_stride;
    const int32_t* idx = idx_s + (tile % 3) * kKeys;

    const int row_tile = score_tile(), key0 = score_key0() + 2 * c;
    if (row_tile < MT) {
      float s[4] = {};
      rows_times_keys(s, q_s + row_tile * 16 * qk_stride, qk_stride, keys + score_key0() * qk_stride,
                      qk_stride, a.dk);
      const bool v0 = idx[key0] >= 0, v1 = idx[key0 + 1] >= 0;
      float* row_a = s_s + (row_tile * 16 + g) * kScoreStride + key0;
      float* row_b = row_a + 8 * kScoreStride;
      row_a[0] = v0 ? s[0] * a.scale2 : -INFINITY;
      row_a[1] = v1 ? s[1] * a.scale2 : -INFINITY;
      row_b[0] = v0 ? s[2] * a.scale2 : -INFINITY;
      row_b[1] = v1 ? s[3] * a.scale2 : -INFINITY;
    }
    __syncthreads();

    {  // Online softmax over the tile, per row.
      const float* srow_p = s_s + srow * kScoreStride + spart * keys_per_thread;
      float mx = -INFINITY;
#pragma unroll
      for (int j = 0; j < keys_per_thread; ++j) mx = fmaxf(mx, srow_p[j]);
#pragma unroll
      for (int offset = per_row / 2; offset > 0; offset /= 2)
        mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, offset));
      const float m_old = m_s[srow], m_new = fmaxf(m_old, mx);
      const bool none = m_new == -INFINITY;  // no selected key so far
      float sum = 0.0f;
      __nv_bfloat16* prow = p_s + srow * kProbStride + spart * keys_per_thread;
#pragma unroll
      for (int j = 0; j < keys_per_thread; ++j) {
        const float p = none ? 0.0f : exp2_ftz(srow_p[j] - m_new);
        prow[j] = __float2bfloat16(p);
        sum += p;
      }
#pragma unroll
      for (int offset = per_row / 2; offset > 0; offset /= 2)
        sum += __shfl_xor_sync(0xffffffffu, sum, offset);
      if (spart == 0) {
        const float alpha = none ? 1.0f : exp2_ftz(m_old - m_new);
        m_s[srow] = m_new;
        l_s[srow] = l_s[srow] * alpha + sum;
        alpha_s[srow] = alpha;
      }
    }
    __syncthreads();

#pragma unroll
    for (int m = 0; m < MT; ++m) {
      const float alpha_a = alpha_s[m * 16 + g], alpha_b = alpha_s[m * 16 + g + 8];
#pragma unroll
      for (int j = 0; j < kMaxColTiles; ++j) {
        acc[m][j][0] *= alpha_a;
        acc[m][j][1] *= alpha_a;
        acc[m][j][2] *= alpha_b;
        acc[m][j][3] *= alpha_b;
      }
    }
    probs_times_values<MT>(acc, p_s, keys, qk_stride, v_units);
  }
  __syncthreads();  // l_s, m_s final (also when there was no tile)

#pragma unroll
  for (int m = 0; m < MT; ++m) {
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      const int row = m * 16 + g + 8 * half;
      if (h0 + row >= a.heads) continue;
      const float l = l_s[row], inv = l > 0.0f ? 1.0f / l : 0.0f;
      __nv_bfloat16* dst = a.out + (t * a.heads + h0 + row) * a.dv + 2 * c;
#pragma unroll
      for (int j = 0; j < kMaxColTiles; ++j) {
        if (warp + kWarps * (j / 2) >= v_units) break;
        *reinterpret_cast<uint32_t*>(dst + tile_column(j)) =
            pack_bf16(acc[m][j][2 * half] * inv, acc[m][j][2 * half + 1] * inv);
      }
    }
  }
  for (int r = tid; r < R; r += kThreads) {
    if (h0 + r >= a.heads) continue;
    const float l = l_s[r];
    a.lse[t * a.heads + h0 + r] = l > 0.0f ? (m_s[r] + log2f(l)) / kLog2e : INFINITY;
  }
}

template <int MT>
__global__ void __launch_bounds__(kThreads, 1) sparse_mla_backward_kernel(const MlaArgs a) {
  wait_for_earlier_kernels();
  extern __shared__ __align__(16) unsigned char shared[];
  constexpr int R = 16 * MT;
  const int64_t t = blockIdx.x;
  const int h0 = blockIdx.y * R, tid = threadIdx.x, lane = tid % 32, warp = tid / 32, g = lane / 4,
            c = lane % 4;
  const int qk_stride = a.dk + kPad, v_stride = a.dv + kPad;
  __nv_bfloat16* q_s = reinterpret_cast<__nv_bfloat16*>(shared);        // [R][qk_stride]
  __nv_bfloat16* do_s = q_s + R * qk_stride;                            // [R][v_stride]
  __nv_bfloat16* kv_s = do_s + R * v_stride;                            // [2][kKeys][qk_stride]
  __nv_bfloat16* p_s = kv_s + 2 * kKeys * qk_stride;                    // [R][kProbStride]
  __nv_bfloat16* ds_s = p_s + R * kProbStride;                          // [R][kProbStride]
  float* partial_s = reinterpret_cast<float*>(ds_s + R * kProbStride);  // kPartialBytes: the scores' halves
  float* delta_s = partial_s + kPartialBytes / 4;                       // [R] rowsum(dO o O)
  float* lse_s = delta_s + R;                                           // [R] log2 domain
  int32_t* idx_s = reinterpret_cast<int32_t*>(lse_s + 2 * R);           // [3][kKeys]
  float* mass_s = reinterpret_cast<float*>(idx_s + 3 * kKeys);          // [2][kKeys] by row tile

  const int64_t tiles = (a.width + kKeys - 1) / kKeys;
  load_rows(q_s, a.q, t, h0, R, a.heads, a.dk, qk_stride);
  load_rows(do_s, a.dout, t, h0, R, a.heads, a.dv, v_stride);
  if (tid < kKeys) idx_s[tid] = tile_index(a, t, 0);
  int32_t next_index = tile_index(a, t, 1);
  __syncthreads();
  if (tiles > 0) load_tile(kv_s, idx_s, kKeys, a.latent, a.latent_stride, a.dk);
  copy_commit();
  {  // delta = rowsum(dO o O), `per_row` threads per row
    constexpr int per_row = kThreads / R;
    const int row = tid / per_row, part = tid % per_row;
    float sum = 0.0f;
    if (h0 + row < a.heads) {
      const int64_t base = (t * a.heads + h0 + row) * a.dv;
      for (int col = part; col < a.dv; col += per_row)
        sum += __bfloat162float(a.dout[base + col]) * __bfloat162float(a.out_in[base + col]);
    }
#pragma unroll
    for (int offset = per_row / 2; offset > 0; offset /= 2) sum += __shfl_xor_sync(0xffffffffu, sum, offset);
    if (part == 0) {
      delta_s[row] = sum;
      lse_s[row] = h0 + row < a.heads ? a.lse_in[t * a.heads + h0 + row] * kLog2e : INFINITY;
    }
  }
  const int k_units = a.dk / 16;
  float dq[MT][kMaxColTiles][4] = {};

  // Rows and indices by tile as in the forward. Once dQ has read a tile's keys, their buffer stages
  // the selected rows' gradient, 32 rows at a time (dk fp32 each, dk + kPad apart: the buffer's
  // size exactly), which the TMA adds into d_latent while the warps go on; thread 0 issues the
  // bulk reductions and waits for their reads of the buffer before it is written again (the next
  // half, or the next tile's keys two tiles on).
  const int staged_stride = a.dk + kPad;
  for (int64_t tile = 0; tile < tiles; ++tile) {
    const int buf = static_cast<int>(tile & 1);
    int32_t* next_idx = idx_s + ((tile + 1) % 3) * kKeys;
    if (tid < kKeys) next_idx[tid] = next_index;
    copy_wait_all();
    __syncthreads();  // the tile landed; p_s and ds_s are free
    next_index = tile_index(a, t, tile + 2);
    const __nv_bfloat16* keys = kv_s + buf * kKeys * qk_stride;
    const int32_t* idx = idx_s + (tile % 3) * kKeys;

    // S and dP for the warp's m16 tile and 16 keys over its half of the reduction; the second
    // halves' sums pass to the first, which make P and dS.
    const int row_tile = warp % 2, key16 = (warp / 2) % 4 * 16, k_half = warp / 8;
    float s[2][4] = {}, dp[2][4] = {};
    if (row_tile < MT) {
      const int k_mid = a.dk / 32 * 16;  // a multiple of 16: the first half's end
      scores_over_range(s, dp, q_s + row_tile * 16 * qk_stride, qk_stride, do_s + row_tile * 16 * v_stride,
                        v_stride, keys + key16 * qk_stride, qk_stride, k_half == 0 ? 0 : k_mid,
                        k_half == 0 ? k_mid : a.dk, a.dv);
      if (k_half == 1) {
        float4* to = reinterpret_cast<float4*>(partial_s) + (warp - 8) * 4 * 32 + lane;
#pragma unroll
        for (int n = 0; n < 2; ++n) {
          to[(2 * n) * 32] = make_float4(s[n][0], s[n][1], s[n][2], s[n][3]);
          to[(2 * n + 1) * 32] = make_float4(dp[n][0], dp[n][1], dp[n][2], dp[n][3]);
        }
      }
    }
    __syncthreads();
    if (row_tile < MT && k_half == 0) {
      const float4* from = reinterpret_cast<const float4*>(partial_s) + warp * 4 * 32 + lane;
#pragma unroll
      for (int n = 0; n < 2; ++n) {
        const float4 ps = from[(2 * n) * 32], pd = from[(2 * n + 1) * 32];
        s[n][0] += ps.x, s[n][1] += ps.y, s[n][2] += ps.z, s[n][3] += ps.w;
        dp[n][0] += pd.x, dp[n][1] += pd.y, dp[n][2] += pd.z, dp[n][3] += pd.w;
      }
      probabilities_and_gradients(s, dp, row_tile * 16, key16, idx, lse_s, delta_s, a.scale2, a.scale, p_s,
                                  ds_s, a.mass != nullptr ? mass_s + row_tile * kKeys : nullptr);
    }
    if (tid == 0) bulk_wait_read<0>();  // the previous tile's gradient has left the other buffer
    __syncthreads();
    if (tile + 1 < tiles)
      load_tile(kv_s + (buf ^ 1) * kKeys * qk_stride, next_idx, kKeys, a.latent, a.latent_stride, a.dk);
    copy_commit();
    if (a.mass != nullptr && tid < kKeys && tile * kKeys + tid < a.width) {
      // One add per slot and CTA: with one CTA per query (heads <= R) it lands on the caller's
      // zero alone, so the sum is deterministic; mass_s is written again after the next barrier.
      const float column = MT == 2 ? mass_s[tid] + mass_s[kKeys + tid] : mass_s[tid];
      atomicAdd(a.mass + t * a.width + tile * kKeys + tid, column);
    }

    // dQ += dS K over the warp's dk columns.
    probs_times_values<MT>(dq, ds_s, keys, qk_stride, k_units);
    __syncthreads();  // nobody reads the keys any more
    float* staged = reinterpret_cast<float*>(kv_s + buf * kKeys * qk_stride);

    // The selected rows' gradient, [64 keys, dk] = dS^T Q + P^T dO (the value part: columns < dv),
    // 32 keys at a time (two m16 tiles), the warp's dk columns.
    const GradientOperands ops = gradient_operands(ds_s, p_s, q_s, qk_stride, do_s, v_stride);
#pragma unroll
    for (int half = 0; half < kKeys / 32; ++half) {
      float dl[2][kMaxColTiles][4] = {};
#pragma unroll
      for (int k = 0; k < R; k += 16) {
        // Both m16 tiles' A first, so that each B fragment of Q and dO is read once for both.
        uint32_t ads[2][4], ap[2][4];
#pragma unroll
        for (int mi = 0; mi < 2; ++mi) {
          const int m0 = half * 32 + mi * 16;
          ldmatrix_x4_trans(ads[mi], ops.ds + (k * kProbStride + m0) * 2);
          ldmatrix_x4_trans(ap[mi], ops.p + (k * kProbStride + m0) * 2);
        }
#pragma unroll
        for (int j = 0; j < kMaxColTiles; j += 2) {
          if (warp + kWarps * (j / 2) >= k_units) break;
          uint32_t b[4];
          ldmatrix_x4_trans(b, ops.q + (k * qk_stride + tile_column(j)) * 2);
#pragma unroll
          for (int mi = 0; mi < 2; ++mi) {
            mma_bf16(dl[mi][j], ads[mi], b[0], b[1]);
            mma_bf16(dl[mi][j + 1], ads[mi], b[2], b[3]);
          }
          if (tile_column(j) < a.dv) {  // dv is a multiple of 16: both n8 tiles or neither
            ldmatrix_x4_trans(b, ops.dout + (k * v_stride + tile_column(j)) * 2);
#pragma unroll
            for (int mi = 0; mi < 2; ++mi) {
              mma_bf16(dl[mi][j], ap[mi], b[0], b[1]);
              mma_bf16(dl[mi][j + 1], ap[mi], b[2], b[3]);
            }
          }
        }
      }
      if (half > 0) {  // the first half's rows have left the buffer
        if (tid == 0) bulk_wait_read<0>();
        __syncthreads();
      }
#pragma unroll
      for (int mi = 0; mi < 2; ++mi) {
#pragma unroll
        for (int rh = 0; rh < 2; ++rh) {
          float* dst = staged + (mi * 16 + g + 8 * rh) * staged_stride + 2 * c;
#pragma unroll
          for (int j = 0; j < kMaxColTiles; ++j) {
            if (warp + kWarps * (j / 2) >= k_units) break;
            *reinterpret_cast<float2*>(dst + tile_column(j)) =
                make_float2(dl[mi][j][2 * rh], dl[mi][j][2 * rh + 1]);
          }
        }
      }
      fence_async_shared();
      __syncthreads();
      if (tid == 0) {
        for (int r = 0; r < 32; ++r) {
          const int32_t index = idx[half * 32 + r];
          if (index >= 0)
            bulk_reduce_add(a.d_latent + static_cast<int64_t>(index) * a.latent_stride,
                            staged + r * staged_stride, static_cast<uint32_t>(a.dk) * 4);
        }
        bulk_commit();
      }
    }
  }
  if (tid == 0) bulk_wait_all();  // the shared memory stays the CTA's until the last reads

#pragma unroll
  for (int m = 0; m < MT; ++m) {
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      const int row = m * 16 + g + 8 * half;
      if (h0 + row >= a.heads) continue;
      __nv_bfloat16* dst = a.dq + (t * a.heads + h0 + row) * a.dk + 2 * c;
#pragma unroll
      for (int j = 0; j < kMaxColTiles; ++j) {
        if (warp + kWarps * (j / 2) >= k_units) break;
        *reinterpret_cast<uint32_t*>(dst + tile_column(j)) =
            pack_bf16(dq[m][j][2 * half], dq[m][j][2 * half + 1]);
      }
    }
  }
}

int m_tiles(const SparseMlaShape& s) { return s.heads <= 16 ? 1 : 2; }

template <class Kernel>
void launch(Kernel kernel, const SparseMlaShape& s, const MlaArgs& args, size_t shared_bytes,
            cudaStream_t stream, const char* name) {
  allow_shared_memory(kernel, shared_bytes, name, ": dk ", s.dk, ", dv ", s.dv, ", ", s.heads, " heads");
  const int rows = 16 * m_tiles(s);
  const dim3 grid(static_cast<unsigned>(s.tokens), static_cast<unsigned>((s.heads + rows - 1) / rows));
  launch_kernel(kernel, grid, kThreads, shared_bytes, stream, args);
  SPINDLE_LAUNCHED(name);
}

void check_supported(const SparseMlaShape& s, const void* q, const void* latent) {
  const std::string why = sparse_mla_unsupported(s);
  check(why.empty(), "sparse MLA on the tensor cores: ", why);
  check(reinterpret_cast<uintptr_t>(q) % 16 == 0 && reinterpret_cast<uintptr_t>(latent) % 16 == 0,
        "sparse MLA: q and the latent must be 16-byte aligned (cp.async)");
}

// The inputs and sizes both directions share; the caller sets its own outputs.
MlaArgs shape_args(const SparseMlaShape& s, const __nv_bfloat16* q, const __nv_bfloat16* latent,
                   const int32_t* selected) {
  MlaArgs args{};
  static_cast<SparseMlaInputs&>(args) = sparse_mla_inputs(s, q, latent, selected);
  return args;
}

}  // namespace

std::string sparse_mla_unsupported(const SparseMlaShape& s) {
  std::ostringstream why;
  if (s.dk % 16 != 0 || s.dv % 16 != 0 || s.dv < 16 || s.dv > s.dk || s.dk > kMaxDim)
    why << "dk " << s.dk << " and dv " << s.dv
        << " must be multiples of 16 with 16 <= dv <= dk <= " << kMaxDim;
  else if (s.latent_stride < s.dk || s.latent_stride % 8 != 0)
    why << "the latent's row stride " << s.latent_stride << " must be >= dk and a multiple of 8";
  else if (s.heads < 1 || s.tokens < 0 || s.width < 0 || s.tokens >= (int64_t{1} << 31))
    why << "heads " << s.heads << ", tokens " << s.tokens << ", width " << s.width << " out of range";
  return why.str();
}

void sparse_mla_forward(const SparseMlaShape& s, const __nv_bfloat16* q, const __nv_bfloat16* latent,
                        const int32_t* selected, __nv_bfloat16* out, float* lse, cudaStream_t stream) {
  if (sparse_mla_hopper_takes(s)) {
    sparse_mla_forward_hopper(s, q, latent, selected, out, lse, stream);
    return;
  }
  check_supported(s, q, latent);
  if (s.tokens == 0) return;
  MlaArgs args = shape_args(s, q, latent, selected);
  args.out = out;
  args.lse = lse;
  launch(m_tiles(s) == 1 ? sparse_mla_forward_kernel<1> : sparse_mla_forward_kernel<2>, s, args,
         layout(s, m_tiles(s), false).total, stream, "sparse_mla_forward_kernel");
}

void sparse_mla_backward(const SparseMlaShape& s, const __nv_bfloat16* q, const __nv_bfloat16* latent,
                         const int32_t* selected, const __nv_bfloat16* out, const float* lse,
                         const __nv_bfloat16* dout, __nv_bfloat16* dq, float* d_latent, float* mass,
                         cudaStream_t stream) {
  if (sparse_mla_backward_hopper_takes(s))
    sparse_mla_backward_hopper(s, q, latent, selected, out, lse, dout, dq, d_latent, mass, stream);
  else
    sparse_mla_backward_mma(s, q, latent, selected, out, lse, dout, dq, d_latent, mass, stream);
}

void sparse_mla_backward_mma(const SparseMlaShape& s, const __nv_bfloat16* q, const __nv_bfloat16* latent,
                             const int32_t* selected, const __nv_bfloat16* out, const float* lse,
                             const __nv_bfloat16* dout, __nv_bfloat16* dq, float* d_latent, float* mass,
                             cudaStream_t stream) {
  check_supported(s, q, latent);
  check(reinterpret_cast<uintptr_t>(dout) % 16 == 0, "sparse MLA: dout must be 16-byte aligned (cp.async)");
  if (s.tokens == 0) return;
  MlaArgs args = shape_args(s, q, latent, selected);
  args.out_in = out;
  args.lse_in = lse;
  args.dout = dout;
  args.dq = dq;
  args.d_latent = d_latent;
  args.mass = mass;
  launch(m_tiles(s) == 1 ? sparse_mla_backward_kernel<1> : sparse_mla_backward_kernel<2>, s, args,
         layout(s, m_tiles(s), true).total, stream, "sparse_mla_backward_kernel");
}

}  // namespace spindle::cuda
