// Kimi Delta Attention backward, chunk-parallel: the chunk form of docs/KDA.md
// (CPU statement: cpu::kda_chunked_backward), fp32, the products on the tensor
// cores as 3xTF32 (kda_chunk.cuh, kda_state_products.cuh).
// Per segment of up to kKdaBackwardSegmentChunks chunks, last segment first,
// three kernels:
//   1. prep, grid chunks x heads: G, A, Aq and Tinv = (I + diag(beta) A)^-1 of
//   each chunk, its
//      WY form W = Tinv diag(beta) exp(G) k and Kb = exp(G_last - G) k, and the
//      chunk's own share of its entry state's gradient, Z = (exp(G) q - Aq W)^T
//      dO, into the workspace; with kept matrices (kda.h) A, Aq and Tinv are
//      the forward's, read from their packed rows by a leaner kernel of the
//      same arithmetic, two CTAs per SM;
//   2. state gradients, grid heads x value tiles of 16: the chunks in reverse,
//   carrying only the
//      [dk, 16] tile of dS; per chunk dS = diag(exp G_last) dS' - W^T (Kb dS')
//      + Z (the du and dRb of the chunk form folded into W and Z), the next
//      chunk's operands prefetched by cp.async; each chunk's entry gradient
//      into the workspace;
//   3. gradients, grid chunks x heads: from the chunk's entry state S
//   (chunk_states) and its exit
//      gradient dS' (kernel 2), every input gradient of its tokens. One CTA
//      walks all value tiles, adding dA, dAq and the [C, dk] products dO S^T,
//      dRb S^T, u dS'^T up in place, so every output is written once, without
//      atomics.
// Every exponential is of a difference <= 0 (exp(G_t), exp(G_last - G_t),
// exp(G_t - G_s), s <= t).
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
constexpr int kMaxDim = static_cast<int>(kKdaMaxDim);
constexpr int kTileV = 16;                                     // value columns per tile
constexpr int kMats = static_cast<int>(kKdaMatrixFloats);      // A, Aq, Tinv of one chunk and head
constexpr int kKeptFloats = static_cast<int>(kKdaKeptFloats);  // and u after them, where kept
constexpr unsigned kFull = 0xffffffffu;

int value_tiles(int64_t dv) { return static_cast<int>((dv + kTileV - 1) / kTileV); }

// The state pass's operands of one chunk and head (fixed strides of kMaxDim,
// 16-byte rows for cp.async, zero past the chunk's last token and past dk): W =
// Tinv diag(beta) exp(G) k [C, dk], Kb = exp(G_last - G) k [C, dk], G_last
// [dk].
constexpr int kOpKb = kC * kMaxDim, kOpGlast = 2 * kC * kMaxDim;
static_assert(kOpGlast + kMaxDim == kKdaBackwardOpsFloats, "kda.h's operand block matches this layout");

size_t prep_smem_floats() { return ChunkPrepTiles::floats(); }

// Z = P^T dO over the chunk's n tokens on the tensor cores, one warp's rows i0 .. i0 + 15 and
// columns j0 .. j0 + 63 of it, into Z [dk, dv] (only i < dk, j < dv written): P [C, ps] (read
// transposed), dO [C, ds] fp32 or bf16 (exact in TF32: not split). Both kernel 1's.
template <class E>
__device__ void store_z_tile(const float* P, int ps, const E* dO, int ds, int i0, int j0, int n, int dk,
                             int dv, float* Z) {
  const int lane = threadIdx.x % 32, g4 = lane / 4, c4 = lane % 4;
  float z[8][4] = {};
  warp_mma<8, kKdaSplitTf32, kKdaBf16Operand, true>(z, P, ps, dO, ds, i0, j0, 0, n);
#pragma unroll
  for (int nt = 0; nt < 8; ++nt)
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const int i = i0 + g4 + 8 * (e / 2), j = j0 + 8 * nt + 2 * c4 + e % 2;
      if (i < dk && j < dv) Z[i * dv + j] = z[nt][e];
    }
}

// Kernel 1, chunk c = c0 + blockIdx.x of head blockIdx.y: A (strictly lower),
// Aq (lower) and Tinv (unit lower) into mats [chunks, heads, kMats] (packed,
// kda_chunk.cuh); W, Kb and G_last into ops; and, into slot c - c0 of slots,
// the chunk's own share of its entry state's gradient, Z = (Qg - Aq W)^T dO
// [dk, dv], so that the state pass is dS = diag(exp G_last) dS' - W^T (Kb dS')
// + Z (docs/KDA.md). With kept matrices kda_bwd_kept_prep_kernel runs instead.
__global__ void __launch_bounds__(kKdaPrepThreads, 1)
    kda_bwd_prep_kernel(const __nv_bfloat16* __restrict__ q, const __nv_bfloat16* __restrict__ k,
                        const float* __restrict__ g, const float* __restrict__ beta,
                        const __nv_bfloat16* __restrict__ dout, float* __restrict__ mats,
                        float* __restrict__ ops, float* __restrict__ slots, int64_t c0, int64_t tokens,
                        int heads, int dk, int dv) {
  wait_for_earlier_kernels();
  extern __shared__ __align__(16) float smem[];
  constexpr int S = ChunkPrepTiles::kStride, AS = ChunkPrepTiles::kAStride;
  const int h = blockIdx.y, tid = threadIdx.x, warp = tid / 32, lane = tid % 32, g4 = lane / 4, c4 = lane % 4;
  const int64_t t0 = (c0 + blockIdx.x) * kC;
  const int n = static_cast<int>(min(static_cast<int64_t>(kC), tokens - t0));
  // q's tile: q, then Qg = exp(G) q, then P = Qg - Aq W; k's: exp(G) k, then
  // dO; G's: then W. All zero past the chunk (and past dk / dv), as the
  // products read whole tiles.
  const ChunkPrepTiles m(smem);
  const int64_t chunk_head = static_cast<int64_t>(blockIdx.x) * heads + h;
  float* op = ops + chunk_head * kKdaBackwardOpsFloats;
  PrefetchedChunk dO;  // in flight while the matrices are computed
  dO.load(dout, t0, n, h, heads, dv);
  chunk_prep(q, k, g, beta, t0, n, h, heads, dk, m, op + kOpKb, op + kOpGlast, true,
             [&](const ChunkPrepTiles& tiles) { store_kda_matrices(tiles, mats + chunk_head * kMats); });
  // W = Tinv diag(beta) exp(G) k on the tensor cores: out, and into G's tile (G
  // is no longer needed). Warp w: columns 16 (w % 8) .. + 15, m-tiles p and 3 -
  // p (p = w / 8), so that every warp takes 10 steps of 8 tokens (m-tile mt
  // sums over 16 (mt + 1)).
  for (int half = 0; half < 2; ++half) {
    const int mt = half == 0 ? warp / 8 : 3 - warp / 8, n0 = 16 * (warp % 8);
    float acc[2][4] = {};
    lower_times(acc, m.Ts, kKdaSolveStride, m.ks, S, mt, n0);
#pragma unroll
    for (int nt = 0; nt < 2; ++nt)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int t = 16 * mt + g4 + 8 * (e / 2), i = n0 + 8 * nt + 2 * c4 + e % 2;
        op[t * kMaxDim + i] = acc[nt][e];
        m.Gs[t * S + i] = acc[nt][e];
      }
  }
  __syncthreads();
  // P = Qg - Aq W in place (each element read and written by the lane whose
  // product it is), the same split over the warps; dO over exp(G) k meanwhile.
  for (int half = 0; half < 2; ++half) {
    const int mt = half == 0 ? warp / 8 : 3 - warp / 8, n0 = 16 * (warp % 8);
    float acc[2][4] = {};
    lower_times(acc, m.Aqs, AS, m.Gs, S, mt, n0);
#pragma unroll
    for (int nt = 0; nt < 2; ++nt)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int t = 16 * mt + g4 + 8 * (e / 2), i = n0 + 8 * nt + 2 * c4 + e % 2;
        m.qs[t * S + i] -= acc[nt][e];
      }
  }
  dO.store(m.ks, S);
  __syncthreads();
  // Z: warp w the rows 16 (w / 2) .. and columns 64 (w % 2) ...
  store_z_tile(m.qs, S, m.ks, S, 16 * (warp / 2), 64 * (warp % 2), n, dk, dv, slots + chunk_head * dk * dv);
}

// Kernel 1 with kept matrices: nothing to solve, so a lean prep of 256 threads
// and 104 KB of shared memory, two CTAs per SM (kda_bwd_prep_kernel's one CTA
// of 16 warps per SM waited on its loads). Every output element's arithmetic
// is kda_bwd_prep_kernel's (the same operations, TF32 splits and mma steps in
// the same order), so W, Kb, G_last and Z are bit for bit what it writes; only
// threads and operands' places differ: q, k and dO in bf16 tiles (exact), Aq
// and Tinv read from their packed rows, Tinv's elements times beta as they are
// read (the products kda_bwd_prep_kernel's scaled tile holds), Qg held in
// registers until q and k are read.
constexpr int kKeptThreads = 256;
// Row stride of its [C, dk] tiles, fp32 and bf16: 8 mod 32 words in the fp32
// ones, where the mma reads B operands (exp(G) k, W) and P^T's transposed A
// fragments, conflict-free either way; 16-byte bf16 rows for cp.async.
constexpr int kKs = kMaxDim + 8;
// Shared memory, in floats: G, then exp(G) k, then W [C, kKs]; q and k (bf16
// [C, kKs] each), then Qg, then P [C, kKs]; dO (bf16 [C, kKs]); Aq's and
// Tinv's packed rows; load_chunk_batched's partial sums; beta; G_last.
constexpr int kKeptP = kC * kKs, kKeptDo = 2 * kC * kKs, kKeptMats = kKeptDo + kC * kKs / 2;
constexpr int kKeptPart = kKeptMats + kMats - kKdaPackedAq, kKeptBeta = kKeptPart + kKdaPrepParts * kMaxDim;
constexpr int kKeptGlast = kKeptBeta + kC;
constexpr size_t kKeptSmemBytes = sizeof(float) * (kKeptGlast + kMaxDim);
static_assert(kKs % 32 == 8 && kKeptDo % 4 == 0 && kKeptMats % 4 == 0,
              "conflict-free fp32 rows, 16-byte tiles");
static_assert(2 * (kKeptSmemBytes + 1024) <= 228 * 1024, "two per sm_90 SM (1 KB reserved per CTA)");

// Chunk c = c0 + blockIdx.x of head blockIdx.y with kept (the segment's part
// of the forward's matrices): W, Kb and G_last into ops and Z into slot c - c0,
// as kda_bwd_prep_kernel.
__global__ void __launch_bounds__(kKeptThreads, 2)
    kda_bwd_kept_prep_kernel(const __nv_bfloat16* __restrict__ q, const __nv_bfloat16* __restrict__ k,
                             const float* __restrict__ g, const float* __restrict__ beta,
                             const __nv_bfloat16* __restrict__ dout, const float* __restrict__ kept,
                             float* __restrict__ ops, float* __restrict__ slots, int64_t c0, int64_t tokens,
                             int heads, int dk, int dv) {
  wait_for_earlier_kernels();
  extern __shared__ __align__(16) float smem[];
  constexpr int D = kMaxDim;
  const int h = blockIdx.y, tid = threadIdx.x, warp = tid / 32, lane = tid % 32, g4 = lane / 4, c4 = lane % 4;
  const int64_t t0 = (c0 + blockIdx.x) * kC;
  const int n = static_cast<int>(min(static_cast<int64_t>(kC), tokens - t0));
  const int64_t chunk_head = static_cast<int64_t>(blockIdx.x) * heads + h;
  float* op = ops + chunk_head * kKdaBackwardOpsFloats;
  float* Gs = smem;                                          // G, then exp(G) k, then W
  float* Ps = smem + kKeptP;                                 // Qg = exp(G) q, then P = Qg - Aq W
  __nv_bfloat16* qs = reinterpret_cast<__nv_bfloat16*>(Ps);  // q and k until Qg
  __nv_bfloat16* ks = qs + kC * kKs;
  const __nv_bfloat16* dOs = reinterpret_cast<const __nv_bfloat16*>(smem + kKeptDo);
  const float* paq = smem + kKeptMats;                    // Aq's packed rows,
  const float* pt = paq + kKdaPackedTinv - kKdaPackedAq;  // then Tinv's
  float *bt = smem + kKeptBeta, *gl = smem + kKeptGlast;
  // Every load in flight at once: the packed rows (adjacent, 16 KB), q and k by
  // cp.async, dO too (a group of its own: needed last), while G's prefix sums
  // load into registers.
  const float beta_t = tid < n ? beta[(t0 + tid) * heads + h] : 0.0f;
  stage_rows(smem + kKeptMats, 0, kept + chunk_head * kKeptFloats + kKdaPackedAq, 0, 1, kMats - kKdaPackedAq);
  stage_chunk_rows(qs, kKs, q, t0, n, h, heads, dk);
  stage_chunk_rows(ks, kKs, k, t0, n, h, heads, dk);
  copy_commit();
  stage_chunk_rows(reinterpret_cast<__nv_bfloat16*>(smem + kKeptDo), kKs, dout, t0, n, h, heads, dv);
  copy_commit();
  load_chunk_batched<kKdaPrepParts, kKeptThreads>(nullptr, nullptr, g, t0, n, h, heads, dk, kKs, nullptr,
                                                  nullptr, Gs, smem + kKeptPart, gl);
  if (tid < kC) bt[tid] = beta_t;
  copy_wait_all_but_newest();
  __syncthreads();
  // Kb out and exp(G) k over G, each element by the thread that reads it; Qg
  // into registers, over q and k once every thread has read them.
  constexpr int kPerThread = kC * D / kKeptThreads;
  float qg[kPerThread];
#pragma unroll
  for (int r = 0; r < kPerThread; ++r) {
    const int idx = tid + kKeptThreads * r, t = idx / D, i = idx % D, x = t * kKs + i;
    const bool live = t < n && i < dk;
    const float G = Gs[x], kv = __bfloat162float(ks[x]), e = exp2_ftz(G);
    op[kOpKb + idx] = live ? exp2_ftz(gl[i] - G) * kv : 0.0f;
    Gs[x] = live ? kv * e : 0.0f;
    qg[r] = live ? __bfloat162float(qs[x]) * e : 0.0f;
  }
  if (tid < D) op[kOpGlast + tid] = tid < dk ? gl[tid] : 0.0f;
  __syncthreads();
#pragma unroll
  for (int r = 0; r < kPerThread; ++r) {
    const int idx = tid + kKeptThreads * r;
    Ps[idx / D * kKs + idx % D] = qg[r];
  }
  // W = Tinv diag(beta) exp(G) k on the tensor cores, held until every warp has
  // read exp(G) k; then out, and over it. Warp w: columns 32 (w % 4) .. + 31,
  // m-tiles p and 3 - p (p = w / 4): 10 mma steps of 8 tokens each. Tinv's
  // elements are scaled where kda_bwd_prep_kernel scales its tile (t, s < n).
  const int p = warp / 4, n0 = 32 * (warp % 4);
  const auto tinv_beta = [&](int t, int s) {
    const float x = packed_tinv(pt, n, t, s);
    return t < n && s < n ? x * bt[s] : x;
  };
  float w[2][4][4] = {};
#pragma unroll
  for (int half = 0; half < 2; ++half) {
    const int mt = half == 0 ? p : 3 - p;
    warp_mma_at<4, kKdaSplitTf32, kKdaSplitTf32>(w[half], tinv_beta, Gs, kKs, 16 * mt, n0, 0, 16 * (mt + 1));
  }
  __syncthreads();  // exp(G) k is read; Qg is in
#pragma unroll
  for (int half = 0; half < 2; ++half)
#pragma unroll
    for (int nt = 0; nt < 4; ++nt)
#pragma unroll
      for (int e = 0; e < 4; e += 2) {
        const int t = 16 * (half == 0 ? p : 3 - p) + g4 + 8 * (e / 2), i = n0 + 8 * nt + 2 * c4;
        const float2 v = make_float2(w[half][nt][e], w[half][nt][e + 1]);
        *reinterpret_cast<float2*>(op + t * D + i) = v;
        *reinterpret_cast<float2*>(Gs + t * kKs + i) = v;
      }
  __syncthreads();
  // P = Qg - Aq W in place (each element read and written by the lane whose
  // product it is), the same split over the warps.
  const auto aq = [&](int t, int s) { return packed_aq(paq, t, s); };
#pragma unroll
  for (int half = 0; half < 2; ++half) {
    const int mt = half == 0 ? p : 3 - p;
    float acc[4][4] = {};
    warp_mma_at<4, kKdaSplitTf32, kKdaSplitTf32>(acc, aq, Gs, kKs, 16 * mt, n0, 0, 16 * (mt + 1));
#pragma unroll
    for (int nt = 0; nt < 4; ++nt)
#pragma unroll
      for (int e = 0; e < 4; ++e)
        Ps[(16 * mt + g4 + 8 * (e / 2)) * kKs + n0 + 8 * nt + 2 * c4 + e % 2] -= acc[nt][e];
  }
  copy_wait_all();  // dO
  __syncthreads();
  // Z: warp w the rows 16 w .., both column halves.
  for (int j0 = 0; j0 < D; j0 += 64)
    store_z_tile(Ps, kKs, dOs, kKs, 16 * warp, j0, n, dk, dv, slots + chunk_head * dk * dv);
}

// Kernel 2's shared memory, in floats: two stages of W [C, kKdaColumnsStride] (read transposed: W^T
// X), Kb [C, kKdaRowsStride] (the A operand of Kb dS') and G_last; then the dS tile [kMaxDim, 16]
// and X [C, 16] as TF32 hi and lo bit tiles (kda_state_products.cuh).
constexpr int kOffStageKb = kC * kKdaColumnsStride, kOffStageGlast = kOffStageKb + kC * kKdaRowsStride;
constexpr int kStageFloats = kOffStageGlast + kMaxDim;
constexpr int kSplitStateFloats = kMaxDim * kKdaSplitStride, kSplitChunkFloats = kC * kKdaSplitStride;
size_t state_smem_floats() { return 2 * kStageFloats + 2 * kSplitStateFloats + 2 * kSplitChunkFloats; }
static_assert(kThreads == 32 * kMaxDim / 16 && kTileV + 8 == kKdaSplitStride,
              "the state pass: a warp per 16 rows of dS, two 8-column mma tiles");

// Kernel 2, head blockIdx.x, value columns j0 = 16 blockIdx.y ..: chunks c1 - 1
// down to c0 from `initial` (the gradient of the state leaving chunk c1 - 1;
// null: zero). Per chunk, on the tensor cores: X = Kb dS' (warp w the tokens
// 16 (w / 2) .., columns 8 (w % 2) ..), then dS = diag(exp G_last) dS' - W^T X
// + Z (warp w the rows 16 w .., its tile in the warp's registers from chunk to
// chunk), Z read from slot c - c0, which then receives dS (the gradient of the
// state entering chunk c); slot c1 - c0 receives `initial`, `carry` the
// gradient entering chunk c0 (the next, earlier segment's `initial`: each
// thread reads the elements of it that it writes), d_initial, if not null,
// that of chunk 0. The next chunk's W, Kb and G_last arrive by cp.async while
// this one computes. kb_ds, if not null, receives each chunk's X ([segment, heads, C, kMaxDim], the
// grad kernel's du = Kb dS' + Aq^T dO in part).
__global__ void __launch_bounds__(kThreads)
    kda_bwd_state_kernel(const float* __restrict__ ops, float* __restrict__ slots, const float* initial,
                         float* carry, float* __restrict__ d_initial, float* __restrict__ kb_ds, int64_t c0,
                         int64_t c1, int heads, int dk, int dv) {
  wait_for_earlier_kernels();
  extern __shared__ __align__(16) float smem[];
  const int h = blockIdx.x, j0 = blockIdx.y * kTileV, tid = threadIdx.x;
  const int warp = tid / 32, g = tid % 32 / 4, q4 = tid % 4;
  const int64_t SS = static_cast<int64_t>(dk) * dv;
  float* stages = smem;
  uint32_t* dShi = reinterpret_cast<uint32_t*>(stages + 2 * kStageFloats);
  uint32_t* dSlo = dShi + kSplitStateFloats;
  uint32_t* Xhi = dSlo + kSplitStateFloats;
  uint32_t* Xlo = Xhi + kSplitChunkFloats;
  const auto load_stage = [&](int64_t c, float* stage) {
    const float* op = ops + ((c - c0) * heads + h) * kKdaBackwardOpsFloats;
    for (int p = tid; p < kC * kMaxDim / 4; p += kThreads) {
      const int t = p / (kMaxDim / 4), i = 4 * (p - t * (kMaxDim / 4));
      copy16(stage + t * kKdaColumnsStride + i, op + t * kMaxDim + i, true);
      copy16(stage + kOffStageKb + t * kKdaRowsStride + i, op + kOpKb + t * kMaxDim + i, true);
    }
    for (int p = tid; p < kMaxDim / 4; p += kThreads)
      copy16(stage + kOffStageGlast + 4 * p, op + kOpGlast + 4 * p, true);
    copy_commit();
  };
  // The warp's dS rows i0 + g (+ 8) in C fragments: dS[nt][e] is row row(e),
  // column col(nt, e) of the tile.
  const int i0 = 16 * warp;
  const auto row = [&](int e) { return i0 + g + 8 * (e / 2); };
  const auto col = [&](int nt, int e) { return 8 * nt + 2 * q4 + e % 2; };
  const auto owned = [&](int nt, int e) { return row(e) < dk && j0 + col(nt, e) < dv; };
  const auto at = [&](int nt, int e) { return row(e) * dv + j0 + col(nt, e); };  // offset in a [dk, dv] slot

  float dS[2][4];
#pragma unroll
  for (int nt = 0; nt < 2; ++nt)
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      dS[nt][e] = initial != nullptr && owned(nt, e) ? initial[h * SS + at(nt, e)] : 0.0f;
      store_tf32_split(dShi, dSlo, row(e) * kKdaSplitStride + col(nt, e), dS[nt][e]);
      if (owned(nt, e)) slots[((c1 - c0) * heads + h) * SS + at(nt, e)] = dS[nt][e];
    }
  if (c1 > c0) load_stage(c1 - 1, stages);
  for (int64_t c = c1 - 1; c >= c0; --c) {
    float* slot = slots + ((c - c0) * heads + h) * SS;
    float z[2][4];  // Z, from kernel 1
#pragma unroll
    for (int nt = 0; nt < 2; ++nt)
#pragma unroll
      for (int e = 0; e < 4; ++e) z[nt][e] = owned(nt, e) ? slot[at(nt, e)] : 0.0f;
    copy_wait_all();
    __syncthreads();  // this chunk's stage and the split dS are in; no one reads the other stage
    if (c - 1 >= c0) load_stage(c - 1, stages + ((c1 - c) & 1) * kStageFloats);
    const float* stage = stages + ((c1 - 1 - c) & 1) * kStageFloats;
    {  // X = Kb dS' (rows past the chunk are zero in Kb: X = 0 there)
      const int m0 = 16 * (warp / 2), n0 = 8 * (warp % 2);
      float x[4];
      kda_rows_times_state(x, stage + kOffStageKb, dShi, dSlo, m0, n0);
#pragma unroll
      for (int e = 0; e < 4; ++e)
        store_tf32_split(Xhi, Xlo, (m0 + g + 8 * (e / 2)) * kKdaSplitStride + n0 + 2 * q4 + e % 2, x[e]);
      if (kb_ds != nullptr) {  // whole 32-byte row pieces a warp (zero past the chunk and past dv)
        float* rows = kb_ds + ((c - c0) * heads + h) * (kC * kMaxDim) + j0 + n0 + 2 * q4;
        *reinterpret_cast<float2*>(rows + (m0 + g) * kMaxDim) = make_float2(x[0], x[1]);
        *reinterpret_cast<float2*>(rows + (m0 + g + 8) * kMaxDim) = make_float2(x[2], x[3]);
      }
    }
    __syncthreads();  // X is in
    // dS = diag(exp G_last) dS' - W^T X + Z.
    float wx[2][4];
    kda_columns_times_chunk(wx, stage, Xhi, Xlo, i0);
    float decay[2];
    kda_state_row_decays(stage + kOffStageGlast, i0, decay);
#pragma unroll
    for (int nt = 0; nt < 2; ++nt)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        dS[nt][e] = fmaf(decay[e / 2], dS[nt][e], z[nt][e]) - wx[nt][e];
        store_tf32_split(dShi, dSlo, row(e) * kKdaSplitStride + col(nt, e), dS[nt][e]);
        if (!owned(nt, e)) continue;
        slot[at(nt, e)] = dS[nt][e];
        if (c == c0) carry[h * SS + at(nt, e)] = dS[nt][e];
        if (c == 0 && d_initial != nullptr) d_initial[h * SS + at(nt, e)] = dS[nt][e];
      }
  }
}

// Kernel 3: 16 warps, so that twice as many as before hide the shared-memory
// and exponential latencies (one CTA per SM: 209 KB of shared memory, at most
// 128 registers a thread).
constexpr int kGradThreads = 512;
constexpr int kTs = kTileV + 4;   // value tiles' row stride: 4 mod 8 words, read both ways by the mma
constexpr int kAp = kC + 4;       // C x C matrices' row stride (mma A operands: 4 mod 32)
constexpr int kQp = kMaxDim + 4;  // [C, dk] tiles' row stride, likewise
// Shared memory, in floats: a region for W, Kb, A, Aq, Tinv (then q, k, G); dA
// and dAq; the value tile's S, dS' [dk, 16] and V/X0/X, Xb = diag(beta) X0, dO,
// du, u, dR [C, 16] (then dG [C, dk]); row vectors.
constexpr int kGradMats = 2 * kC * kQp + 3 * kC * kAp;
constexpr int kGradTiles = 2 * kMaxDim * kTs + 6 * kC * kTs;
static_assert(3 * kC * kQp <= kGradMats, "q, k and G fit where W, Kb and the matrices were");
static_assert(kC * kQp <= kGradTiles, "dG fits where the value tiles were");
constexpr int kGradParts = kGradThreads / kMaxDim;  // load_chunk_batched's threads per channel
size_t grad_smem_floats() {
  return kGradMats + 2 * kC * kAp + kGradTiles + 2 * kC + 2 * kMaxDim + kGradParts * kMaxDim;
}

// The warp's [16, 32] block (rows 16 dm .., columns dn ..) of the C x C product a u^T (a: dO, an
// exact bf16 operand, or dR) in two halves of 16 columns (fewer live registers), each element handed
// on as use(e, t, s, value); g4 and c4 are the lane's group and index in it.
template <bool kSplitA, class Use>
__device__ inline void block_times_u(const float* a, const float* u, int dm, int dn, int g4, int c4,
                                     Use use) {
#pragma unroll 1
  for (int nh = 0; nh < 2; ++nh) {
    float acc[2][4] = {};
    warp_mma<2, kSplitA, kKdaSplitTf32, false, true>(acc, a, kTs, u, kTs, 16 * dm, dn + 16 * nh, 0, kTileV);
#pragma unroll
    for (int nt = 0; nt < 2; ++nt)
#pragma unroll
      for (int e = 0; e < 4; ++e)
        use(e, 16 * dm + g4 + 8 * (e / 2), dn + 8 * (2 * nh + nt) + 2 * c4 + e % 2, acc[nt][e]);
  }
}

// Kernel 3, chunk c = c0 + blockIdx.x of head blockIdx.y, on the tensor cores
// as 3xTF32 (every gradient is an fp32 output; plain TF32's 2^-11 per operand,
// through up to four chained products, would use up much of the 1e-3 the tests
// allow). Per value tile of 16 columns, one barrier between the steps, 8 warps
// per product of [C, 16] (an m-tile and 8 columns each):
//   1. X0 = V - W S | du = Kb dS' + Aq^T dO;
//   2. u = Tinv Xb, Xb = diag(beta) X0 | dR = Tinv^T du, dv = diag(beta) dR;
//   3. X = X0 - A u | dAq += lower(dO u^T);
//   4. dbeta += rowsum(dR . X), dA -= strict_lower(diag(beta) dR u^T); every
//   warp: its [16, 32]
//      blocks of dQg += dO S^T, dR S^T and dKb += u dS'^T, held in registers
//      over all the tiles (dW = -diag(beta) dR S^T at the end).
// Then the decay products of dA and dAq by 16-token sub-chunks, in the same
// warp blocks: the rows (t the later token) below t's sub-chunk through its
// first token r, exp(G_t - G_s) = exp(G_t - G_r) exp(G_r - G_s), the columns (t
// the earlier token) past it through its last, both factors
// <= 1, so each is one mma; within the sub-chunk two more mma against its middle
// token where the decays allow (kKdaHalfDecayBound; the blocks before and after then
// through the middle token too, their factors still <= 1), else element by element. dq,
// dk, dG from the registers, and dg by the reverse prefix sum.
// kKept: mats are the forward's kept matrices (stride kKeptFloats), u after them, and kb_ds the state
// pass's Kb dS' (otherwise null). Neither X0, u nor X is computed: per tile
//   1. du = Kb dS' + Aq^T dO | dAq += lower(dO u^T);
//   2. dR = Tinv^T du, dv = diag(beta) dR | dQg += dO S^T;
//   3. dA -= strict_lower(diag(beta) dR u^T) | dbeta += rowsum(dR . V); dR S^T, dKb += u dS'^T;
// and dbeta from X = V - W S - A u by its terms: rowsum(dR . V) - rowsum(W . dR S^T) - rowsum(A .
// dR u^T), where W S's own product and the A u of step 3 were.
template <bool kKept>
__global__ void __launch_bounds__(kGradThreads, 1)
    kda_bwd_grad_kernel(const __nv_bfloat16* __restrict__ q, const __nv_bfloat16* __restrict__ k,
                        const __nv_bfloat16* __restrict__ v, const float* __restrict__ g,
                        const float* __restrict__ beta, const __nv_bfloat16* __restrict__ dout,
                        const float* __restrict__ mats, const float* __restrict__ kb_ds,
                        const float* __restrict__ chunk_states, const float* __restrict__ slots,
                        __nv_bfloat16* __restrict__ dq, __nv_bfloat16* __restrict__ dk_out,
                        __nv_bfloat16* __restrict__ dv_out, float* __restrict__ dg, float* __restrict__ dbeta,
                        int64_t c0, int64_t tokens, int heads, int dk, int dv) {
  wait_for_earlier_kernels();
  extern __shared__ __align__(16) float smem[];
  const int h = blockIdx.y, tid = threadIdx.x, warp = tid / 32, lane = tid % 32, g4 = lane / 4, c4 = lane % 4;
  const int64_t c = c0 + blockIdx.x, t0 = c * kC, SS = static_cast<int64_t>(dk) * dv;
  const int n = static_cast<int>(min(static_cast<int64_t>(kC), tokens - t0));
  const int dk8 = (dk + 7) / 8 * 8;
  float* W = smem;              // [C, kQp]: k, then exp(G) k
  float* Kb = W + kC * kQp;     // [C, kQp]: G, then exp(G_last - G) k
  float* A = Kb + kC * kQp;     // [C, kAp]
  float* Aq = A + kC * kAp;     // [C, kAp]
  float* Tinv = Aq + kC * kAp;  // [C, kAp]
  float* Qs = smem;             // after the value tiles: [C, kQp] q, k and G
  float* Ks = Qs + kC * kQp;
  float* Gs = Ks + kC * kQp;
  float* dA = smem + kGradMats;     // [C, kAp]
  float* dAq = dA + kC * kAp;       // [C, kAp]
  float* St = dAq + kC * kAp;       // [kMaxDim, kTs]: S, columns of the tile
  float* dSt = St + kMaxDim * kTs;  // [kMaxDim, kTs]: dS'
  float* X = dSt + kMaxDim * kTs;   // [C, kTs]: V, then X0, then X
  float* Xb = X + kC * kTs;         // [C, kTs] (kKept: Kb dS')
  float* dO = Xb + kC * kTs;        // [C, kTs]
  float* du = dO + kC * kTs;        // [C, kTs]
  float* u = du + kC * kTs;         // [C, kTs]
  float* dR = u + kC * kTs;         // [C, kTs]
  float* dG = St;                   // after the value tiles: [C, kQp] (dq, then dG)
  float* bt = St + kGradTiles;      // [C]
  float* dbeta_acc = bt + kC;       // [C]
  float* glast = dbeta_acc + kC;    // [kMaxDim]: G_last
  float* sdS = glast + kMaxDim;     // [kMaxDim]: rowsum(S . dS')
  float* part = sdS + kMaxDim;      // [kGradParts, kMaxDim]: prefix sums', then dg's G_last parts

  // The packed matrices by cp.async into dA's and dAq's tiles (zeroed once they are unpacked), in
  // flight while the chunk loads.
  static_assert(kMats <= 2 * kC * kAp, "the packed matrices fit in dA's and dAq's tiles");
  const int64_t chunk_head = static_cast<int64_t>(blockIdx.x) * heads + h;
  const float* chunk_mats = mats + chunk_head * (kKept ? kKeptFloats : kMats);
  stage_rows(dA, 0, chunk_mats, 0, 1, kMats);
  copy_commit();
  const float beta_t = tid < n ? beta[(t0 + tid) * heads + h] : 0.0f;  // stored once the loads are in
  for (int t = tid; t < kC; t += kGradThreads) dbeta_acc[t] = 0.0f;
  for (int i = tid; i < kMaxDim; i += kGradThreads) sdS[i] = 0.0f;
  // S's and dS''s rows past dk stay zero over the tiles (the products read
  // whole 8-row steps).
  for (int idx = tid; idx < (kMaxDim - dk) * kTs; idx += kGradThreads)
    St[dk * kTs + idx] = dSt[dk * kTs + idx] = 0.0f;
  if constexpr (!kKept) {  // the kept path's loop needs neither W nor Kb
    load_chunk_batched<kGradParts>(nullptr, k, g, t0, n, h, heads, dk, kQp, nullptr, W, Kb, part, glast);
    for (int idx = tid; idx < kC * kMaxDim; idx += kGradThreads) {
      const int t = idx / kMaxDim, i = idx - t * kMaxDim, x = t * kQp + i;
      const float G = Kb[x], kv = W[x];
      W[x] = exp2_ftz(G) * kv;
      Kb[x] = exp2_ftz(glast[i] - G) * kv;
    }
  }
  if (tid < kC) bt[tid] = beta_t;
  copy_wait_all();
  __syncthreads();
  unpack_kda_matrices(dA, dA + kKdaPackedAq, dA + kKdaPackedTinv, n, A, kAp, Aq, kAp, Tinv, kAp);
  __syncthreads();
  // The value-tile loop's first barrier orders this before dA and dAq (kKept: and dQg) are added to.
  for (int idx = tid; idx < 2 * kC * kAp; idx += kGradThreads) dA[idx] = 0.0f;  // dA and dAq
  if constexpr (kKept) {
    for (int idx = tid; idx < 2 * kC * kQp; idx += kGradThreads) W[idx] = 0.0f;  // dQg and dKb
  }

  // This warp's [16, 32] block of the [C, dk] products: rows 16 bm .., columns
  // bn ...
  const int bm = warp / 4, bn = 32 * (warp % 4);
  float acc_q[4][4] = {}, acc_r[4][4] = {}, acc_kb[4][4] = {};  // dQg, dR S^T, dKb
  // Element e of n-tile nt of those blocks in a [C, kQp] tile.
  const auto acc_at = [&](int nt, int e) {
    return (16 * bm + g4 + 8 * (e / 2)) * kQp + bn + 8 * nt + 2 * c4 + e % 2;
  };
  // The [C, 16] steps: warp w < 8 the first product, the others the second,
  // m-tile pm and columns pn .. pn + 7 of the tile.
  const int pm = warp % 8 / 2, pn = 8 * (warp % 2);
  const bool first = warp < 8;
  const auto pt = [&](int e) { return 16 * pm + g4 + 8 * (e / 2); };  // a [C, 16] fragment's row
  const auto pj = [&](int e) { return pn + 2 * c4 + e % 2; };         // and column
  const float* S = chunk_states + (c * heads + h) * SS;
  const float* dSn = slots + ((c + 1 - c0) * heads + h) * SS;
  // Each value tile's v and dO in registers from the tile before (loaded while it computes).
  PrefetchedRows<kTileV, kGradThreads> v_next, dout_next;
  const auto load_tile = [&](int j0) {
    v_next.load(v, t0, n, h, heads, dv, j0);
    dout_next.load(dout, t0, n, h, heads, dv, j0);
  };
  load_tile(0);
  for (int j0 = 0; j0 < dv; j0 += kTileV) {
    const int nv = min(kTileV, dv - j0);
    stage_rows(St, kTs, S + j0, dv, dk, nv);
    stage_rows(dSt, kTs, dSn + j0, dv, dk, nv);
    if constexpr (kKept) {  // whole tiles: zero past the chunk and past dv
      stage_rows(u, kTs, chunk_mats + kMats + j0, kMaxDim, kC, kTileV);
      stage_rows(Xb, kTs, kb_ds + chunk_head * (kC * kMaxDim) + j0, kMaxDim, kC, kTileV);
    }
    copy_commit();
    for (int idx = tid; idx < dk * (kTileV - nv); idx += kGradThreads) {  // columns past dv
      const int i = idx / (kTileV - nv), jj = nv + idx % (kTileV - nv);
      St[i * kTs + jj] = dSt[i * kTs + jj] = 0.0f;
    }
    v_next.store(X, kTs);
    dout_next.store(dO, kTs);
    if (j0 + kTileV < dv) load_tile(j0 + kTileV);
    copy_wait_all();
    __syncthreads();
    if constexpr (kKept) {
      const int dm = (warp % 8) / 2, dn = 32 * (warp % 2);  // warp w - 8's block: (w - 8) / 2, 32 (w % 2)
      const bool lower_block = dn <= 16 * dm + 15;          // none above the diagonal
      // 1. du = Kb dS' (the state pass's, in Xb) + Aq^T dO (Aq^T is upper: tokens s >= 16 pm) |
      //    dAq += lower(dO u^T), in two halves of 16 columns (fewer live registers).
      if (first) {
        float acc[1][4];
#pragma unroll
        for (int e = 0; e < 4; ++e) acc[0][e] = Xb[pt(e) * kTs + pj(e)];
        warp_mma<1, kKdaSplitTf32, kKdaBf16Operand, true>(acc, Aq, kAp, dO, kTs, 16 * pm, pn, 16 * pm, kC);
#pragma unroll
        for (int e = 0; e < 4; ++e) du[pt(e) * kTs + pj(e)] = acc[0][e];
      } else if (lower_block) {
        block_times_u<kKdaBf16Operand>(dO, u, dm, dn, g4, c4, [&](int, int t, int s, float x) {
          if (t < n && s <= t) dAq[t * kAp + s] += x;
        });
      }
      for (int i = tid; i < dk; i += kGradThreads) {
        float acc = 0.0f;
        for (int jj = 0; jj < kTileV; ++jj) acc = fmaf(St[i * kTs + jj], dSt[i * kTs + jj], acc);
        sdS[i] += acc;
      }
      // dQg += dO S^T, the tile's part added to dQg in W's tile (free here; dKb likewise in Kb's), so
      // that fewer registers are live through the steps.
      const auto add_dqg = [&] {
        float part[4][4] = {};
#pragma unroll 1
        for (int k0 = 0; k0 < kTileV; k0 += 8)
          warp_mma<4, kKdaBf16Operand, kKdaSplitTf32, false, true>(part, dO, kTs, St, kTs, 16 * bm, bn, k0,
                                                                   k0 + 8);
#pragma unroll
        for (int nt = 0; nt < 4; ++nt)
#pragma unroll
          for (int e = 0; e < 4; ++e) W[acc_at(nt, e)] += part[nt][e];
      };
      __syncthreads();
      // 2. dR = Tinv^T du (upper), dv = diag(beta) dR | dQg.
      if (first) {
        float acc[1][4] = {};
        warp_mma<1, kKdaSplitTf32, kKdaSplitTf32, true>(acc, Tinv, kAp, du, kTs, 16 * pm, pn, 16 * pm, kC);
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const int t = pt(e), jj = pj(e);
          dR[t * kTs + jj] = acc[0][e];
          if (t < n && jj < nv)
            dv_out[((t0 + t) * heads + h) * dv + j0 + jj] = __float2bfloat16(bt[t] * acc[0][e]);
        }
      } else {
        add_dqg();
      }
      __syncthreads();
      // 3. dA -= strict_lower(diag(beta) dR u^T) and dbeta -= rowsum(A . dR u^T) (warps 8 ..) |
      //    dbeta += rowsum(dR . V), dQg; every warp's blocks of dR S^T and dKb += u dS'^T.
      if (!first && lower_block) {
        float ap[2] = {};  // the thread's two rows
        block_times_u<kKdaSplitTf32>(dR, u, dm, dn, g4, c4, [&](int e, int t, int s, float x) {
          if (t < n && s < t) {
            dA[t * kAp + s] -= bt[t] * x;
            ap[e / 2] = fmaf(A[t * kAp + s], x, ap[e / 2]);
          }
        });
#pragma unroll
        for (int r = 0; r < 2; ++r) {
          float x = ap[r];
          for (int offset = 1; offset < 4; offset <<= 1) x += __shfl_xor_sync(kFull, x, offset);
          const int t = 16 * dm + g4 + 8 * r;
          if (c4 == 0 && t < n) atomicAdd(dbeta_acc + t, -x);
        }
      } else if (tid < n) {  // X holds V; warps 8 .. add to dbeta_acc meanwhile
        float acc = 0.0f;
        for (int jj = 0; jj < kTileV; ++jj) acc = fmaf(dR[tid * kTs + jj], X[tid * kTs + jj], acc);
        atomicAdd(dbeta_acc + tid, acc);
      }
      if (first) add_dqg();
#pragma unroll 1
      for (int k0 = 0; k0 < kTileV; k0 += 8)
        warp_mma<4, kKdaSplitTf32, kKdaSplitTf32, false, true>(acc_r, dR, kTs, St, kTs, 16 * bm, bn, k0,
                                                               k0 + 8);
      float part[4][4] = {};
#pragma unroll 1
      for (int k0 = 0; k0 < kTileV; k0 += 8)
        warp_mma<4, kKdaSplitTf32, kKdaSplitTf32, false, true>(part, u, kTs, dSt, kTs, 16 * bm, bn, k0,
                                                               k0 + 8);
#pragma unroll
      for (int nt = 0; nt < 4; ++nt)
#pragma unroll
        for (int e = 0; e < 4; ++e) Kb[acc_at(nt, e)] += part[nt][e];
    } else {
      // 1. X0 = V - W S (each lane reads and writes its own elements) | du = Kb
      // dS' + Aq^T dO (Aq^T
      //    is upper: tokens s >= 16 pm).
      {
        float acc[1][4] = {};
        if (first) {
          tile_times(acc, W, kQp, St, kTs, 16 * pm, pn, dk8);
#pragma unroll
          for (int e = 0; e < 4; ++e) {
            const float x0 = X[pt(e) * kTs + pj(e)] - acc[0][e];
            X[pt(e) * kTs + pj(e)] = x0;
            Xb[pt(e) * kTs + pj(e)] = bt[pt(e)] * x0;
          }
        } else {
          tile_times(acc, Kb, kQp, dSt, kTs, 16 * pm, pn, dk8);
          warp_mma<1, kKdaSplitTf32, kKdaBf16Operand, true>(acc, Aq, kAp, dO, kTs, 16 * pm, pn, 16 * pm, kC);
#pragma unroll
          for (int e = 0; e < 4; ++e) du[pt(e) * kTs + pj(e)] = acc[0][e];
        }
      }
      for (int i = tid; i < dk; i += kGradThreads) {
        float acc = 0.0f;
        for (int jj = 0; jj < kTileV; ++jj) acc = fmaf(St[i * kTs + jj], dSt[i * kTs + jj], acc);
        sdS[i] += acc;
      }
      __syncthreads();
      // 2. u = Tinv Xb (lower) | dR = Tinv^T du (upper), dv = diag(beta) dR.
      {
        float acc[1][4] = {};
        if (first) {
          lower_times(acc, Tinv, kAp, Xb, kTs, pm, pn);
#pragma unroll
          for (int e = 0; e < 4; ++e) u[pt(e) * kTs + pj(e)] = acc[0][e];
        } else {
          warp_mma<1, kKdaSplitTf32, kKdaSplitTf32, true>(acc, Tinv, kAp, du, kTs, 16 * pm, pn, 16 * pm, kC);
#pragma unroll
          for (int e = 0; e < 4; ++e) {
            const int t = pt(e), jj = pj(e);
            dR[t * kTs + jj] = acc[0][e];
            if (t < n && jj < nv)
              dv_out[((t0 + t) * heads + h) * dv + j0 + jj] = __float2bfloat16(bt[t] * acc[0][e]);
          }
        }
      }
      __syncthreads();
      // 3. X = X0 - A u (A strictly lower) | dAq += lower(dO u^T).
      const int dm = (warp % 8) / 2, dn = 32 * (warp % 2);  // warp w - 8's block: (w - 8) / 2, 32 (w % 2)
      const bool lower_block = dn <= 16 * dm + 15;          // none above the diagonal
      if (first) {
        float acc[1][4] = {};
        lower_times(acc, A, kAp, u, kTs, pm, pn);
#pragma unroll
        for (int e = 0; e < 4; ++e) X[pt(e) * kTs + pj(e)] -= acc[0][e];
      } else if (lower_block) {
        block_times_u<kKdaBf16Operand>(dO, u, dm, dn, g4, c4, [&](int, int t, int s, float x) {
          if (t < n && s <= t) dAq[t * kAp + s] += x;
        });
      }
      __syncthreads();
      // 4. dbeta, dA (warps 8 ..), and every warp's blocks of dO S^T, dR S^T, u
      // dS'^T.
      if (!first && lower_block) {
        block_times_u<kKdaSplitTf32>(dR, u, dm, dn, g4, c4, [&](int, int t, int s, float x) {
          if (t < n && s < t) dA[t * kAp + s] -= bt[t] * x;
        });
      } else if (tid < n) {
        float acc = 0.0f;
        for (int jj = 0; jj < kTileV; ++jj) acc = fmaf(dR[tid * kTs + jj], X[tid * kTs + jj], acc);
        dbeta_acc[tid] += acc;
      }
#pragma unroll 1
      for (int k0 = 0; k0 < kTileV; k0 += 8) {  // a step at a time: one step's fragments live
        warp_mma<4, kKdaBf16Operand, kKdaSplitTf32, false, true>(acc_q, dO, kTs, St, kTs, 16 * bm, bn, k0,
                                                                 k0 + 8);
        warp_mma<4, kKdaSplitTf32, kKdaSplitTf32, false, true>(acc_r, dR, kTs, St, kTs, 16 * bm, bn, k0,
                                                               k0 + 8);
        warp_mma<4, kKdaSplitTf32, kKdaSplitTf32, false, true>(acc_kb, u, kTs, dSt, kTs, 16 * bm, bn, k0,
                                                               k0 + 8);
      }
    }
    __syncthreads();  // the next tile's loads (and q, k, G after the last)
                      // overwrite what was read
  }

  if constexpr (kKept) {  // the thread's own elements: dKb into registers, dQg into dG's tile (read there)
#pragma unroll
    for (int nt = 0; nt < 4; ++nt)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        acc_kb[nt][e] = Kb[acc_at(nt, e)];
        dG[acc_at(nt, e)] = W[acc_at(nt, e)];
      }
    __syncthreads();  // before q and k land there
  }
  // q, k and G again, where W, Kb and the matrices were.
  load_chunk_batched<kGradParts>(q, k, g, t0, n, h, heads, dk, kQp, Qs, Ks, Gs, part, glast);
  // The diagonal blocks (s and t in the same sub-chunk) by mma against the block's middle token m
  // where every sub-chunk's decay over each half stays within kKdaHalfDecayBound, so that neither
  // factor of exp(G_t - G_s) = exp(G_t - G_m) exp(G_m - G_s) exceeds 2^64; else element by element.
  // A barrier.
  const bool diagonal_mma = kda_diagonal_blocks_on_mma(Gs, kQp);
  // The warp's fragment elements: row et(e), column ei(nt, e).
  const auto et = [&](int e) { return 16 * bm + g4 + 8 * (e / 2); };
  const auto ei = [&](int nt, int e) { return bn + 8 * nt + 2 * c4 + e % 2; };
  const int mid = 16 * bm + 8;  // the block's middle token
  if constexpr (kKept) {
#pragma unroll
    for (int r = 0; r < 2; ++r) {  // dbeta's last term, rowsum(W . dR S^T), W = exp(G) k: the warp's part
      float x = 0.0f;
#pragma unroll
      for (int nt = 0; nt < 4; ++nt)
#pragma unroll
        for (int e = 2 * r; e < 2 * r + 2; ++e) {
          const int idx = et(e) * kQp + ei(nt, e);
          x = fmaf(exp2_ftz(Gs[idx]) * Ks[idx], acc_r[nt][e], x);
        }
      for (int offset = 1; offset < 4; offset <<= 1) x += __shfl_xor_sync(kFull, x, offset);
      if (c4 == 0 && et(2 * r) < n) atomicAdd(dbeta_acc + et(2 * r), -x);
    }
  }
  // Rows: through ref for the sub-chunks before (exp(G_ref - G_s) <= 1, then exp(G_t - G_ref)), ref
  // = mid where the block takes two more mma steps against it, else r = 16 bm and the block element
  // by element (s from r to t).
  // Two column halves one after the other, so that fewer accumulators are live next to the [C, dk]
  // ones.
#pragma unroll
  for (int nh = 0; nh < 2; ++nh) {
    const int r = 16 * bm;
    float row_a[2][4] = {}, row_q[2][4] = {};
    // row_a, row_q += dA, dAq [rows r .., tokens k0 .. k0 + 7] (exp(G_ref - G_s) k_s) (the clamp: the
    // sub-chunks before, where the exponent is never positive).
    const auto row_step = [&](int k0, int ref, bool clamp) {
      KdaFragA fa, fq;
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int x = (r + g4 + 8 * (e & 1)) * kAp + k0 + c4 + 4 * (e >> 1);
        fa.set(e, dA[x]);
        fq.set(e, dAq[x]);
      }
#pragma unroll
      for (int nt = 0; nt < 2; ++nt) {
        const int i = bn + 8 * (2 * nh + nt) + g4;
        KdaFragB b;
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          const int x = (k0 + c4 + 4 * e) * kQp + i;
          const float d = Gs[ref * kQp + i] - Gs[x];
          b.set(e, exp2_ftz(clamp ? fminf(d, 0.0f) : d) * Ks[x]);
        }
        mma_tf32(row_a[nt], fa, b);
        mma_tf32(row_q[nt], fq, b);
      }
    };
    const int ref = diagonal_mma ? mid : r;  // exp(G_ref - G_s) <= 1 for s < r either way
    for (int k0 = 0; k0 < r; k0 += 8) row_step(k0, ref, true);
    if (diagonal_mma) {
      row_step(r, mid, false);  // dA and dAq are zero above their diagonals
      row_step(r + 8, mid, false);
    }
#pragma unroll
    for (int nt = 0; nt < 2; ++nt)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int t = et(e), i = ei(2 * nh + nt, e), x = t * kQp + i;
        const float Gt = Gs[x], f = exp2_ftz(Gt - Gs[ref * kQp + i]);
        float ra = row_a[nt][e] * f, rq = row_q[nt][e] * f;
        for (int s2 = r; !diagonal_mma && s2 <= t; ++s2) {
          const float w = exp2_ftz(Gt - Gs[s2 * kQp + i]) * Ks[s2 * kQp + i];
          ra = fmaf(dA[t * kAp + s2], w, ra);
          rq = fmaf(dAq[t * kAp + s2], w, rq);
        }
        const float E = exp2_ftz(Gt), dq_x = fmaf(E, kKept ? dG[x] : acc_q[2 * nh + nt][e], rq);
        if (t < n && i < dk) dq[((t0 + t) * heads + h) * dk + i] = __float2bfloat16(dq_x);
        dG[x] = dq_x;  // for dG, below: the register is free from here
        acc_r[2 * nh + nt][e] = fmaf(-E * bt[t], acc_r[2 * nh + nt][e],
                                     ra);  // later = exp(G) dW + rowA
      }
  }
  // Columns: through ref for the sub-chunks after (exp(G_s - G_ref) <= 1, then exp(G_ref - G_t)),
  // ref = mid where the block takes two more mma steps against it, else r = 16 bm + 15 and the
  // block element by element (s from t to r); the column halves again.
#pragma unroll
  for (int nh = 0; nh < 2; ++nh) {
    const int r = 16 * bm + 15;
    float gpart[2][2] = {};  // sum over the thread's rows of k exp(G_last - G) dKb, per column
    float col_a[2][4] = {}, col_q[2][4] = {};
    // col_a, col_q += dA, dAq^T [tokens k0 .. k0 + 7, columns 16 bm ..] (exp(G_s - G_ref) k_s, q_s).
    const auto col_step = [&](int k0, int ref, bool clamp) {
      KdaFragA fa, fq;
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int x = (k0 + c4 + 4 * (e >> 1)) * kAp + 16 * bm + g4 + 8 * (e & 1);  // transposed
        fa.set(e, dA[x]);
        fq.set(e, dAq[x]);
      }
#pragma unroll
      for (int nt = 0; nt < 2; ++nt) {
        const int i = bn + 8 * (2 * nh + nt) + g4;
        KdaFragB bk, bq;
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          const int x = (k0 + c4 + 4 * e) * kQp + i;
          const float d = Gs[x] - Gs[ref * kQp + i];
          const float f = exp2_ftz(clamp ? fminf(d, 0.0f) : d);
          bk.set(e, f * Ks[x]);
          bq.set(e, f * Qs[x]);
        }
        mma_tf32(col_a[nt], fa, bk);
        mma_tf32(col_q[nt], fq, bq);
      }
    };
    const int ref = diagonal_mma ? mid : r;  // exp(G_s - G_ref) <= 1 for s > r either way
    for (int k0 = r + 1; k0 < kC; k0 += 8) col_step(k0, ref, true);
    if (diagonal_mma) {
      col_step(16 * bm, mid, false);  // dA and dAq are zero above their diagonals
      col_step(16 * bm + 8, mid, false);
    }
#pragma unroll
    for (int nt = 0; nt < 2; ++nt)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int t = et(e), i = ei(2 * nh + nt, e), x = t * kQp + i;
        const float Gt = Gs[x], f = exp2_ftz(Gs[ref * kQp + i] - Gt);
        float ca = col_a[nt][e] * f, cq = col_q[nt][e] * f;
        for (int s2 = t; !diagonal_mma && s2 <= r; ++s2) {
          const float w = exp2_ftz(Gs[s2 * kQp + i] - Gt);
          ca = fmaf(dA[s2 * kAp + t] * w, Ks[s2 * kQp + i], ca);
          cq = fmaf(dAq[s2 * kAp + t] * w, Qs[s2 * kQp + i], cq);
        }
        const float kb_part = exp2_ftz(glast[i] - Gt) * acc_kb[2 * nh + nt][e];
        const float earlier = kb_part + ca + cq, later = acc_r[2 * nh + nt][e], dq_x = dG[x];
        if (t < n && i < dk) dk_out[((t0 + t) * heads + h) * dk + i] = __float2bfloat16(later + earlier);
        dG[x] = Qs[x] * dq_x + Ks[x] * (later - earlier);
        gpart[nt][e % 2] += Ks[x] * kb_part;  // zero past the chunk: k is
      }
      // G_last's share through Kb: summed over the lanes of a column (g4) into
      // the m-tile's row of `part` (free again: load_chunk_batched read it
      // before its last barrier).
#pragma unroll
    for (int nt = 0; nt < 2; ++nt)
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        float x = gpart[nt][e];
        for (int offset = 4; offset < 32; offset <<= 1) x += __shfl_xor_sync(kFull, x, offset);
        if (g4 == 0) part[bm * kMaxDim + bn + 8 * (2 * nh + nt) + 2 * c4 + e] = x;
      }
  }
  __syncthreads();  // dG and part are written
  static_assert(kGradParts == kC / 16, "part holds one row per m-tile of 16");
  // dg_t = sum_{r>=t} dG_r, G_last's direct terms (Kb and exp(G_last) S) in
  // every row.
  for (int i = tid; i < dk; i += kGradThreads) {
    float acc = exp2_ftz(glast[i]) * sdS[i];
    for (int b = 0; b < kGradParts; ++b) acc += part[b * kMaxDim + i];
    for (int t = n - 1; t >= 0; --t) {
      acc += dG[t * kQp + i];
      dg[((t0 + t) * heads + h) * dk + i] = acc;
    }
  }
  for (int t = tid; t < n; t += kGradThreads) dbeta[(t0 + t) * heads + h] = dbeta_acc[t];
}

}  // namespace

void kda_chunked_backward(const __nv_bfloat16* q, const __nv_bfloat16* k, const __nv_bfloat16* v,
                          const float* g, const float* beta, const __nv_bfloat16* dout,
                          const float* chunk_states, __nv_bfloat16* dq, __nv_bfloat16* dk_out,
                          __nv_bfloat16* dv_out, float* dg, float* dbeta, float* workspace, int64_t tokens,
                          int64_t heads, int64_t dk, int64_t dv, cudaStream_t stream,
                          const float* d_final_state, float* d_initial_state, const float* kept_matrices) {
  check(dk >= 1 && dk <= kKdaMaxDim && dv >= 1 && dv <= kKdaMaxDim, "kda_chunked_backward: dk ", dk, ", dv ",
        dv, " (expected 1 to ", kKdaMaxDim, ")");
  check(tokens >= 0 && heads >= 0 && heads <= 0xffff, "kda_chunked_backward: ", tokens, " tokens x ", heads,
        " heads is out of range");
  if (heads == 0) return;
  const int64_t chunks = kda_chunks(tokens), SS = dk * dv;
  if (chunks == 0) {  // no tokens: the gradient passes through
    if (d_initial_state != nullptr) {
      const size_t bytes = static_cast<size_t>(heads * SS) * sizeof(float);
      if (d_final_state != nullptr)
        SPINDLE_CUDA(
            cudaMemcpyAsync(d_initial_state, d_final_state, bytes, cudaMemcpyDeviceToDevice, stream));
      else
        SPINDLE_CUDA(cudaMemsetAsync(d_initial_state, 0, bytes, stream));
    }
    return;
  }
  const int64_t segment = std::min(chunks, kKdaBackwardSegmentChunks);
  float* mats = workspace;  // with kept matrices, each segment's part of them instead
  float* ops = mats + (kept_matrices != nullptr ? 0 : segment * heads * kMats);
  float* kb_ds = ops + segment * heads * kKdaBackwardOpsFloats;  // with kept matrices only
  float* slots = kb_ds + (kept_matrices != nullptr ? segment * heads * kC * kMaxDim : 0);
  float* carry = slots + (segment + 1) * heads * SS;
  allow_shared_memory(kda_bwd_prep_kernel, prep_smem_floats() * sizeof(float), "kda_bwd_prep_kernel");
  allow_shared_memory(kda_bwd_kept_prep_kernel, kKeptSmemBytes, "kda_bwd_kept_prep_kernel");
  allow_shared_memory(kda_bwd_state_kernel, state_smem_floats() * sizeof(float), "kda_bwd_state_kernel");
  allow_shared_memory(kda_bwd_grad_kernel<false>, grad_smem_floats() * sizeof(float), "kda_bwd_grad_kernel");
  allow_shared_memory(kda_bwd_grad_kernel<true>, grad_smem_floats() * sizeof(float), "kda_bwd_grad_kernel");
  const int H = static_cast<int>(heads), dki = static_cast<int>(dk), dvi = static_cast<int>(dv);
  // Segments start at multiples of the segment length; the last (first walked)
  // may be shorter.
  for (int64_t c1 = chunks; c1 > 0;) {
    const int64_t c0 = (c1 - 1) / kKdaBackwardSegmentChunks * kKdaBackwardSegmentChunks;
    const dim3 chunk_grid(static_cast<unsigned>(c1 - c0), static_cast<unsigned>(heads));
    const float* kept = kept_matrices != nullptr ? kept_matrices + c0 * heads * kKeptFloats : nullptr;
    if (kept != nullptr)
      launch_kernel(kda_bwd_kept_prep_kernel, chunk_grid, kKeptThreads, kKeptSmemBytes, stream, q, k, g, beta,
                    dout, kept, ops, slots, c0, tokens, H, dki, dvi);
    else
      launch_kernel(kda_bwd_prep_kernel, chunk_grid, kKdaPrepThreads, prep_smem_floats() * sizeof(float),
                    stream, q, k, g, beta, dout, mats, ops, slots, c0, tokens, H, dki, dvi);
    SPINDLE_LAUNCHED(kept != nullptr ? "kda_bwd_kept_prep_kernel" : "kda_bwd_prep_kernel");
    // A later segment left the gradient of this one's exit state in the carry.
    const float* initial = c1 == chunks ? d_final_state : carry;
    const dim3 state_grid(static_cast<unsigned>(heads), static_cast<unsigned>(value_tiles(dv)));
    launch_kernel(kda_bwd_state_kernel, state_grid, kThreads, state_smem_floats() * sizeof(float), stream,
                  ops, slots, initial, carry, d_initial_state, kept != nullptr ? kb_ds : nullptr, c0, c1, H,
                  dki, dvi);
    SPINDLE_LAUNCHED("kda_bwd_state_kernel");
    if (kept != nullptr)
      launch_kernel(kda_bwd_grad_kernel<true>, chunk_grid, kGradThreads, grad_smem_floats() * sizeof(float),
                    stream, q, k, v, g, beta, dout, kept, static_cast<const float*>(kb_ds), chunk_states,
                    static_cast<const float*>(slots), dq, dk_out, dv_out, dg, dbeta, c0, tokens, H, dki, dvi);
    else
      launch_kernel(kda_bwd_grad_kernel<false>, chunk_grid, kGradThreads, grad_smem_floats() * sizeof(float),
                    stream, q, k, v, g, beta, dout, static_cast<const float*>(mats), nullptr, chunk_states,
                    static_cast<const float*>(slots), dq, dk_out, dv_out, dg, dbeta, c0, tokens, H, dki, dvi);
    SPINDLE_LAUNCHED("kda_bwd_grad_kernel");
    c1 = c0;
  }
}

}  // namespace spindle::cuda
