// What the KDA kernels (kda.cu, kda_backward.cu) share: loading one chunk of a head and its
// intra-chunk matrices.
#pragma once

#include <cuda_bf16.h>

#include <cstdint>
#include <type_traits>

#include "kernels/cuda/kda.h"
#include "kernels/cuda/log2_domain.h"
#include "kernels/cuda/mma.cuh"

namespace spindle::cuda {

// rows x cols floats of a row-major global matrix (row stride ss) into shared rows of stride ds
// (16-byte aligned) by cp.async, the CTA's threads taking turns, so that all of it is in flight at
// once: 16-byte copies where every source row starts 16-byte aligned and cols is a multiple of 4,
// 4-byte ones otherwise. Commits nothing.
__device__ inline void stage_rows(float* dst, int ds, const float* src, int64_t ss, int rows, int cols) {
  if (cols % 4 == 0 && ss % 4 == 0 && reinterpret_cast<uintptr_t>(src) % 16 == 0) {
    const int quads = cols / 4;
    for (int p = threadIdx.x; p < rows * quads; p += blockDim.x) {
      const int r = p / quads, x = 4 * (p - r * quads);
      copy16(dst + r * ds + x, src + r * ss + x, true);
    }
  } else {
    for (int p = threadIdx.x; p < rows * cols; p += blockDim.x) {
      const int r = p / cols, x = p - r * cols;
      copy4(dst + r * ds + x, src + r * ss + x, true);
    }
  }
}

// The chunk's k and q (each unless null) as fp32 and its prefix sums G into [C, stride] shared
// tiles, every column < kKdaMaxDim written (zero past dk; past the chunk k and q are zero and G
// stays at the last token's), glast [kKdaMaxDim] = G of the last token. Each channel's C tokens in
// P parts of C / P, each summed by one thread, then offset by the parts before it (part [P,
// kKdaMaxDim]: scratch for their sums); kThreads threads take P kKdaMaxDim / kThreads parts each,
// all of a thread's loads in flight at once. G's rounding depends on P, not on kThreads: kernels
// that must agree bit for bit take the same P. Ends with a barrier.
// The KDA kernels keep G in the log2 domain (times log2(e)): every decay factor exp(G_t - G_s) in
// their formulas is one exp2_ftz, and so is the glast they pass to each other.
template <int P, int kThreads = static_cast<int>(kKdaMaxDim) * P>
__device__ inline void load_chunk_batched(const __nv_bfloat16* __restrict__ q,
                                          const __nv_bfloat16* __restrict__ k, const float* __restrict__ g,
                                          int64_t t0, int n, int h, int heads, int dk, int stride, float* qs,
                                          float* ks, float* Gs, float* part, float* glast) {
  constexpr int D = static_cast<int>(kKdaMaxDim), L = static_cast<int>(kKdaChunk) / P;
  constexpr int R = P * D / kThreads;  // parts per thread: p, p + kThreads / D, ..
  static_assert(R * kThreads == P * D, "whole parts per thread");
  const int i = threadIdx.x % D, p0 = threadIdx.x / D;
  float gv[R][L], kv[R][L], qv[R][L];
#pragma unroll
  for (int j = 0; j < R; ++j) {
    const int tb = (p0 + kThreads / D * j) * L;
#pragma unroll
    for (int r = 0; r < L; ++r) {
      const bool live = i < dk && tb + r < n;
      const int64_t src = ((t0 + tb + r) * heads + h) * dk + i;
      gv[j][r] = live ? g[src] * kLog2e : 0.0f;
      kv[j][r] = live && k != nullptr ? __bfloat162float(k[src]) : 0.0f;
      qv[j][r] = live && q != nullptr ? __bfloat162float(q[src]) : 0.0f;
    }
  }
#pragma unroll
  for (int j = 0; j < R; ++j) {
#pragma unroll
    for (int r = 1; r < L; ++r) gv[j][r] += gv[j][r - 1];
    part[(p0 + kThreads / D * j) * D + i] = gv[j][L - 1];
  }
  __syncthreads();
#pragma unroll
  for (int j = 0; j < R; ++j) {
    const int p = p0 + kThreads / D * j, tb = p * L;
    float base = 0.0f;
#pragma unroll
    for (int pp = 0; pp < P - 1; ++pp)
      if (pp < p) base += part[pp * D + i];
    if (p == P - 1) glast[i] = base + gv[j][L - 1];
#pragma unroll
    for (int r = 0; r < L; ++r) {
      Gs[(tb + r) * stride + i] = base + gv[j][r];
      if (ks != nullptr) ks[(tb + r) * stride + i] = kv[j][r];
      if (qs != nullptr) qs[(tb + r) * stride + i] = qv[j][r];
    }
  }
  __syncthreads();
}

// The chunk's rows of head h in a bf16 [tokens, heads, dk] tensor (q, k) into a [C, stride] bf16
// tile (16-byte aligned rows), zero past its n tokens and past dk: a copy, so by cp.async (commits
// nothing; no registers held while the loads are in flight) on pairs of values where dk is even,
// by plain loads where it is odd.
__device__ inline void stage_chunk_rows(__nv_bfloat16* dst, int stride, const __nv_bfloat16* src, int64_t t0,
                                        int n, int h, int heads, int dk) {
  constexpr int C = static_cast<int>(kKdaChunk), D = static_cast<int>(kKdaMaxDim);
  const __nv_bfloat16* rows = src + (t0 * heads + h) * dk;
  const int64_t ss = static_cast<int64_t>(heads) * dk;
  const bool pairs = dk % 2 == 0;
  if (pairs)
    stage_rows(reinterpret_cast<float*>(dst), stride / 2, reinterpret_cast<const float*>(rows), ss / 2, n,
               dk / 2);
  if (n == C && dk == D) return;  // a whole chunk at the widest dk: no zeros, every pair copied
  for (int p = threadIdx.x; p < C * D; p += blockDim.x) {
    const int t = p / D, i = p - t * D;
    if (t >= n || i >= dk) {
      dst[t * stride + i] = __float2bfloat16(0.0f);
    } else if (!pairs) {
      dst[t * stride + i] = rows[t * ss + i];
    }
  }
}

// Tinv's rows: 4 mod 32 words, as W's (and the backward's P's) mma A-operand reads want (rows g,
// columns c in distinct banks); the solve reads it by float4 rows and its substitution not at all.
constexpr int kKdaSolveStride = static_cast<int>(kKdaChunk) + 4;

// The preps' products on the tensor cores: TF32 mma, as 3xTF32 (each fp32 operand split into two
// TF32 parts by tf32_split, three mma per product) so that A, Aq, W and U0 keep fp32-level
// accuracy (~1e-6 relative instead of TF32's ~3e-4). false: plain TF32, one mma per product.
constexpr bool kKdaSplitTf32 = true;
// The split flag of an operand that holds bf16 values (v, dO): exact in TF32, so never split; a
// product with one takes two mma instead of three at 3xTF32's accuracy (mma_tf32).
constexpr bool kKdaBf16Operand = false;
using KdaFragA = Tf32Frag<4, kKdaSplitTf32>;
using KdaFragB = Tf32Frag<2, kKdaSplitTf32>;

// A q or k tile's value as fp32 (bf16 tiles hold bf16 inputs: exact either way).
__device__ inline float tile_float(float x) { return x; }
__device__ inline float tile_float(__nv_bfloat16 x) { return __bfloat162float(x); }

// The parts that both preps sum a chunk's G in (load_chunk_batched; the backward's grad kernel
// takes as many): whatever their thread counts, their G, and all that follows from it, are bit for
// bit the same.
constexpr int kKdaPrepParts = 4;

// A prep kernel's chunk in shared memory (both preps, kda.cu and kda_backward.cu), for kThreadsT
// threads: q and k as [C, kQkStride] tiles of E, G [C, kStride] (fp32), A [C, kAStride], Tinv, the
// Tinv solve's block products, beta and G_last; Aq in a [C, kAStride] tile of its own if kAqTile,
// else in the caller's global [C, C]. Row strides of 4 mod 32 words: the mma fragments' rows g and
// columns c, a row-major [token, channel] tile read as g * stride + c, fall in distinct banks (in
// 16 banks for bf16, two columns a word).
template <class E, bool kAqTile, int kThreadsT>
struct KdaPrepTiles {
  static constexpr bool kFp32 = std::is_same_v<E, float>;  // q and k as fp32, else bf16
  static constexpr int kThreads = kThreadsT;
  static constexpr int kStride = static_cast<int>(kKdaMaxDim) + 4;
  static constexpr int kQkStride = static_cast<int>(kKdaMaxDim) + 16 / static_cast<int>(sizeof(E));
  static constexpr int kC = static_cast<int>(kKdaChunk);
  static constexpr int kSub = 16;          // sub-chunk: one mma's rows
  static constexpr int kSubs = kC / kSub;  // sub-chunks per chunk
  static constexpr int kAStride = kC + 4;  // A and Aq: mma A operands too
  static constexpr int kAqStride = kAqTile ? kAStride : kC;
  static constexpr int kOffDiag = kSubs * (kSubs - 1) / 2;  // blocks below the diagonal
  static constexpr int kNFloats = kOffDiag * kSub * kSub;   // ns
  static constexpr int kQkFloats = kC * kQkStride * static_cast<int>(sizeof(E)) / 4;  // q's or k's tile
  static_assert(kQkFloats * 4 % 16 == 0, "tiles 16-byte aligned");
  static constexpr size_t floats() {
    return 2 * kQkFloats + kC * kStride + (kAqTile ? 2 : 1) * kC * kAStride + kC * kKdaSolveStride +
           kNFloats + kC + static_cast<int>(kKdaMaxDim);
  }
  // aq: where Aq goes without a tile of its own.
  explicit __device__ KdaPrepTiles(float* smem, float* aq = nullptr)
      : qs(reinterpret_cast<E*>(smem)),
        ks(reinterpret_cast<E*>(smem + kQkFloats)),
        Gs(smem + 2 * kQkFloats),
        As(Gs + kC * kStride),
        Aqs(kAqTile ? As + kC * kAStride : aq),
        Ts(As + (kAqTile ? 2 : 1) * kC * kAStride),
        ns(Ts + kC * kKdaSolveStride),
        bt(ns + kNFloats),
        gl(bt + kC) {}
  __device__ float q(int t, int i) const { return tile_float(qs[t * kQkStride + i]); }
  __device__ float k(int t, int i) const { return tile_float(ks[t * kQkStride + i]); }
  E* qs;       // [C, kQkStride]: q (then as each prep uses it)
  E* ks;       // [C, kQkStride]: k (fp32: then exp(G) k)
  float* Gs;   // [C, kStride]: G (bf16 q and k: then exp(G) k)
  float* As;   // [C, kAStride]
  float* Aqs;  // [C, kAqStride]
  float* Ts;   // [C, kKdaSolveStride]: Tinv, then Tinv diag(beta)
  float* ns;   // [kOffDiag, kSub, kSub]: the solve's T_aa diag(beta_a) A_ac (c < a)
  float* bt;   // [C]: beta (zero past the chunk)
  float* gl;   // [kKdaMaxDim]: G of the chunk's last token
};

// Threads of the backward's prep: one CTA per SM fits its shared memory, so 16 warps, not 8, hide
// the latencies of its shared-memory loops.
constexpr int kKdaPrepThreads = 512;

// The backward's prep: fp32 q and k (it scales both in place, exp(G) q and exp(G) k), Aq in a tile
// (P = exp(G) q - Aq W reads it). The forward's (kda.cu) takes bf16 q and k, Aq into global memory.
using ChunkPrepTiles = KdaPrepTiles<float, true, kKdaPrepThreads>;

// The sub-chunks (a, b), b < a, of the off-diagonal block number p (row by row: (1, 0), (2, 0),
// (2, 1), (3, 0), ...); ns holds the solve's products in this order.
__device__ inline void offdiag_block_index(int p, int& a, int& b) {
  a = 1;
  while (a * (a + 1) / 2 <= p) ++a;
  b = p - a * (a - 1) / 2;
}

// Whether the diagonal 16 x 16 blocks take their mma form (kda.h, kKdaHalfDecayBound): G ([C, stride]
// floats, log2 domain) falls by at most the bound over each half of every 16-token sub-chunk, in
// every channel. Both preps and the grad kernel (kda_backward.cu) decide by it. Every thread takes
// part; a barrier.
__device__ inline bool kda_diagonal_blocks_on_mma(const float* Gs, int stride) {
  constexpr int D = static_cast<int>(kKdaMaxDim), kSubs = static_cast<int>(kKdaChunk) / 16;
  bool past = false;
  for (int p = threadIdx.x; p < kSubs * D; p += blockDim.x) {
    const int a = 16 * (p / D), i = p % D;
    const float first = Gs[a * stride + i] - Gs[(a + 8) * stride + i],
                second = Gs[(a + 8) * stride + i] - Gs[(a + 15) * stride + i];
    past = past || !(fmaxf(first, second) <= kKdaHalfDecayBound);
  }
  return __syncthreads_or(past) == 0;
}

// One warp: the 16 x 16 block (a, b), b <= a (kDiagonal: b = a), of A and Aq on the tensor cores,
// a plain product over the channels of (k_t or q_t) exp(G_t - G_r) and k_s exp(G_r - G_s) through
// a reference token r. Below the diagonal, r = 16 a, the first token of t's sub-chunk: s < r <= t
// for every pair, both factors <= 1 (nothing overflows, however strong the decay; a factor that
// underflows belongs to a pair that decays to nothing anyway); the tiles are zero past token n and
// channel dk, and the clamps at 0 only matter there. On it (where kda_diagonal_blocks_on_mma said so),
// r is the block's middle token: one factor may exceed 1, by at most 2^kKdaHalfDecayBound, and the
// pairs s > t (s >= t for A), whose products may overflow, are not kept.
template <bool kDiagonal, class Tiles>
__device__ inline void block_matrices(const Tiles& m, int a, int b, int n, int dk) {
  constexpr int S = Tiles::kStride, B = Tiles::kSub, C = Tiles::kAStride, Cq = Tiles::kAqStride;
  const int lane = threadIdx.x % 32, g = lane / 4, c = lane % 4, r0 = B * a, r = r0 + (kDiagonal ? B / 2 : 0);
  const auto factor = [](float d) { return exp2_ftz(kDiagonal ? d : fminf(d, 0.0f)); };
  float acc_a[2][4] = {}, acc_q[2][4] = {};
  for (int i0 = 0; i0 < dk; i0 += 8) {
    const float gr[2] = {m.Gs[r * S + i0 + c], m.Gs[r * S + i0 + c + 4]};  // columns c and c + 4
    KdaFragA ka, qa;
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const int t = r0 + g + 8 * (e & 1), i = i0 + c + 4 * (e >> 1);
      const float f = factor(m.Gs[t * S + i] - gr[e >> 1]);
      ka.set(e, m.k(t, i) * f);
      qa.set(e, m.q(t, i) * f);
    }
#pragma unroll
    for (int nt = 0; nt < 2; ++nt) {
      KdaFragB kb;
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        const int s = B * b + 8 * nt + g, i = i0 + c + 4 * e;
        kb.set(e, m.k(s, i) * factor(gr[e] - m.Gs[s * S + i]));
      }
      mma_tf32(acc_a[nt], ka, kb);
      mma_tf32(acc_q[nt], qa, kb);
    }
  }
#pragma unroll
  for (int nt = 0; nt < 2; ++nt)
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const int t = r0 + g + 8 * (e >> 1), s = B * b + 8 * nt + 2 * c + (e & 1);
      m.As[t * C + s] = t < n && (!kDiagonal || s < t) ? acc_a[nt][e] : 0.0f;
      m.Aqs[t * Cq + s] = t < n && (!kDiagonal || s <= t) ? acc_q[nt][e] : 0.0f;
    }
}

// One of the 320 tasks of the diagonal 16 x 16 blocks of A and Aq past kKdaHalfDecayBound, where
// no reference token keeps both factors in range: exp(G_t - G_s) per element, in fp32 on the CUDA
// cores. Task = (block a,
// one of its 10 lower 4 x 4 tiles of (t, s), channel slice sl: channels sl, sl + 8, ..); the 8
// slices of a tile are adjacent lanes, summed by shuffles. A 4 x 4 tile loads 20 values per
// channel for 16 pairs. All 32 lanes of the warp must call it.
template <class Tiles>
__device__ inline void diag_matrices(const Tiles& m, int task, int n, int dk) {
  constexpr int C = Tiles::kAStride, Cq = Tiles::kAqStride, S = Tiles::kStride, R = 4;
  const int a = task / 80, tile = task % 80 / 8, sl = task % 8;
  int tr = 0;  // tile row within the block: tiles are numbered row by row, tr + 1 of them in row tr
  while ((tr + 1) * (tr + 2) / 2 <= tile) ++tr;
  const int t0 = Tiles::kSub * a + R * tr, s0 = Tiles::kSub * a + R * (tile - tr * (tr + 1) / 2);
  float acc_a[R][R] = {}, acc_q[R][R] = {};
  for (int i = sl; i < dk; i += 8) {
    float gt[R], kt[R], qt[R], gs[R], kv[R];
#pragma unroll
    for (int x = 0; x < R; ++x) {
      gt[x] = m.Gs[(t0 + x) * S + i];
      kt[x] = m.k(t0 + x, i);
      qt[x] = m.q(t0 + x, i);
      gs[x] = m.Gs[(s0 + x) * S + i];
      kv[x] = m.k(s0 + x, i);
    }
#pragma unroll
    for (int x = 0; x < R; ++x)
#pragma unroll
      for (int y = 0; y < R; ++y) {
        // The clamp only touches pairs above the diagonal (s > t), which are not kept.
        const float w = exp2_ftz(fminf(gt[x] - gs[y], 0.0f)) * kv[y];
        acc_a[x][y] = fmaf(kt[x], w, acc_a[x][y]);
        acc_q[x][y] = fmaf(qt[x], w, acc_q[x][y]);
      }
  }
#pragma unroll
  for (int x = 0; x < R; ++x) {
#pragma unroll
    for (int y = 0; y < R; ++y) {
#pragma unroll
      for (int offset = 1; offset < 8; offset <<= 1) {
        acc_a[x][y] += __shfl_xor_sync(0xffffffffu, acc_a[x][y], offset);
        acc_q[x][y] += __shfl_xor_sync(0xffffffffu, acc_q[x][y], offset);
      }
    }
  }
  // Each slice writes two of the 16 pairs (unrolled: register arrays take no runtime index).
#pragma unroll
  for (int p = 0; p < R * R; ++p) {
    if (p % 8 != sl) continue;
    const int t = t0 + p / R, s = s0 + p % R;
    m.As[t * C + s] = t < n && s < t ? acc_a[p / R][p % R] : 0.0f;
    m.Aqs[t * Cq + s] = t < n && s <= t ? acc_q[p / R][p % R] : 0.0f;
  }
}

// The intra-chunk matrices of one chunk of n tokens, from q, k and G (zero past token n and past
// channel dk) and bt (beta, zero past token n):
//   A[t][s] = sum_i k_t,i exp(G_t,i - G_s,i) k_s,i for s < t (m.As, row stride kAStride),
//   Aq[t][s] likewise with q_t, s <= t (m.Aqs, row stride kAqStride),
//   Tinv = (I + diag(beta) A)^-1, unit lower (m.Ts, row stride kKdaSolveStride),
// all zero past token n. By 16 x 16 blocks of sub-chunks: the 6 below the diagonal on the tensor
// cores (a warp each, block_matrices), the 4 on it too where kda_diagonal_blocks_on_mma says so, else
// element by element (320 tasks, diag_matrices, 10 warps' worth). Every element's arithmetic is
// the same whichever thread takes it, so the matrices do not depend on Tiles::kThreads. Exponents
// are differences <= 0 (G only falls along the chunk) but on the diagonal blocks' mma form. Ends
// with a barrier.
template <class Tiles>
__device__ inline void chunk_matrices(const Tiles& m, int n, int dk) {
  constexpr int C = Tiles::kC, B = Tiles::kSub, T = kKdaSolveStride, AS = Tiles::kAStride;
  constexpr int kMmaWarps = Tiles::kOffDiag, kDiagWarps = Tiles::kSubs * 10 * 8 / 32;
  constexpr int kWarps = Tiles::kThreads / 32;
  static_assert(Tiles::kThreads >= 4 * C, "the diagonal blocks' substitution: four threads a column");
  const int tid = threadIdx.x, warp = tid / 32;
  const bool diagonal_mma = kda_diagonal_blocks_on_mma(m.Gs, Tiles::kStride);
  // The warps' shares in rounds: warp w takes shares w, w + kWarps, .. (one round with 16 warps, two
  // with 8): an off-diagonal block each first, then a diagonal block or 32 diagonal tasks each.
  const int shares = kMmaWarps + (diagonal_mma ? Tiles::kSubs : kDiagWarps);
  for (int share = warp; share < shares; share += kWarps) {
    if (share < kMmaWarps) {
      int a, b;
      offdiag_block_index(share, a, b);
      block_matrices<false>(m, a, b, n, dk);
    } else if (diagonal_mma) {
      block_matrices<true>(m, share - kMmaWarps, share - kMmaWarps, n, dk);
    } else {
      diag_matrices(m, 32 * (share - kMmaWarps) + tid % 32, n, dk);
    }
  }
  // Zero above the diagonal: A's and Aq's 16 x 16 blocks there, and their 4 x 4 tiles within the
  // diagonal blocks where diag_matrices took them; Tinv's 16 x 16 blocks.
  for (int idx = tid; idx < C * C; idx += blockDim.x) {
    const int t = idx / C, s = idx - t * C;
    if (s / B > t / B || (!diagonal_mma && s / 4 > t / 4))
      m.As[t * AS + s] = m.Aqs[t * Tiles::kAqStride + s] = 0.0f;
    if (s / B > t / B) m.Ts[t * T + s] = 0.0f;
  }
  __syncthreads();
  // Tinv = M^-1, M = I + diag(beta) A, by blocks: from M T = I, T_ab = -T_aa sum_{b<=c<a} M_ac T_cb
  // for b < a, with M_ac = diag(beta_a) A_ac. First the diagonal blocks T_aa = M_aa^-1 by forward
  // substitution, column s by four lanes of one warp ((I + diag(beta) A) x = e_s within the block:
  // x_t = -beta_t sum_{r<t} A[t][r] x_r); a warp's 8 columns share a block. Lane sub sums the rows
  // r = r0 + sub + 4 j and keeps their x_r in registers (every lane has each x_t after the
  // shuffles): the 16 dependent steps wait on no shared memory, and all of A's loads are
  // independent of them.
  if (tid < 4 * C) {
    const int s = tid / 4, sub = tid % 4, r0 = s / B * B;
    float xr[B / 4] = {};
#pragma unroll
    for (int dt = 0; dt < B; ++dt) {
      const int t = r0 + dt;
      float acc = 0.0f;
#pragma unroll
      for (int j = 0; 4 * j < dt; ++j)
        if (4 * j + sub < dt) acc = fmaf(m.As[t * AS + r0 + sub + 4 * j], xr[j], acc);
      acc += __shfl_xor_sync(0xffffffffu, acc, 1);
      acc += __shfl_xor_sync(0xffffffffu, acc, 2);
      float x = 0.0f;
      if (t < n && s < n) x = t == s ? 1.0f : (t > s ? -m.bt[t] * acc : 0.0f);
      if (sub == dt % 4) xr[dt / 4] = x;
      if (sub == 0) m.Ts[t * T + s] = x;
    }
  }
  __syncthreads();
  // N_ac = T_aa diag(beta_a) A_ac for each block below the diagonal (T_aa is lower). Here and in
  // the levels below a thread takes four adjacent columns y0 .. y0 + 3 of one row x: float4 shared
  // loads (every row and column offset a multiple of 4), each row of the right operand read once
  // for four fmaf chains, each chain what it was with one element a thread.
  static_assert(T % 4 == 0 && AS % 4 == 0 && B % 4 == 0, "float4 rows");
  const auto load4 = [](const float* p, float(&v)[4]) {
    const float4 x = *reinterpret_cast<const float4*>(p);
    v[0] = x.x, v[1] = x.y, v[2] = x.z, v[3] = x.w;
  };
  for (int quad = tid; quad < Tiles::kNFloats / 4; quad += blockDim.x) {
    const int p = quad / (B * B / 4), x = quad / (B / 4) % B, y0 = 4 * (quad % (B / 4));
    int a, c;
    offdiag_block_index(p, a, c);
    float acc[4] = {};
    for (int z0 = 0; z0 <= x; z0 += 4) {
      float tz[4], bz[4];
      load4(m.Ts + (B * a + x) * T + B * a + z0, tz);
      load4(m.bt + B * a + z0, bz);
#pragma unroll
      for (int zz = 0; zz < 4; ++zz) {
        if (z0 + zz > x) break;
        const float w = tz[zz] * bz[zz];
        float av[4];
        load4(m.As + (B * a + z0 + zz) * AS + B * c + y0, av);
#pragma unroll
        for (int e = 0; e < 4; ++e) acc[e] = fmaf(w, av[e], acc[e]);
      }
    }
    *reinterpret_cast<float4*>(m.ns + 4 * quad) = make_float4(acc[0], acc[1], acc[2], acc[3]);
  }
  __syncthreads();
  // T_ab = -sum_{b<=c<a} N_ac T_cb, by distance a - b: each level reads blocks of the levels before.
  for (int d = 1; d < Tiles::kSubs; ++d) {
    for (int quad = tid; quad < (Tiles::kSubs - d) * B * B / 4; quad += blockDim.x) {
      const int b = quad / (B * B / 4), a = b + d, x = quad / (B / 4) % B, y0 = 4 * (quad % (B / 4));
      float acc[4] = {};
      for (int c = b; c < a; ++c) {
        const float* N = m.ns + (a * (a - 1) / 2 + c) * B * B + x * B;
        const float* Tc = m.Ts + B * c * T + B * b + y0;
#pragma unroll
        for (int z0 = 0; z0 < B; z0 += 4) {
          float nz[4];
          load4(N + z0, nz);
#pragma unroll
          for (int zz = 0; zz < 4; ++zz) {
            float tv[4];
            load4(Tc + (z0 + zz) * T, tv);
#pragma unroll
            for (int e = 0; e < 4; ++e) acc[e] = fmaf(nz[zz], tv[e], acc[e]);
          }
        }
      }
      *reinterpret_cast<float4*>(m.Ts + (B * a + x) * T + B * b + y0) =
          make_float4(-acc[0], -acc[1], -acc[2], -acc[3]);
    }
    __syncthreads();
  }
}

// acc[nt] += op(L)[m0 .. m0 + 15, k] op(X)[k, n0 + 8 nt .. + 7] summed over k in [kbeg, kend)
// (multiples of 8), one warp on the tensor cores, each operand split or not (kSplitL, kSplitX:
// mma_tf32; split both for 3xTF32, neither for plain TF32), op(L)[r][k] = l_at(r, k) (any layout:
// warp_mma's tiles, the kept matrices' packed rows). X is row-major (row stride xs) fp32 or bf16
// (tile_float); kTX reads it transposed (op(X)[k][n] = X[n xs + k]). Both finite everywhere they
// are read.
template <int NT, bool kSplitL, bool kSplitX, bool kTX = false, class LAt, class EX>
__device__ inline void warp_mma_at(float (&acc)[NT][4], const LAt& l_at, const EX* X, int xs, int m0, int n0,
                                   int kbeg, int kend) {
  const int lane = threadIdx.x % 32, g = lane / 4, c = lane % 4;
  const auto x_at = [&](int k, int n) { return tile_float(kTX ? X[n * xs + k] : X[k * xs + n]); };
  for (int k0 = kbeg; k0 < kend; k0 += 8) {
    Tf32Frag<4, kSplitL> a;
    a.set(0, l_at(m0 + g, k0 + c));
    a.set(1, l_at(m0 + g + 8, k0 + c));
    a.set(2, l_at(m0 + g, k0 + c + 4));
    a.set(3, l_at(m0 + g + 8, k0 + c + 4));
#pragma unroll
    for (int nt = 0; nt < NT; ++nt) {
      Tf32Frag<2, kSplitX> b;
      b.set(0, x_at(k0 + c, n0 + 8 * nt + g));
      b.set(1, x_at(k0 + c + 4, n0 + 8 * nt + g));
      mma_tf32(acc[nt], a, b);
    }
  }
}

// warp_mma_at with L a row-major shared tile (row stride ls); kTL reads it transposed (op(L)[r][k]
// = L[k ls + r]). Shared-memory banks: a stride of 4 mod 8 words keeps the plain A and the
// transposed B reads conflict-free, 8 or 24 mod 32 the transposed A and the plain B reads.
template <int NT, bool kSplitL, bool kSplitX, bool kTL = false, bool kTX = false, class EX>
__device__ inline void warp_mma(float (&acc)[NT][4], const float* L, int ls, const EX* X, int xs, int m0,
                                int n0, int kbeg, int kend) {
  const auto l_at = [&](int r, int k) { return kTL ? L[k * ls + r] : L[r * ls + k]; };
  warp_mma_at<NT, kSplitL, kSplitX, kTX>(acc, l_at, X, xs, m0, n0, kbeg, kend);
}

// acc[nt] += L[m0 .. m0 + 15, 0 .. kend) X[0 .. kend, n0 + 8 nt .. + 7] (warp_mma, both row-major;
// L split as kKdaSplitTf32 says).
template <int NT, bool kSplitX = kKdaSplitTf32>
__device__ inline void tile_times(float (&acc)[NT][4], const float* L, int ls, const float* X, int xs, int m0,
                                  int n0, int kend) {
  warp_mma<NT, kKdaSplitTf32, kSplitX>(acc, L, ls, X, xs, m0, n0, 0, kend);
}

// The same for a lower triangular L [C, C] and the 16 rows of m-tile mt: the sum runs over the
// tokens s < 16 (mt + 1) only.
template <int NT, bool kSplitX = kKdaSplitTf32>
__device__ inline void lower_times(float (&acc)[NT][4], const float* L, int ls, const float* X, int xs,
                                   int mt, int n0) {
  tile_times<NT, kSplitX>(acc, L, ls, X, xs, ChunkPrepTiles::kSub * mt, n0, ChunkPrepTiles::kSub * (mt + 1));
}

// Columns col0 .. col0 + kCols of one chunk's rows of a head in a bf16 [tokens, heads, width]
// tensor (v, dO), loaded into registers ahead of their use so that the loads are in flight while
// the kernel computes (a loop of loads and shared stores at the point of use waited on each
// round), and stored into a [C, stride] fp32 shared tile when needed. kThreads threads: thread tid
// takes column tid % kCols of the tokens tid / kCols + kRows r; zero past the chunk's n tokens and
// past width.
template <int kCols, int kThreads>
struct PrefetchedRows {
  static constexpr int kRows = kThreads / kCols, kPerThread = static_cast<int>(kKdaChunk) / kRows;
  static_assert(kRows * kCols == kThreads && kPerThread * kRows == kKdaChunk, "whole rows per thread");
  __nv_bfloat16 x[kPerThread];

  __device__ void load(const __nv_bfloat16* __restrict__ src, int64_t t0, int n, int h, int heads, int width,
                       int col0 = 0) {
    const int i = col0 + static_cast<int>(threadIdx.x) % kCols, tb = threadIdx.x / kCols;
#pragma unroll
    for (int r = 0; r < kPerThread; ++r) {
      const int t = tb + kRows * r;
      x[r] = t < n && i < width ? src[((t0 + t) * heads + h) * width + i] : __float2bfloat16(0.0f);
    }
  }
  __device__ void store(float* tile, int stride) const {
    const int i = threadIdx.x % kCols, tb = threadIdx.x / kCols;
#pragma unroll
    for (int r = 0; r < kPerThread; ++r) tile[(tb + kRows * r) * stride + i] = __bfloat162float(x[r]);
  }
};
// The backward prep's whole [C, kKdaMaxDim] rows.
using PrefetchedChunk = PrefetchedRows<static_cast<int>(kKdaMaxDim), kKdaPrepThreads>;

// A chunk's A, Aq and Tinv in global memory (kKdaMatrixFloats, kda.h: kept_matrices and the
// backward's workspace), packed by rows of their lower triangles, which is all chunk_matrices
// leaves non-zero: A's row t (s < t) from t (t - 1) / 2, Aq's (s <= t) from kKdaPackedAq + t (t +
// 1) / 2, Tinv's (s < t) from kKdaPackedTinv + t (t - 1) / 2; Tinv's diagonal is one for the
// chunk's n tokens and zero past them.
constexpr int kKdaPackedAq = static_cast<int>(kKdaChunk * (kKdaChunk - 1) / 2);
constexpr int kKdaPackedTinv = kKdaPackedAq + static_cast<int>(kKdaChunk * (kKdaChunk + 1) / 2);
static_assert(kKdaPackedTinv + kKdaPackedAq == kKdaMatrixFloats, "kda.h's packed size");

// A, Aq and Tinv of one chunk and head as chunk_matrices left them, packed into out. Every thread
// takes part (Tiles::kThreads of them). Aq's values are all loaded before the first store: in the
// forward's prep they are in global memory, where out might alias them as far as the compiler
// knows, so that loads between the stores would each wait the whole latency.
template <class Tiles>
__device__ inline void store_kda_matrices(const Tiles& m, float* out) {
  constexpr int C = Tiles::kC, R = C * C / Tiles::kThreads;
  static_assert(R * Tiles::kThreads == C * C, "whole rounds");
  float aq[R];
#pragma unroll
  for (int r = 0; r < R; ++r) {
    const int idx = threadIdx.x + Tiles::kThreads * r, t = idx / C, s = idx - t * C;
    aq[r] = s <= t ? m.Aqs[t * Tiles::kAqStride + s] : 0.0f;
  }
#pragma unroll
  for (int r = 0; r < R; ++r) {
    const int idx = threadIdx.x + Tiles::kThreads * r, t = idx / C, s = idx - t * C;
    if (s < t) {
      out[t * (t - 1) / 2 + s] = m.As[t * Tiles::kAStride + s];
      out[kKdaPackedTinv + t * (t - 1) / 2 + s] = m.Ts[t * kKdaSolveStride + s];
    }
    if (s <= t) out[kKdaPackedAq + t * (t + 1) / 2 + s] = aq[r];
  }
}

// Element (t, s) of a chunk's A, Aq and Tinv from their packed rows (pa, paq, pt: as
// store_kda_matrices wrote them, in shared memory) exactly as chunk_matrices left it: zero above
// the diagonal, Tinv's diagonal one for the chunk's n tokens.
__device__ inline float packed_a(const float* pa, int t, int s) {
  return s < t ? pa[t * (t - 1) / 2 + s] : 0.0f;
}
__device__ inline float packed_aq(const float* paq, int t, int s) {
  return s <= t ? paq[t * (t + 1) / 2 + s] : 0.0f;
}
__device__ inline float packed_tinv(const float* pt, int n, int t, int s) {
  return s < t ? pt[t * (t - 1) / 2 + s] : (s == t && t < n ? 1.0f : 0.0f);
}

// The packed rows of a chunk of n tokens (copied to shared memory by cp.async) back into square
// shared tiles (row strides as, aqs, ts). Every thread takes part; the caller's barrier makes them
// visible.
__device__ inline void unpack_kda_matrices(const float* pa, const float* paq, const float* pt, int n,
                                           float* A, int as, float* Aq, int aqs, float* T, int ts) {
  constexpr int C = static_cast<int>(kKdaChunk);
  for (int idx = threadIdx.x; idx < C * C; idx += blockDim.x) {
    const int t = idx / C, s = idx - t * C;
    A[t * as + s] = packed_a(pa, t, s);
    Aq[t * aqs + s] = packed_aq(paq, t, s);
    T[t * ts + s] = packed_tinv(pt, n, t, s);
  }
}

// The first steps of the forward's prep and the backward's (the one without kept matrices) for the
// chunk of n tokens from t0, head h: q, k, G, beta (the tiles zero past the chunk and past dk),
// then A, Aq and Tinv (chunk_matrices); `keep(tiles)` (every thread) while the matrices are as
// computed (it may read A, Aq and Tinv, not q, k or G); Kb = exp(G_last - G) k and G_last out to
// kb_out [C, kKdaMaxDim] and glast_out [kKdaMaxDim] (zero past the chunk and past dk); W's
// operand exp(G) k, in k's own tile where that is fp32 (and q's becomes exp(G) q if scale_q), else
// over G's; then Tinv becomes Tinv diag(beta) if scale_tinv (else the caller multiplies each
// element Tinv[t][s] by bt[s] as it reads it: the same values wherever t < n and s < n, and the
// same zeros elsewhere, bt being zero past n). Tiles::kThreads threads; ends with a barrier.
template <class Tiles, class Keep>
__device__ void chunk_prep(const __nv_bfloat16* __restrict__ q, const __nv_bfloat16* __restrict__ k,
                           const float* __restrict__ g, const float* __restrict__ beta, int64_t t0, int n,
                           int h, int heads, int dk, const Tiles& m, float* kb_out, float* glast_out,
                           bool scale_q, Keep keep, bool scale_tinv = true) {
  constexpr int C = Tiles::kC, S = Tiles::kStride, D = static_cast<int>(kKdaMaxDim);
  const int tid = threadIdx.x;
  // beta into a register first, stored once the chunk's loads are in: no wait before them.
  const float beta_t = tid < n ? beta[(t0 + tid) * heads + h] : 0.0f;
  // All of a thread's loads in flight at once, the prefix sums in registers (ns is free until the
  // solve). Past token n and channel dk, q and k are zero, as the products need; G stays at the
  // last token's past n, where only zero q and k meet it.
  static_assert(kKdaPrepParts * D <= Tiles::kNFloats, "load_chunk_batched's partial sums fit in ns");
  if constexpr (Tiles::kFp32) {
    load_chunk_batched<kKdaPrepParts, Tiles::kThreads>(q, k, g, t0, n, h, heads, dk, S, m.qs, m.ks, m.Gs,
                                                       m.ns, m.gl);
  } else {  // bf16 q and k copied, in flight with no registers held while G loads
    stage_chunk_rows(m.qs, Tiles::kQkStride, q, t0, n, h, heads, dk);
    stage_chunk_rows(m.ks, Tiles::kQkStride, k, t0, n, h, heads, dk);
    copy_commit();
    load_chunk_batched<kKdaPrepParts, Tiles::kThreads>(nullptr, nullptr, g, t0, n, h, heads, dk, S, nullptr,
                                                       nullptr, m.Gs, m.ns, m.gl);
    copy_wait_all();
    __syncthreads();
  }
  if (tid < C) m.bt[tid] = beta_t;  // read after chunk_matrices' barriers
  chunk_matrices(m, n, dk);
  keep(m);
  // Each element of q, k and G read and rewritten by one thread: nothing else reads them now.
  for (int idx = tid; idx < C * D; idx += blockDim.x) {
    const int t = idx / D, i = idx - t * D;
    const bool live = t < n && i < dk;
    const float G = m.Gs[t * S + i], kv = m.k(t, i), e = exp2_ftz(G);
    kb_out[idx] = live ? exp2_ftz(m.gl[i] - G) * kv : 0.0f;
    if constexpr (Tiles::kFp32) {
      const int x = t * Tiles::kQkStride + i;
      m.ks[x] = live ? kv * e : 0.0f;
      if (scale_q) m.qs[x] = live ? m.qs[x] * e : 0.0f;
    } else {
      m.Gs[t * S + i] = live ? kv * e : 0.0f;
    }
  }
  for (int i = tid; i < D; i += blockDim.x) glast_out[i] = i < dk ? m.gl[i] : 0.0f;
  __syncthreads();  // `keep` read Tinv
  if (scale_tinv) {
    for (int idx = tid; idx < n * C; idx += blockDim.x) {
      const int t = idx / C, s = idx - t * C;
      if (s < n) m.Ts[t * kKdaSolveStride + s] *= m.bt[s];
    }
    __syncthreads();
  }
}

}  // namespace spindle::cuda
