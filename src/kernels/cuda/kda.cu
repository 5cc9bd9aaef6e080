// Kimi Delta Attention, chunked (C = 64), fp32, every product on the tensor cores as 3xTF32
// (kda_chunk.cuh, kda_state_products.cuh).
//
// Forward, per segment of up to kKdaSegmentChunks chunks, three launches:
//   1. prep, grid chunks x heads, two CTAs per SM: per chunk the prefix sums G_t = sum_{s<=t} g_s,
//      the matrices A[t][s] = sum_i k_t,i exp(G_t,i - G_s,i) k_s,i (s < t) and Aq likewise with
//      q_t (s <= t), Tinv = (I + diag(beta) A)^-1 by forward substitution, and the chunk's WY form
//      W = Tinv diag(beta) exp(G) k, U0 = Tinv diag(beta) v, Kb = exp(G_last - G) k, G_last;
//   2. state pass, grid heads x value tiles of 16 (the recurrence is independent per value
//      column: S's column j sees only v[:, j]): the [dk, 16] state tile walks the chunks in
//      order, u = U0 - W S, S = diag(exp G_last) S + Kb^T u, each chunk's entry state into
//      chunk_states and u over U0; the next chunk's operands arrive by cp.async meanwhile;
//   3. output, grid chunks x heads: o = exp(G) q S_c + Aq u over all value columns.
// The intra-chunk products (A and Aq by 16-token sub-chunks, W, U0, the output's) and the state
// pass's run on the tensor cores as 3xTF32; the exponentials of the diagonal sub-chunk blocks and
// the solve in fp32 on the CUDA cores. Every exponential is of a difference <= 0, so no cumulative
// decay over- or underflows.
//
// The backward is kda_backward.cu.
#include <algorithm>

#include "backend/cuda/check.h"
#include "core/error.h"
#include "kernels/cuda/kda.h"
#include "kernels/cuda/kda_chunk.cuh"
#include "kernels/cuda/kda_state_products.cuh"
#include "kernels/cuda/launch.cuh"
#include "kernels/cuda/mma.cuh"
#include "kernels/cuda/shared_memory_limit.h"

namespace spindle::cuda {

namespace {

constexpr int kThreads = 256;
constexpr int kC = static_cast<int>(kKdaChunk);
constexpr int kTileV = 16;  // value columns per CTA

int value_tiles(int64_t dv) { return static_cast<int>((dv + kTileV - 1) / kTileV); }

// The forward's per chunk and head workspace block (fp32, fixed strides of kKdaMaxDim so that
// every row starts 16-byte aligned for cp.async): Aq [C, C], W [C, kMaxDim], Kb [C, kMaxDim],
// U [C, kMaxDim] (U0, replaced by u by the state pass), glast [kMaxDim]. Zero past the chunk's
// last token and past dk / dv.
constexpr int kMaxDim = static_cast<int>(kKdaMaxDim);
constexpr int kOffW = kC * kC, kOffKb = kOffW + kC * kMaxDim, kOffU = kOffKb + kC * kMaxDim,
              kOffGlast = kOffU + kC * kMaxDim;
static_assert(kOffGlast + kMaxDim == kKdaForwardBlockFloats, "kda.h's block size matches this layout");
constexpr int kKp = ChunkPrepTiles::kStride;  // row stride of [C, dk] tiles: conflict-free column walks

// The prep's shared memory: q and k as bf16 (exact, they are bf16 inputs; the products read them
// as fp32), Aq straight into the workspace block instead of a tile of its own: 111 KB, and 256
// threads of at most 128 registers, so that two CTAs share an SM (one CTA of 16 warps left 47% of
// cycles with no warp to issue: docs/KDA.md). Once chunk_prep is done, v [C, kVs] takes q's and
// k's tiles (8 mod 32 words: U0 reads it as the mma's B operand).
using FwdPrepTiles = KdaPrepTiles<__nv_bfloat16, false, kThreads>;
constexpr int kVs = 2 * FwdPrepTiles::kQkFloats / kC;
static_assert(kVs * kC == 2 * FwdPrepTiles::kQkFloats && kVs >= kMaxDim, "v fits where q and k were");
constexpr size_t kPrepSmemBytes = sizeof(float) * FwdPrepTiles::floats();
static_assert(2 * (kPrepSmemBytes + 1024) <= 228 * 1024, "two preps per sm_90 SM (1 KB reserved per CTA)");
size_t prep_smem_bytes() { return kPrepSmemBytes; }

// The column, from a warp's first, of column j (0 .. 7) of its n-tile nt (0 .. 3) of W or U0: plain
// (8 nt + j) or spread (4 nt + j % 4 + 16 (j / 4)). The mma's B fragments read a row-major X[k][n]
// as k = c, n = column(nt, g) for the lanes' (g, c): with X's rows at 4 mod 32 words (exp(G) k in
// G's tile) the plain columns put lanes (g, c) and (g - 4, c + 1) in one bank, the spread ones
// none; at 8 mod 32 (v) the plain ones are conflict-free. Each output element is the same dot
// product whichever n-tile column it takes.
template <bool kSpread>
__device__ int nt_column(int nt, int j) {
  return kSpread ? 4 * nt + j % 4 + 16 * (j / 4) : 8 * nt + j;
}

// acc[h] += Tinv'[16 mt_h .. + 15, :] X[:, n0 + nt_column(nt, ..)] (h = 0, 1; mt0 < mt1) with the
// lower Tinv' = Tinv diag(bt) (Tinv's row stride kKdaSolveStride; each element times beta as it is
// read, the multiplication chunk_prep's scale_tinv would have made), each as lower_times would
// take it: the k-steps of 8 both m-tiles sum over read X's B fragments (split as kSplitX says)
// once for the two. Every accumulator takes the same mma in the same order as with lower_times.
template <bool kSpread, bool kSplitX>
__device__ void lower_times_pair(float (&acc)[2][4][4], const float* X, int xs, const float* T,
                                 const float* bt, int mt0, int mt1, int n0) {
  const int lane = threadIdx.x % 32, g = lane / 4, c = lane % 4;
  for (int k0 = 0; k0 < 16 * (mt1 + 1); k0 += 8) {
    const float b0 = bt[k0 + c], b1 = bt[k0 + c + 4];
    Tf32Frag<2, kSplitX> b[4];
#pragma unroll
    for (int nt = 0; nt < 4; ++nt) {
      b[nt].set(0, X[(k0 + c) * xs + n0 + nt_column<kSpread>(nt, g)]);
      b[nt].set(1, X[(k0 + c + 4) * xs + n0 + nt_column<kSpread>(nt, g)]);
    }
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int m0 = 16 * (h == 0 ? mt0 : mt1);
      if (k0 >= m0 + 16) continue;
      KdaFragA a;
      a.set(0, T[(m0 + g) * kKdaSolveStride + k0 + c] * b0);
      a.set(1, T[(m0 + g + 8) * kKdaSolveStride + k0 + c] * b0);
      a.set(2, T[(m0 + g) * kKdaSolveStride + k0 + c + 4] * b1);
      a.set(3, T[(m0 + g + 8) * kKdaSolveStride + k0 + c + 4] * b1);
#pragma unroll
      for (int nt = 0; nt < 4; ++nt) mma_tf32(acc[h][nt], a, b[nt]);
    }
  }
}

// lower_times_pair's accumulators into out [C, kMaxDim] (W or U0 in the block): rows 16 mt0 .. and
// 16 mt1 .., columns n0 + nt_column(..).
template <bool kSpread>
__device__ void store_pair(const float (&acc)[2][4][4], float* out, int mt0, int mt1, int n0) {
  const int lane = threadIdx.x % 32;
#pragma unroll
  for (int h = 0; h < 2; ++h)
#pragma unroll
    for (int nt = 0; nt < 4; ++nt) {
      const int t = 16 * (h == 0 ? mt0 : mt1) + lane / 4, i = n0 + nt_column<kSpread>(nt, 2 * (lane % 4));
      *reinterpret_cast<float2*>(out + t * kMaxDim + i) = make_float2(acc[h][nt][0], acc[h][nt][1]);
      *reinterpret_cast<float2*>(out + (t + 8) * kMaxDim + i) = make_float2(acc[h][nt][2], acc[h][nt][3]);
    }
}

// Chunk c0 + blockIdx.x of head blockIdx.y: its workspace block, and its A, Aq and Tinv into
// `kept` (the segment's part of kept_matrices, kda.h) if not null. With Tinv = (I + diag(beta)
// A)^-1, W = Tinv diag(beta) exp(G) k and U0 = Tinv diag(beta) v, so that u = U0 - W S needs no
// substitution in the sequential pass; Kb = exp(G_last - G) k carries u into the next state.
// Every element's arithmetic is that of the backward's prep (fp32 q and k tiles, 512 threads), so
// A, Aq and Tinv (kept) and W and Kb are bit for bit its; only threads and operands' places differ.
__global__ void __launch_bounds__(kThreads, 2)
    kda_fwd_prep_kernel(const __nv_bfloat16* __restrict__ q, const __nv_bfloat16* __restrict__ k,
                        const __nv_bfloat16* __restrict__ v, const float* __restrict__ g,
                        const float* __restrict__ beta, float* __restrict__ blocks, float* __restrict__ kept,
                        int64_t c0, int64_t tokens, int heads, int dk, int dv) {
  wait_for_earlier_kernels();
  extern __shared__ __align__(16) float smem[];
  const int h = blockIdx.y, tid = threadIdx.x;
  const int64_t t0 = (c0 + blockIdx.x) * kC;
  const int n = static_cast<int>(min(static_cast<int64_t>(kC), tokens - t0));
  const int64_t chunk_head = static_cast<int64_t>(blockIdx.x) * heads + h;
  float* block = blocks + chunk_head * kKdaForwardBlockFloats;
  const FwdPrepTiles m(smem, block);     // Aq: the block's first [C, C]
  PrefetchedRows<kMaxDim, kThreads> vv;  // in flight while the matrices are computed
  vv.load(v, t0, n, h, heads, dv);
  chunk_prep(
      q, k, g, beta, t0, n, h, heads, dk, m, block + kOffKb, block + kOffGlast, false,
      [&](const FwdPrepTiles& tiles) {
        if (kept != nullptr) store_kda_matrices(tiles, kept + chunk_head * kKdaKeptFloats);
      },
      false);  // Tinv diag(beta) as W and U0 read Tinv
  float* vs = smem;
  vv.store(vs, kVs);
  __syncthreads();
  // W = Tinv' exp(G) k (in G's tile) and U0 = Tinv' v with the lower Tinv' = Tinv diag(beta), on the
  // tensor cores. Warp w: columns 32 (w % 4) .. + 31 of both, m-tiles p and 3 - p (p = w / 4): as
  // m-tile mt sums over 16 (mt + 1) tokens, every warp takes 10 mma steps of 8, over 16 (4 - p)
  // tokens' B fragments. Rows past the chunk and columns past dk / dv come out zero, as the tiles
  // are there.
  const int warp = tid / 32, p = warp / 4, n0 = 32 * (warp % 4);
  static_assert(FwdPrepTiles::kStride % 32 == 4 && kVs % 32 == 8, "nt_column's bank cases");
  {
    float acc[2][4][4] = {};
    lower_times_pair<true, kKdaSplitTf32>(acc, m.Gs, FwdPrepTiles::kStride, m.Ts, m.bt, p, 3 - p, n0);
    store_pair<true>(acc, block + kOffW, p, 3 - p, n0);
  }
  {
    float acc[2][4][4] = {};
    lower_times_pair<false, kKdaBf16Operand>(acc, vs, kVs, m.Ts, m.bt, p, 3 - p, n0);  // v
    store_pair<false>(acc, block + kOffU, p, 3 - p, n0);
  }
}

// The state pass's shared memory, in floats: two stages of W [C, kKdaRowsStride] (the A operand of
// W S), Kb [C, kKdaColumnsStride] (read transposed: Kb^T u), U0 [C, kKdaSplitStride] and glast; then
// the state tile [kMaxDim, 16] and u [C, 16] as TF32 hi and lo bit tiles (kda_state_products.cuh),
// and as fp32 tiles, from which they go to global memory as whole 16-byte rows.
constexpr int kOffStageKb = kC * kKdaRowsStride, kOffStageU = kOffStageKb + kC * kKdaColumnsStride,
              kOffStageGlast = kOffStageU + kC * kKdaSplitStride;
constexpr int kStageFloats = kOffStageGlast + kMaxDim;
constexpr int kSplitStateFloats = kMaxDim * kKdaSplitStride, kSplitChunkFloats = kC * kKdaSplitStride;
size_t scan_smem_bytes() {
  return sizeof(float) *
         static_cast<size_t>(2 * kStageFloats + 3 * kSplitStateFloats + 3 * kSplitChunkFloats);
}
static_assert(kThreads == 32 * kMaxDim / 16 && kTileV + 8 == kKdaSplitStride,
              "the state pass: a warp per 16 rows of the state, two 8-column mma tiles");

// Rows [0, rows) and columns [0, cols) (cols <= 16) of an fp32 tile [*, kKdaSplitStride] in shared
// memory to dst, whose rows are `ld` floats apart, by all the CTA's threads: in 16-byte
// pieces where `vec` (dst and ld 16-byte aligned, cols a multiple of 4), else one value at a time.
// The scan's per-chunk outputs leave this way, whole sectors at a time: stored as the mma fragments'
// scattered pairs of floats they took about a fifth of its time (docs/KDA.md).
__device__ __forceinline__ void store_tile_rows(float* dst, int64_t ld, const float* tile, int rows, int cols,
                                                bool vec) {
  if (vec) {
    for (int p = threadIdx.x; p < rows * 4; p += kThreads) {
      const int r = p / 4, j = 4 * (p % 4);
      if (j < cols)
        *reinterpret_cast<float4*>(dst + r * ld + j) =
            *reinterpret_cast<const float4*>(tile + r * kKdaSplitStride + j);
    }
  } else {
    for (int p = threadIdx.x; p < rows * 16; p += kThreads) {
      const int r = p / 16, j = p % 16;
      if (j < cols) dst[r * ld + j] = tile[r * kKdaSplitStride + j];
    }
  }
}

// Head blockIdx.x, value columns j0 = 16 blockIdx.y ..: chunks [c0, c1) of the segment from
// `initial` (null: zero), writing chunk_states[c0 .. c1] and u: over each block's U0 tile, or where
// `kept` (the segment's part of kept_matrices) keeps it, if not null.
// `initial` may be chunk_states[c0] itself (a later segment): each thread reads the elements it
// writes back. Per chunk, on the tensor cores (kda_state_products.cuh): u = U0 - W S, warp w the
// tokens 16 (w / 2) .. and columns 8 (w % 2) ..; then S = diag(exp G_last) S + Kb^T u, warp w the
// state rows 16 w .. (its tile stays in the warp's registers from chunk to chunk). The next chunk's
// W, Kb, U0 and glast arrive by cp.async while this one computes. u and each entry state also go
// into fp32 tiles, which the whole CTA stores as 16-byte row pieces after the next barrier.
__global__ void __launch_bounds__(kThreads)
    kda_fwd_scan_kernel(float* blocks, float* chunk_states, const float* initial, float* kept, int64_t c0,
                        int64_t c1, int heads, int dk, int dv) {
  wait_for_earlier_kernels();
  extern __shared__ __align__(16) float smem[];
  const int h = blockIdx.x, j0 = blockIdx.y * kTileV, tid = threadIdx.x;
  const int warp = tid / 32, g = tid % 32 / 4, q4 = tid % 4;
  const int64_t SS = static_cast<int64_t>(dk) * dv;
  float* stages = smem;
  uint32_t* Shi = reinterpret_cast<uint32_t*>(stages + 2 * kStageFloats);
  uint32_t* Slo = Shi + kSplitStateFloats;
  uint32_t* uhi = Slo + kSplitStateFloats;
  uint32_t* ulo = uhi + kSplitChunkFloats;
  float* Sf = reinterpret_cast<float*>(ulo + kSplitChunkFloats);  // the state tile, fp32
  float* uf = Sf + kSplitStateFloats;                             // u, fp32
  const bool vec = dv % 4 == 0;
  const int cols = min(kTileV, dv - j0);
  const auto store_state = [&](int64_t c) {
    store_tile_rows(chunk_states + (c * heads + h) * SS + j0, dv, Sf, dk, cols, vec);
  };
  const auto load_stage = [&](int64_t c, float* stage) {
    const float* block = blocks + ((c - c0) * heads + h) * kKdaForwardBlockFloats;
    // Whole rows, so that every row and column of the state tile stays zero past dk.
    for (int p = tid; p < kC * kMaxDim / 4; p += kThreads) {
      const int t = p / (kMaxDim / 4), i = 4 * (p - t * (kMaxDim / 4));
      copy16(stage + t * kKdaRowsStride + i, block + kOffW + t * kMaxDim + i, true);
      copy16(stage + kOffStageKb + t * kKdaColumnsStride + i, block + kOffKb + t * kMaxDim + i, true);
    }
    for (int p = tid; p < kC * kTileV / 4; p += kThreads) {
      const int t = p / (kTileV / 4), j = 4 * (p - t * (kTileV / 4));
      copy16(stage + kOffStageU + t * kKdaSplitStride + j, block + kOffU + t * kMaxDim + j0 + j, true);
    }
    for (int p = tid; p < kMaxDim / 4; p += kThreads)
      copy16(stage + kOffStageGlast + 4 * p, block + kOffGlast + 4 * p, true);
    copy_commit();
  };
  // The warp's state rows i0 + g (+ 8) in C fragments: S[nt][e] is row row(e), column col(nt, e).
  const int i0 = 16 * warp;
  const auto row = [&](int e) { return i0 + g + 8 * (e / 2); };
  const auto col = [&](int nt, int e) { return 8 * nt + 2 * q4 + e % 2; };
  float S[2][4];
#pragma unroll
  for (int nt = 0; nt < 2; ++nt)
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const int i = row(e), j = j0 + col(nt, e);
      S[nt][e] = initial != nullptr && i < dk && j < dv ? initial[h * SS + i * dv + j] : 0.0f;
      store_tf32_split(Shi, Slo, i * kKdaSplitStride + col(nt, e), S[nt][e]);
      Sf[i * kKdaSplitStride + col(nt, e)] = S[nt][e];
    }
  if (c0 < c1) load_stage(c0, stages);
  for (int64_t c = c0;; ++c) {
    if (c == c1) {
      __syncthreads();  // the final state's tile is in
      store_state(c);
      break;
    }
    copy_wait_all();
    __syncthreads();  // this chunk's stage and the state's tiles are in; no one reads the other stage
    if (c + 1 < c1) load_stage(c + 1, stages + ((c + 1 - c0) & 1) * kStageFloats);
    store_state(c);  // the entry state of chunk c (Sf is next written after the barrier below)
    const float* stage = stages + ((c - c0) & 1) * kStageFloats;
    {  // u = U0 - W S (rows past the chunk are zero in W and U0: u = 0 there)
      const int m0 = 16 * (warp / 2), n0 = 8 * (warp % 2);
      float ws[4];
      kda_rows_times_state(ws, stage, Shi, Slo, m0, n0);
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int t = m0 + g + 8 * (e / 2), j = n0 + 2 * q4 + e % 2;
        const float u = stage[kOffStageU + t * kKdaSplitStride + j] - ws[e];
        store_tf32_split(uhi, ulo, t * kKdaSplitStride + j, u);
        uf[t * kKdaSplitStride + j] = u;
      }
    }
    __syncthreads();  // u is in
    // u over U0 or kept (uf is next written after the next chunk's first barrier).
    const int64_t chunk_head = (c - c0) * heads + h;
    store_tile_rows((kept != nullptr ? kept + chunk_head * kKdaKeptFloats + kKdaMatrixFloats
                                     : blocks + chunk_head * kKdaForwardBlockFloats + kOffU) +
                        j0,
                    kMaxDim, uf, kC, kTileV, true);
    // S = diag(exp G_last) S + Kb^T u (zero past dk: Kb and glast are).
    float ku[2][4];
    kda_columns_times_chunk(ku, stage + kOffStageKb, uhi, ulo, i0);
    float decay[2];
    kda_state_row_decays(stage + kOffStageGlast, i0, decay);
#pragma unroll
    for (int nt = 0; nt < 2; ++nt)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        S[nt][e] = fmaf(decay[e / 2], S[nt][e], ku[nt][e]);
        store_tf32_split(Shi, Slo, row(e) * kKdaSplitStride + col(nt, e), S[nt][e]);
        Sf[row(e) * kKdaSplitStride + col(nt, e)] = S[nt][e];
      }
  }
}

// The output pass: a CTA per chunk and head over all value columns, so that q and g are read and
// exp(G) q formed once per chunk and head (224 -> 176 KB of traffic with the halves of 64 columns).
// Shared memory: g, then exp(G) q in its place [C, kKp] fp32; q [C, kQs] bf16; Aq [C, kAq]; u [C,
// kUs]: 104 KB, two CTAs per SM (one CTA per SM, the entry state staged whole, measured no faster:
// docs/PERF.md). The entry state never passes through shared memory: each warp loads its B
// fragments of it into registers at the start (each element once, every warp-wide load four full
// 32-byte sectors) and splits each once. Strides: exp(G) q and Aq are read as mma A operands (4 mod
// 32 words), u as B operand (8 mod 32).
constexpr int kOutCols = 32 * kMaxDim / kThreads;  // value columns per warp: two n8 tiles
constexpr int kKSteps = kMaxDim / 8;               // the state's k-steps
constexpr int kQs = kMaxDim + 8;                   // q's bf16 rows: 16-byte aligned
constexpr int kAq = kC + 4;
constexpr int kUs = kMaxDim + 8;
constexpr int kOffOutQ = kC * kKp, kOffOutAq = kOffOutQ + kC * kQs / 2, kOffOutU = kOffOutAq + kC * kAq,
              kOffOutHalf = kOffOutU + kC * kUs;
size_t output_smem_bytes() { return sizeof(float) * static_cast<size_t>(kOffOutHalf + kMaxDim); }
static_assert(kThreads == 2 * kMaxDim && kOutCols == 16,
              "the output: two threads per channel, 16 columns a warp");
static_assert(2 * (kOffOutHalf + kMaxDim) * sizeof(float) + 2 * 1024 <= 228 * 1024, "two outputs per SM");

// Chunk c0 + blockIdx.x, head blockIdx.y: o = exp(G) q S_c + Aq u on the tensor cores as 3xTF32.
// Plain TF32 looked enough for a bf16 output (2^-11 per operand against the result's 2^-9), but
// through the model's 45 layers it moved whole-model log-probs past their bounds (CudaStreaming:
// 0.0167 for 0.01 between chunkings). g and q arrive by cp.async first, Aq and u after them, and
// the state's fragments by plain loads into registers, all in flight while exp(G) q is formed. Warp
// w: value columns 16 w .. + 15, all 64 rows (four m-tiles sharing each B fragment). Every output
// element takes the same products in the same order as one CTA per 64 columns did.
__global__ void __launch_bounds__(kThreads, 2)
    kda_fwd_output_kernel(const __nv_bfloat16* __restrict__ q, const float* __restrict__ g,
                          const float* __restrict__ blocks, const float* __restrict__ kept,
                          const float* __restrict__ chunk_states, __nv_bfloat16* __restrict__ out, int64_t c0,
                          int64_t tokens, int heads, int dk, int dv) {
  wait_for_earlier_kernels();
  extern __shared__ __align__(16) float smem[];
  const int h = blockIdx.y, tid = threadIdx.x, warp = tid / 32, lane = tid % 32, gr = lane / 4, q4 = lane % 4;
  const int64_t c = c0 + blockIdx.x, t0 = c * kC;
  const int n = static_cast<int>(min(static_cast<int64_t>(kC), tokens - t0));
  float* qg = smem;  // [C, kKp]: g, then exp(G) q (zero past the chunk and past dk)
  __nv_bfloat16* qs = reinterpret_cast<__nv_bfloat16*>(smem + kOffOutQ);  // [C, kQs]
  float* Aq = smem + kOffOutAq;                                           // [C, kAq]
  float* u = smem + kOffOutU;                                             // [C, kUs]
  float* half_sum = smem + kOffOutHalf;                                   // [kMaxDim]: G of token C / 2 - 1
  const int64_t chunk_head = static_cast<int64_t>(blockIdx.x) * heads + h;
  const float* block = blocks + chunk_head * kKdaForwardBlockFloats;
  const float* u_rows =
      kept != nullptr ? kept + chunk_head * kKdaKeptFloats + kKdaMatrixFloats : block + kOffU;
  const int64_t rows = (t0 * heads + h) * dk, row_stride = static_cast<int64_t>(heads) * dk;
  stage_rows(qg, kKp, g + rows, row_stride, n, dk);
  stage_chunk_rows(qs, kQs, q, t0, n, h, heads, dk);
  copy_commit();
  // Aq, and u up to the warps' last column; both are zero past the chunk, u past dv.
  stage_rows(Aq, kAq, block, kC, kC, kC);
  stage_rows(u, kUs, u_rows, kMaxDim, kC, min(kMaxDim, (dv + kOutCols - 1) / kOutCols * kOutCols));
  copy_commit();
  // The warp's B fragments of S_c[:, j0 ..]: sf[ks][nt][e] is row 8 ks + q4 + 4 e, column j0 + 8 nt +
  // gr, zero past dk (q's zero columns there need finite rows) and past dv.
  const int j0 = kOutCols * warp, dk8 = (dk + 7) / 8 * 8;
  const float* S = chunk_states + (c * heads + h) * static_cast<int64_t>(dk) * dv;
  float sf[kKSteps][2][2];
#pragma unroll
  for (int ks = 0; ks < kKSteps; ++ks)
#pragma unroll
    for (int nt = 0; nt < 2; ++nt)
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        const int i = 8 * ks + q4 + 4 * e, j = j0 + 8 * nt + gr;
        sf[ks][nt][e] = i < dk && j < dv ? S[i * dv + j] : 0.0f;
      }
  // exp(G) q over g's tile: thread (channel i, half of the chunk) sums g along its 32 tokens; the
  // first half's threads hand their total to the second's first.
  constexpr int kHalf = kC / 2;
  const int i = tid % kMaxDim, tb = tid / kMaxDim * kHalf;
  const auto g_at = [&](int t) { return i < dk && t < n ? qg[t * kKp + i] * kLog2e : 0.0f; };
  copy_wait<1>();
  __syncthreads();  // g and q are in
  if (tb == 0) {
    float sum = g_at(0);
#pragma unroll
    for (int r = 1; r < kHalf; ++r) sum += g_at(r);
    half_sum[i] = sum;
  }
  __syncthreads();
  {
    const float base = tb == 0 ? 0.0f : half_sum[i];
    float sum = 0.0f;
#pragma unroll
    for (int r = 0; r < kHalf; ++r) {
      const int t = tb + r;
      const bool live = i < dk && t < n;
      sum = r == 0 ? g_at(t) : sum + g_at(t);
      const float qv = live ? __bfloat162float(qs[t * kQs + i]) : 0.0f;
      qg[t * kKp + i] = qv * exp2_ftz(base + sum);
    }
  }
  copy_wait_all();
  __syncthreads();  // exp(G) q, Aq and u are in
  if (j0 >= dv) return;
  const int mts = (n + 15) / 16;  // m-tiles with a row in the chunk
  float acc[4][2][4] = {};
  const auto a_frag = [&](const float* L, int ls, int m0, int k0) {
    KdaFragA a;
    a.set(0, L[(m0 + gr) * ls + k0 + q4]);
    a.set(1, L[(m0 + gr + 8) * ls + k0 + q4]);
    a.set(2, L[(m0 + gr) * ls + k0 + q4 + 4]);
    a.set(3, L[(m0 + gr + 8) * ls + k0 + q4 + 4]);
    return a;
  };
  // exp(G) q S_c (k-steps past dk8 skipped, as they were: an mma of zeros may move the last bits).
#pragma unroll
  for (int ks = 0; ks < kKSteps; ++ks) {
    if (8 * ks >= dk8) break;
    KdaFragB b[2];
#pragma unroll
    for (int nt = 0; nt < 2; ++nt)
#pragma unroll
      for (int e = 0; e < 2; ++e) b[nt].set(e, sf[ks][nt][e]);
#pragma unroll
    for (int mt = 0; mt < 4; ++mt) {
      if (mt >= mts) break;
      const KdaFragA a = a_frag(qg, kKp, 16 * mt, 8 * ks);
#pragma unroll
      for (int nt = 0; nt < 2; ++nt) mma_tf32(acc[mt][nt], a, b[nt]);
    }
  }
  // + Aq u: m-tile mt sums over the tokens s < 16 (mt + 1).
#pragma unroll
  for (int ks = 0; ks < kC / 8; ++ks) {
    KdaFragB b[2];
#pragma unroll
    for (int nt = 0; nt < 2; ++nt)
#pragma unroll
      for (int e = 0; e < 2; ++e) b[nt].set(e, u[(8 * ks + q4 + 4 * e) * kUs + j0 + 8 * nt + gr]);
#pragma unroll
    for (int mt = ks / 2; mt < 4; ++mt) {
      if (mt >= mts) break;
      const KdaFragA a = a_frag(Aq, kAq, 16 * mt, 8 * ks);
#pragma unroll
      for (int nt = 0; nt < 2; ++nt) mma_tf32(acc[mt][nt], a, b[nt]);
    }
  }
#pragma unroll
  for (int mt = 0; mt < 4; ++mt)
#pragma unroll
    for (int nt = 0; nt < 2; ++nt)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int t = 16 * mt + gr + 8 * (e / 2), j = j0 + 8 * nt + 2 * q4 + e % 2;
        if (t < n && j < dv) out[((t0 + t) * heads + h) * dv + j] = __float2bfloat16(acc[mt][nt][e]);
      }
}

void check_shape(const char* name, int64_t tokens, int64_t heads, int64_t dk, int64_t dv) {
  check(dk >= 1 && dk <= kKdaMaxDim && dv >= 1 && dv <= kKdaMaxDim, name, ": dk ", dk, ", dv ", dv,
        " (expected 1 to ", kKdaMaxDim, ")");
  check(tokens >= 0 && heads >= 0 && heads <= 0x7fffffff, name, ": ", tokens, " tokens x ", heads,
        " heads is out of range");
}

}  // namespace

void kda_chunked_forward(const __nv_bfloat16* q, const __nv_bfloat16* k, const __nv_bfloat16* v,
                         const float* g, const float* beta, __nv_bfloat16* out, float* chunk_states,
                         float* workspace, int64_t tokens, int64_t heads, int64_t dk, int64_t dv,
                         cudaStream_t stream, const float* initial_state, float* kept_matrices) {
  check_shape("kda_chunked_forward", tokens, heads, dk, dv);
  if (heads == 0) return;
  allow_shared_memory(kda_fwd_prep_kernel, prep_smem_bytes(), "kda_fwd_prep_kernel");
  allow_shared_memory(kda_fwd_scan_kernel, scan_smem_bytes(), "kda_fwd_scan_kernel");
  allow_shared_memory(kda_fwd_output_kernel, output_smem_bytes(), "kda_fwd_output_kernel");
  const int64_t chunks = kda_chunks(tokens), SS = dk * dv;
  const int H = static_cast<int>(heads), dki = static_cast<int>(dk), dvi = static_cast<int>(dv);
  const dim3 scan_grid(static_cast<unsigned>(heads), static_cast<unsigned>(value_tiles(dv)));
  int64_t c0 = 0;
  do {  // at least once: with no tokens the scan still writes the final (= initial) state
    const int64_t c1 = std::min(chunks, c0 + kKdaSegmentChunks);
    const dim3 chunk_grid(static_cast<unsigned>(c1 - c0), static_cast<unsigned>(heads));
    float* kept = kept_matrices != nullptr ? kept_matrices + c0 * heads * kKdaKeptFloats : nullptr;
    if (c1 > c0) {
      launch_kernel(kda_fwd_prep_kernel, chunk_grid, kThreads, prep_smem_bytes(), stream, q, k, v, g, beta,
                    workspace, kept, c0, tokens, H, dki, dvi);
      SPINDLE_LAUNCHED("kda_fwd_prep_kernel");
    }
    const float* initial = c0 == 0 ? initial_state : chunk_states + c0 * heads * SS;
    launch_kernel(kda_fwd_scan_kernel, scan_grid, kThreads, scan_smem_bytes(), stream, workspace,
                  chunk_states, initial, kept, c0, c1, H, dki, dvi);
    SPINDLE_LAUNCHED("kda_fwd_scan_kernel");
    if (c1 > c0 && out != nullptr) {
      launch_kernel(kda_fwd_output_kernel, chunk_grid, kThreads, output_smem_bytes(), stream, q, g, workspace,
                    static_cast<const float*>(kept), chunk_states, out, c0, tokens, H, dki, dvi);
      SPINDLE_LAUNCHED("kda_fwd_output_kernel");
    }
    c0 = c1;
  } while (c0 < chunks);
}

}  // namespace spindle::cuda
