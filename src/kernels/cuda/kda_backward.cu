// Kimi Delta Attention backward, chunk-parallel: the chunk form of docs/KDA.md (CPU statement:
// cpu::kda_chunked_backward), scalar fp32 on the CUDA cores. Per segment of up to
// kKdaBackwardSegmentChunks chunks, last segment first, three kernels:
//   1. prep, grid chunks x heads: G, A, Aq and Tinv = (I + diag(beta) A)^-1 of each chunk, its
//      WY form W = Tinv diag(beta) exp(G) k and Kb = exp(G_last - G) k, and the chunk's own share
//      of its entry state's gradient, Z = (exp(G) q - Aq W)^T dO, into the workspace;
//   2. state gradients, grid heads x value tiles of 16: the chunks in reverse, carrying only the
//      [dk, 16] tile of dS; per chunk dS = diag(exp G_last) dS' - W^T (Kb dS') + Z (the du and
//      dRb of the chunk form folded into W and Z), the next chunk's operands prefetched by
//      cp.async; each chunk's entry gradient into the workspace;
//   3. gradients, grid chunks x heads: from the chunk's entry state S (chunk_states) and its exit
//      gradient dS' (kernel 2), every input gradient of its tokens. One CTA walks all value tiles,
//      adding dA, dAq and the [C, dk] products dO S^T, dRb S^T, u dS'^T up in place, so every
//      output is written once, without atomics.
// Every exponential is of a difference <= 0 (exp(G_t), exp(G_last - G_t), exp(G_t - G_s), s <= t).
#include <algorithm>

#include "backend/cuda/check.h"
#include "core/error.h"
#include "kernels/cuda/kda.h"
#include "kernels/cuda/kda_chunk.cuh"
#include "kernels/cuda/mma.cuh"

namespace spindle::cuda {

namespace {

constexpr int kThreads = 256;
constexpr int kC = static_cast<int>(kKdaChunk);
constexpr int kMaxDim = static_cast<int>(kKdaMaxDim);
constexpr int kKp = kMaxDim + 1;     // row stride of [C, dk] tiles: rows t and t + 1 in distinct banks
constexpr int kCp = kC + 1;          // row stride of C x C matrices in shared memory, likewise
constexpr int kTileV = 16;           // value columns per tile
constexpr int kTileVp = kTileV + 1;  // row stride of the gradient kernel's tiles: walks over rows
constexpr int kMats = 3 * kC * kC;   // A, Aq, Tinv of one chunk and head in the workspace
constexpr int kElems = kC * kMaxDim / kThreads;  // [C, dk] elements per thread in kernel 3
constexpr unsigned kFull = 0xffffffffu;

int value_tiles(int64_t dv) { return static_cast<int>((dv + kTileV - 1) / kTileV); }

// The state pass's operands of one chunk and head (fixed strides of kMaxDim, 16-byte rows for
// cp.async, zero past the chunk's last token and past dk): W = Tinv diag(beta) exp(G) k [C, dk],
// Kb = exp(G_last - G) k [C, dk], G_last [dk].
constexpr int kOpKb = kC * kMaxDim, kOpGlast = 2 * kC * kMaxDim;
static_assert(kOpGlast + kMaxDim == kKdaBackwardOpsFloats, "kda.h's operand block matches this layout");

size_t prep_smem_floats() { return ChunkPrepTiles::floats(); }

// Kernel 1, chunk c = c0 + blockIdx.x of head blockIdx.y: A (strictly lower), Aq (lower) and Tinv
// (unit lower) into mats [chunks, heads, 3, C, C]; W, Kb and G_last into ops; and, into slot
// c - c0 of slots, the chunk's own share of its entry state's gradient, Z = (Qg - Aq W)^T dO
// [dk, dv], so that the state pass is dS = diag(exp G_last) dS' - W^T (Kb dS') + Z (docs/KDA.md).
__global__ void __launch_bounds__(kKdaPrepThreads, 1)
    kda_bwd_prep_kernel(const __nv_bfloat16* __restrict__ q, const __nv_bfloat16* __restrict__ k,
                        const float* __restrict__ g, const float* __restrict__ beta,
                        const __nv_bfloat16* __restrict__ dout, float* __restrict__ mats,
                        float* __restrict__ ops, float* __restrict__ slots, int64_t c0, int64_t tokens,
                        int heads, int dk, int dv) {
  extern __shared__ float smem[];
  constexpr int S = ChunkPrepTiles::kStride, AS = ChunkPrepTiles::kAStride;
  const int h = blockIdx.y, tid = threadIdx.x, warp = tid / 32, lane = tid % 32, g4 = lane / 4, c4 = lane % 4;
  const int64_t t0 = (c0 + blockIdx.x) * kC;
  const int n = static_cast<int>(min(static_cast<int64_t>(kC), tokens - t0));
  // q's tile: q, then Qg = exp(G) q, then P = Qg - Aq W; k's: exp(G) k, then dO; G's: then W. All
  // zero past the chunk (and past dk / dv), as the products read whole tiles.
  const ChunkPrepTiles m(smem);
  float* op = ops + (static_cast<int64_t>(blockIdx.x) * heads + h) * kKdaBackwardOpsFloats;
  float* A = mats + (static_cast<int64_t>(blockIdx.x) * heads + h) * kMats;
  chunk_prep(q, k, g, beta, t0, n, h, heads, dk, m, op + kOpKb, op + kOpGlast, true,
             [&](const ChunkPrepTiles& tiles) {
               for (int idx = tid; idx < kC * kC; idx += kKdaPrepThreads) {
                 const int t = idx / kC, s = idx - t * kC;
                 A[idx] = tiles.As[t * AS + s];
                 A[kC * kC + idx] = tiles.Aqs[t * AS + s];
                 A[2 * kC * kC + idx] = tiles.Ts[t * kKdaSolveStride + s];
               }
             });
  // W = Tinv diag(beta) exp(G) k on the tensor cores: out, and into G's tile (G is no longer
  // needed). Warp w: columns 16 (w % 8) .. + 15, m-tiles p and 3 - p (p = w / 8), so that every
  // warp takes 10 steps of 8 tokens (m-tile mt sums over 16 (mt + 1)).
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
  // P = Qg - Aq W in place (each element read and written by the lane whose product it is), the
  // same split over the warps; dO over exp(G) k meanwhile.
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
  for (int idx = tid; idx < kC * kMaxDim; idx += kKdaPrepThreads) {
    const int t = idx / kMaxDim, j = idx - t * kMaxDim;
    m.ks[t * S + j] = t < n && j < dv ? __bfloat162float(dout[((t0 + t) * heads + h) * dv + j]) : 0.0f;
  }
  __syncthreads();
  // Z = P^T dO [dk, dv] over the chunk's tokens on the tensor cores: warp w takes rows 16 (w / 2)
  // .. + 15 and columns 64 (w % 2) .. + 63. P^T's fragment is read from P's tile transposed.
  const int i0 = 16 * (warp / 2), j0 = 64 * (warp % 2);
  float z[8][4] = {};
  for (int k0 = 0; k0 < n; k0 += 8) {
    KdaFragA a;
    const float* Pc = m.qs + (k0 + c4) * S + i0 + g4;  // P^T (i0 + g4, k0 + c4)
    a.set(0, Pc[0]);
    a.set(1, Pc[8]);
    a.set(2, Pc[4 * S]);
    a.set(3, Pc[4 * S + 8]);
#pragma unroll
    for (int nt = 0; nt < 8; ++nt) {
      const float* Dc = m.ks + (k0 + c4) * S + j0 + 8 * nt + g4;
      KdaFragB b;
      b.set(0, Dc[0]);
      b.set(1, Dc[4 * S]);
      mma_tf32(z[nt], a, b);
    }
  }
  float* Z = slots + (static_cast<int64_t>(blockIdx.x) * heads + h) * dk * dv;
#pragma unroll
  for (int nt = 0; nt < 8; ++nt)
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const int i = i0 + g4 + 8 * (e / 2), j = j0 + 8 * nt + 2 * c4 + e % 2;
      if (i < dk && j < dv) Z[i * dv + j] = z[nt][e];
    }
}

// Kernel 2's shared memory: the dS tile, X = Kb dS' [C, 16] and two stages of W, Kb (row stride
// kWs) and G_last.
constexpr int kWs = kMaxDim + 4;  // 16-byte rows; rows t and t + 16 fall in distinct banks
constexpr int kStageFloats = 2 * kC * kWs + kMaxDim;
size_t state_smem_floats() { return kMaxDim * kTileV + kC * kTileV + 2 * kStageFloats; }

// Kernel 2, head blockIdx.x, value columns j0 = 16 blockIdx.y ..: chunks c1 - 1 down to c0 from
// `initial` (the gradient of the state leaving chunk c1 - 1; null: zero). Per chunk: X = Kb dS',
// dS = diag(exp G_last) dS' - W^T X + Z, Z read from slot c - c0, which then receives dS (the
// gradient of the state entering chunk c); slot c1 - c0 receives `initial`, `carry` the gradient
// entering chunk c0 (the next, earlier segment's `initial`: each CTA reads its own columns of it
// before writing them), d_initial, if not null, that of chunk 0. The next chunk's W, Kb and G_last
// arrive by cp.async while this one computes.
__global__ void __launch_bounds__(kThreads)
    kda_bwd_state_kernel(const float* __restrict__ ops, float* __restrict__ slots, const float* initial,
                         float* carry, float* __restrict__ d_initial, int64_t c0, int64_t c1, int heads,
                         int dk, int dv) {
  extern __shared__ float smem[];
  const int h = blockIdx.x, j0 = blockIdx.y * kTileV, tid = threadIdx.x;
  const int jj = tid % kTileV, rg = tid / kTileV;  // X: tokens rg + 16 r; dS: rows 8 rg .. 8 rg + 7
  const int j = j0 + jj;
  const int64_t SS = static_cast<int64_t>(dk) * dv;
  const int dk4 = (dk + 3) / 4;  // Kb's columns the products read, in fours (zero past dk)
  float* dS = smem;              // [kMaxDim, kTileV]
  float* X = dS + kMaxDim * kTileV;
  float* stages = X + kC * kTileV;
  const auto load_stage = [&](int64_t c, float* stage) {
    const float* op = ops + ((c - c0) * heads + h) * kKdaBackwardOpsFloats;
    for (int p = tid; p < kC * kMaxDim / 4; p += kThreads) {
      const int t = p / (kMaxDim / 4), i = 4 * (p - t * (kMaxDim / 4));
      copy16(stage + t * kWs + i, op + t * kMaxDim + i, true);
      copy16(stage + kC * kWs + t * kWs + i, op + kOpKb + t * kMaxDim + i, true);
    }
    for (int p = tid; p < kMaxDim / 4; p += kThreads)
      copy16(stage + 2 * kC * kWs + 4 * p, op + kOpGlast + 4 * p, true);
    copy_commit();
  };
  const auto owned = [&](int r) { return 8 * rg + r < dk && j < dv; };
  const auto at = [&](int r) { return (8 * rg + r) * dv + j; };  // offset in a [dk, dv] slot

  float dSr[8];  // rows 8 rg + r, column j
#pragma unroll
  for (int r = 0; r < 8; ++r) {
    dSr[r] = initial != nullptr && owned(r) ? initial[h * SS + at(r)] : 0.0f;
    dS[(8 * rg + r) * kTileV + jj] = dSr[r];
    if (owned(r)) slots[((c1 - c0) * heads + h) * SS + at(r)] = dSr[r];
  }
  if (c1 > c0) load_stage(c1 - 1, stages);
  for (int64_t c = c1 - 1; c >= c0; --c) {
    float* stage = stages + ((c1 - 1 - c) & 1) * kStageFloats;
    if (c - 1 >= c0) {
      load_stage(c - 1, stages + ((c1 - c) & 1) * kStageFloats);
      copy_wait_all_but_newest();
    } else {
      copy_wait_all();
    }
    float* slot = slots + ((c - c0) * heads + h) * SS;
    float z[8];
#pragma unroll
    for (int r = 0; r < 8; ++r) z[r] = owned(r) ? slot[at(r)] : 0.0f;  // Z, from kernel 1
    __syncthreads();  // this chunk's stage and the dS tile are in
    const float* W = stage;
    const float* Kb = stage + kC * kWs;
    const float* gl = stage + 2 * kC * kWs;
    // X = Kb dS' for tokens rg + 16 r (rows past the chunk are zero in Kb: X = 0 there).
    float acc[4] = {};
    for (int i = 0; i < 4 * dk4; i += 4) {
      const float s0 = dS[i * kTileV + jj], s1 = dS[(i + 1) * kTileV + jj], s2 = dS[(i + 2) * kTileV + jj],
                  s3 = dS[(i + 3) * kTileV + jj];
#pragma unroll
      for (int r = 0; r < 4; ++r) {
        const float4 w = *reinterpret_cast<const float4*>(Kb + (rg + 16 * r) * kWs + i);
        acc[r] = fmaf(w.x, s0, acc[r]);
        acc[r] = fmaf(w.y, s1, acc[r]);
        acc[r] = fmaf(w.z, s2, acc[r]);
        acc[r] = fmaf(w.w, s3, acc[r]);
      }
    }
#pragma unroll
    for (int r = 0; r < 4; ++r) X[(rg + 16 * r) * kTileV + jj] = acc[r];
    __syncthreads();
    // dS = diag(exp G_last) dS' - W^T X + Z, rows 8 rg .. 8 rg + 7.
#pragma unroll
    for (int r = 0; r < 8; ++r) dSr[r] = fmaf(expf(gl[8 * rg + r]), dSr[r], z[r]);
    for (int t = 0; t < kC; ++t) {
      const float xt = X[t * kTileV + jj];
      const float4 a = *reinterpret_cast<const float4*>(W + t * kWs + 8 * rg);
      const float4 b = *reinterpret_cast<const float4*>(W + t * kWs + 8 * rg + 4);
      dSr[0] = fmaf(-a.x, xt, dSr[0]);
      dSr[1] = fmaf(-a.y, xt, dSr[1]);
      dSr[2] = fmaf(-a.z, xt, dSr[2]);
      dSr[3] = fmaf(-a.w, xt, dSr[3]);
      dSr[4] = fmaf(-b.x, xt, dSr[4]);
      dSr[5] = fmaf(-b.y, xt, dSr[5]);
      dSr[6] = fmaf(-b.z, xt, dSr[6]);
      dSr[7] = fmaf(-b.w, xt, dSr[7]);
    }
#pragma unroll
    for (int r = 0; r < 8; ++r) {
      dS[(8 * rg + r) * kTileV + jj] = dSr[r];
      if (!owned(r)) continue;
      slot[at(r)] = dSr[r];
      if (c == c0) carry[h * SS + at(r)] = dSr[r];
      if (c == 0 && d_initial != nullptr) d_initial[h * SS + at(r)] = dSr[r];
    }
    __syncthreads();  // the next prefetch overwrites this stage; the next products read dS
  }
}

// Kernel 3's shared memory, in floats: a region used first for W, Kb, A, Aq, Tinv and then for q,
// k and G; dA and dAq; the value tile's S, dS', V/X, dO, du, u, dR (later dG); row vectors.
constexpr int kGradMats = 2 * kC * kKp + 3 * kC * kCp;
constexpr int kGradTiles = 2 * kMaxDim * kTileVp + 5 * kC * kTileVp;
static_assert(3 * kC * kKp <= kGradMats, "q, k and G fit where W, Kb and the matrices were");
static_assert(kC * kMaxDim <= kGradTiles, "dG fits where the value tiles were");
size_t grad_smem_floats() { return kGradMats + 2 * kC * kCp + kGradTiles + 2 * kC + 3 * kMaxDim; }

// Kernel 3, chunk c = c0 + blockIdx.x of head blockIdx.y. Per value tile of 16 columns:
//   X0 = V - W S, du = Kb dS' + Aq^T dO, u = Tinv diag(beta) X0, dR = Tinv^T du, X = X0 - A u;
//   dv = diag(beta) dR, dbeta += rowsum(dR . X), dA -= strict_lower(diag(beta) dR u^T),
//   dAq += lower(dO u^T), and per [C, dk] element dQg += dO S^T, dW -= diag(beta) dR S^T,
//   dKb += u dS'^T (registers: thread tid owns elements tid + kThreads r of the row-major [n, dk]).
// Then the decay products of dA and dAq, dq, dk and dG, and dg by the reverse prefix sum.
__global__ void __launch_bounds__(kThreads, 1)
    kda_bwd_grad_kernel(const __nv_bfloat16* __restrict__ q, const __nv_bfloat16* __restrict__ k,
                        const __nv_bfloat16* __restrict__ v, const float* __restrict__ g,
                        const float* __restrict__ beta, const __nv_bfloat16* __restrict__ dout,
                        const float* __restrict__ mats, const float* __restrict__ chunk_states,
                        const float* __restrict__ slots, float* __restrict__ dq, float* __restrict__ dk_out,
                        float* __restrict__ dv_out, float* __restrict__ dg, float* __restrict__ dbeta,
                        int64_t c0, int64_t tokens, int heads, int dk, int dv) {
  extern __shared__ float smem[];
  const int h = blockIdx.y, tid = threadIdx.x;
  const int64_t c = c0 + blockIdx.x, t0 = c * kC, SS = static_cast<int64_t>(dk) * dv;
  const int n = static_cast<int>(min(static_cast<int64_t>(kC), tokens - t0));
  float* W = smem;              // [C, kKp]: k, then exp(G) k
  float* Kb = W + kC * kKp;     // [C, kKp]: G, then exp(G_last - G) k
  float* A = Kb + kC * kKp;     // [C, kCp]
  float* Aq = A + kC * kCp;     // [C, kCp]
  float* Tinv = Aq + kC * kCp;  // [C, kCp]
  float* Qs = smem;             // after the value tiles: [C, kKp] q, k and G
  float* Ks = Qs + kC * kKp;
  float* Gs = Ks + kC * kKp;
  float* dA = smem + kGradMats;         // [C, kCp]
  float* dAq = dA + kC * kCp;           // [C, kCp]
  float* St = dAq + kC * kCp;           // [dk, kTileVp]: S, columns of the tile
  float* dSt = St + kMaxDim * kTileVp;  // [dk, kTileVp]: dS'
  float* X = dSt + kMaxDim * kTileVp;   // [C, kTileVp]: V, then X0
  float* dO = X + kC * kTileVp;         // [C, kTileVp]
  float* du = dO + kC * kTileVp;        // [C, kTileVp]
  float* u = du + kC * kTileVp;         // [C, kTileVp]
  float* dR = u + kC * kTileVp;         // [C, kTileVp]
  float* dG = St;                       // after the value tiles: [n, dk]
  float* bt = St + kGradTiles;          // [C]
  float* dbeta_acc = bt + kC;           // [C]
  float* glast = dbeta_acc + kC;        // [kMaxDim]: G_last
  float* sdS = glast + kMaxDim;         // [kMaxDim]: rowsum(S . dS')
  float* gextra = sdS + kMaxDim;        // [kMaxDim]: sum_t k exp(G_last - G) dKb

  for (int t = tid; t < kC; t += kThreads) {
    bt[t] = t < n ? beta[(t0 + t) * heads + h] : 0.0f;
    dbeta_acc[t] = 0.0f;
  }
  for (int i = tid; i < kMaxDim; i += kThreads) {
    sdS[i] = 0.0f;
    gextra[i] = 0.0f;
  }
  for (int idx = tid; idx < 2 * kC * kCp; idx += kThreads) dA[idx] = 0.0f;  // dA and dAq
  const float* m = mats + (static_cast<int64_t>(blockIdx.x) * heads + h) * kMats;
  for (int idx = tid; idx < kC * kC; idx += kThreads) {
    const int t = idx / kC, s = idx - t * kC;
    A[t * kCp + s] = m[idx];
    Aq[t * kCp + s] = m[kC * kC + idx];
    Tinv[t * kCp + s] = m[2 * kC * kC + idx];
  }
  load_chunk_with_prefix(nullptr, k, g, t0, n, h, heads, dk, kKp, nullptr, W, Kb, glast);
  for (int idx = tid; idx < n * dk; idx += kThreads) {
    const int t = idx / dk, i = idx - t * dk, x = t * kKp + i;
    const float G = Kb[x], kv = W[x];
    W[x] = expf(G) * kv;
    Kb[x] = expf(glast[i] - G) * kv;
  }
  __syncthreads();

  float acc_q[kElems], acc_w[kElems], acc_kb[kElems];  // dQg, dW, dKb
#pragma unroll
  for (int r = 0; r < kElems; ++r) acc_q[r] = acc_w[r] = acc_kb[r] = 0.0f;
  const float* S = chunk_states + (c * heads + h) * SS;
  const float* dSn = slots + ((c + 1 - c0) * heads + h) * SS;
  for (int j0 = 0; j0 < dv; j0 += kTileV) {
    for (int idx = tid; idx < dk * kTileV; idx += kThreads) {
      const int i = idx / kTileV, jj = idx - i * kTileV, j = j0 + jj;
      St[i * kTileVp + jj] = j < dv ? S[i * dv + j] : 0.0f;
      dSt[i * kTileVp + jj] = j < dv ? dSn[i * dv + j] : 0.0f;
    }
    for (int idx = tid; idx < n * kTileV; idx += kThreads) {
      const int t = idx / kTileV, jj = idx - t * kTileV, j = j0 + jj;
      const int64_t row = (t0 + t) * heads + h;
      X[t * kTileVp + jj] = j < dv ? __bfloat162float(v[row * dv + j]) : 0.0f;
      dO[t * kTileVp + jj] = j < dv ? __bfloat162float(dout[row * dv + j]) : 0.0f;
    }
    __syncthreads();
    // X0 = V - W S (in place: own element); du = Kb dS' + Aq^T dO; rowsum(S . dS').
    for (int idx = tid; idx < n * kTileV; idx += kThreads) {
      const int t = idx / kTileV, jj = idx - t * kTileV, x = t * kTileVp + jj;
      float x0 = X[x], d = 0.0f;
      for (int i = 0; i < dk; ++i) {
        x0 = fmaf(-W[t * kKp + i], St[i * kTileVp + jj], x0);
        d = fmaf(Kb[t * kKp + i], dSt[i * kTileVp + jj], d);
      }
      for (int s = t; s < n; ++s) d = fmaf(Aq[s * kCp + t], dO[s * kTileVp + jj], d);
      X[x] = x0;
      du[x] = d;
    }
    for (int i = tid; i < dk; i += kThreads) {
      float acc = 0.0f;
      for (int jj = 0; jj < kTileV; ++jj) acc = fmaf(St[i * kTileVp + jj], dSt[i * kTileVp + jj], acc);
      sdS[i] += acc;
    }
    __syncthreads();
    // u = Tinv diag(beta) X0 (s <= t), dR = Tinv^T du (s >= t).
    for (int idx = tid; idx < n * kTileV; idx += kThreads) {
      const int t = idx / kTileV, jj = idx - t * kTileV;
      float a = 0.0f, d = 0.0f;
      for (int s = 0; s <= t; ++s) a = fmaf(Tinv[t * kCp + s], bt[s] * X[s * kTileVp + jj], a);
      for (int s = t; s < n; ++s) d = fmaf(Tinv[s * kCp + t], du[s * kTileVp + jj], d);
      u[t * kTileVp + jj] = a;
      dR[t * kTileVp + jj] = d;
    }
    __syncthreads();
    // dv, dbeta: all C rows, so that every half-warp (one row) reaches the shuffles whole.
    for (int idx = tid; idx < kC * kTileV; idx += kThreads) {
      const int t = idx / kTileV, jj = idx - t * kTileV, j = j0 + jj;
      float part = 0.0f;
      if (t < n) {
        float x = X[t * kTileVp + jj];  // X = X0 - A u (A strictly lower)
        for (int s = 0; s < t; ++s) x = fmaf(-A[t * kCp + s], u[s * kTileVp + jj], x);
        const float r = dR[t * kTileVp + jj];
        part = r * x;
        if (j < dv) dv_out[((t0 + t) * heads + h) * dv + j] = bt[t] * r;
      }
      for (int offset = 8; offset > 0; offset >>= 1) part += __shfl_xor_sync(kFull, part, offset);
      if (jj == 0 && t < n) dbeta_acc[t] += part;
    }
    // dA -= diag(beta) dR u^T (s < t), dAq += dO u^T (s <= t). Each element has one owner.
    for (int idx = tid; idx < kC * kC; idx += kThreads) {
      const int t = idx / kC, s = idx - t * kC;
      if (t >= n || s > t) continue;
      float a = 0.0f, aq = 0.0f;
      for (int jj = 0; jj < kTileV; ++jj) {
        const float us = u[s * kTileVp + jj];
        a = fmaf(dR[t * kTileVp + jj], us, a);
        aq = fmaf(dO[t * kTileVp + jj], us, aq);
      }
      if (s < t) dA[t * kCp + s] -= bt[t] * a;
      dAq[t * kCp + s] += aq;
    }
#pragma unroll
    for (int r = 0; r < kElems; ++r) {
      const int e = tid + kThreads * r;
      if (e < n * dk) {
        const int t = e / dk, i = e - t * dk;
        float aq = 0.0f, aw = 0.0f, akb = 0.0f;
        for (int jj = 0; jj < kTileV; ++jj) {
          const float s = St[i * kTileVp + jj];
          aq = fmaf(dO[t * kTileVp + jj], s, aq);
          aw = fmaf(dR[t * kTileVp + jj], s, aw);
          akb = fmaf(u[t * kTileVp + jj], dSt[i * kTileVp + jj], akb);
        }
        acc_q[r] += aq;
        acc_w[r] = fmaf(-bt[t], aw, acc_w[r]);
        acc_kb[r] += akb;
      }
    }
    __syncthreads();  // the next tile's loads (and q, k, G after the last) overwrite what was read
  }

  // q, k and G again, where W, Kb and the matrices were.
  load_chunk_with_prefix(q, k, g, t0, n, h, heads, dk, kKp, Qs, Ks, Gs, glast);
#pragma unroll
  for (int r = 0; r < kElems; ++r) {
    const int e = tid + kThreads * r;
    if (e < n * dk) {
      const int t = e / dk, i = e - t * dk, x = t * kKp + i;
      const float Gt = Gs[x];
      // Rows of the decay products (token t the later one, s <= t; dA is zero on the diagonal)
      // and their columns (token t the earlier one, r >= t).
      float rowA = 0.0f, rowAq = 0.0f, colA = 0.0f, colAq = 0.0f;
      for (int s = 0; s <= t; ++s) {
        const float w = expf(Gt - Gs[s * kKp + i]) * Ks[s * kKp + i];
        rowA = fmaf(dA[t * kCp + s], w, rowA);
        rowAq = fmaf(dAq[t * kCp + s], w, rowAq);
      }
      for (int s = t; s < n; ++s) {
        const float w = expf(Gs[s * kKp + i] - Gt);
        colA = fmaf(dA[s * kCp + t] * w, Ks[s * kKp + i], colA);
        colAq = fmaf(dAq[s * kCp + t] * w, Qs[s * kKp + i], colAq);
      }
      const float E = expf(Gt), kb_part = expf(glast[i] - Gt) * acc_kb[r];
      const float dq_x = fmaf(E, acc_q[r], rowAq), later = fmaf(E, acc_w[r], rowA);
      const float earlier = kb_part + colA + colAq;
      const int64_t row = (t0 + t) * heads + h;
      dq[row * dk + i] = dq_x;
      dk_out[row * dk + i] = later + earlier;
      dG[t * dk + i] = Qs[x] * dq_x + Ks[x] * (later - earlier);
      atomicAdd(gextra + i, Ks[x] * kb_part);  // G_last's share through Kb
    }
  }
  __syncthreads();
  // dg_t = sum_{r>=t} dG_r, G_last's direct terms (Kb and exp(G_last) S) in every row.
  for (int i = tid; i < dk; i += kThreads) {
    float acc = gextra[i] + expf(glast[i]) * sdS[i];
    for (int t = n - 1; t >= 0; --t) {
      acc += dG[t * dk + i];
      dg[((t0 + t) * heads + h) * dk + i] = acc;
    }
  }
  for (int t = tid; t < n; t += kThreads) dbeta[(t0 + t) * heads + h] = dbeta_acc[t];
}

void set_smem(const void* kernel, size_t floats) {
  SPINDLE_CUDA(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                    static_cast<int>(floats * sizeof(float))));
}

}  // namespace

void kda_chunked_backward(const __nv_bfloat16* q, const __nv_bfloat16* k, const __nv_bfloat16* v,
                          const float* g, const float* beta, const __nv_bfloat16* dout,
                          const float* chunk_states, float* dq, float* dk_out, float* dv_out, float* dg,
                          float* dbeta, float* workspace, int64_t tokens, int64_t heads, int64_t dk,
                          int64_t dv, cudaStream_t stream, const float* d_final_state,
                          float* d_initial_state) {
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
  float* mats = workspace;
  float* ops = mats + segment * heads * kMats;
  float* slots = ops + segment * heads * kKdaBackwardOpsFloats;
  float* carry = slots + (segment + 1) * heads * SS;
  set_smem(reinterpret_cast<const void*>(kda_bwd_prep_kernel), prep_smem_floats());
  set_smem(reinterpret_cast<const void*>(kda_bwd_state_kernel), state_smem_floats());
  set_smem(reinterpret_cast<const void*>(kda_bwd_grad_kernel), grad_smem_floats());
  const int H = static_cast<int>(heads), dki = static_cast<int>(dk), dvi = static_cast<int>(dv);
  // Segments start at multiples of the segment length; the last (first walked) may be shorter.
  for (int64_t c1 = chunks; c1 > 0;) {
    const int64_t c0 = (c1 - 1) / kKdaBackwardSegmentChunks * kKdaBackwardSegmentChunks;
    const dim3 chunk_grid(static_cast<unsigned>(c1 - c0), static_cast<unsigned>(heads));
    kda_bwd_prep_kernel<<<chunk_grid, kKdaPrepThreads, prep_smem_floats() * sizeof(float), stream>>>(
        q, k, g, beta, dout, mats, ops, slots, c0, tokens, H, dki, dvi);
    SPINDLE_LAUNCHED("kda_bwd_prep_kernel");
    // A later segment left the gradient of this one's exit state in the carry.
    const float* initial = c1 == chunks ? d_final_state : carry;
    const dim3 state_grid(static_cast<unsigned>(heads), static_cast<unsigned>(value_tiles(dv)));
    kda_bwd_state_kernel<<<state_grid, kThreads, state_smem_floats() * sizeof(float), stream>>>(
        ops, slots, initial, carry, d_initial_state, c0, c1, H, dki, dvi);
    SPINDLE_LAUNCHED("kda_bwd_state_kernel");
    kda_bwd_grad_kernel<<<chunk_grid, kThreads, grad_smem_floats() * sizeof(float), stream>>>(
        q, k, v, g, beta, dout, mats, chunk_states, slots, dq, dk_out, dv_out, dg, dbeta, c0, tokens, H, dki,
        dvi);
    SPINDLE_LAUNCHED("kda_bwd_grad_kernel");
    c1 = c0;
  }
}

}  // namespace spindle::cuda
