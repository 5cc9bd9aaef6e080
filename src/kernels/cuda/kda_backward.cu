// Kimi Delta Attention backward, chunk-parallel: the chunk form of docs/KDA.md (CPU statement:
// cpu::kda_chunked_backward), scalar fp32 on the CUDA cores. Per segment of up to
// kKdaBackwardSegmentChunks chunks, last segment first, three kernels:
//   1. prep, grid chunks x heads: G, A, Aq and Tinv = (I + diag(beta) A)^-1 of each chunk into the
//      workspace;
//   2. state gradients, grid heads x value tiles of 16: the chunks in reverse, carrying only the
//      [dk, 16] tile of dS; per chunk du = Kb dS' + Aq^T dO, dRb = diag(beta) Tinv^T du and
//      dS = diag(exp G_last) dS' + Qg^T dO - W^T dRb, each chunk's exit gradient into the workspace;
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

size_t prep_smem_floats() { return 3 * kC * kKp + 2 * kC * kC + kC * kKdaSolveStride + kC; }

// Kernel 1, chunk c0 + blockIdx.x of head blockIdx.y: A (strictly lower), Aq (lower) and Tinv
// (unit lower) into mats [chunks, heads, 3, C, C], zero past the chunk's last token.
__global__ void __launch_bounds__(kThreads)
    kda_bwd_prep_kernel(const __nv_bfloat16* __restrict__ q, const __nv_bfloat16* __restrict__ k,
                        const float* __restrict__ g, const float* __restrict__ beta, float* __restrict__ mats,
                        int64_t c0, int64_t tokens, int heads, int dk) {
  extern __shared__ float smem[];
  const int h = blockIdx.y, tid = threadIdx.x;
  const int64_t t0 = (c0 + blockIdx.x) * kC;
  const int n = static_cast<int>(min(static_cast<int64_t>(kC), tokens - t0));
  float* qs = smem;                       // [C, kKp]
  float* ks = qs + kC * kKp;              // [C, kKp]
  float* Gs = ks + kC * kKp;              // [C, kKp]
  float* As = Gs + kC * kKp;              // [C, C]
  float* Aqs = As + kC * kC;              // [C, C]
  float* Ts = Aqs + kC * kC;              // [C, kKdaSolveStride]
  float* bt = Ts + kC * kKdaSolveStride;  // [C]
  for (int t = tid; t < n; t += kThreads) bt[t] = beta[(t0 + t) * heads + h];
  load_chunk_with_prefix(q, k, g, t0, n, h, heads, dk, kKp, qs, ks, Gs, nullptr);
  chunk_matrices(qs, ks, Gs, kKp, bt, n, dk, As, Aqs, Ts);
  float* A = mats + (static_cast<int64_t>(blockIdx.x) * heads + h) * kMats;
  float* Aq = A + kC * kC;
  float* Tinv = Aq + kC * kC;
  for (int idx = tid; idx < kC * kC; idx += kThreads) {
    const int t = idx / kC, s = idx - t * kC;
    A[idx] = As[idx];
    Aq[idx] = Aqs[idx];
    Tinv[idx] = Ts[t * kKdaSolveStride + s];
  }
}

size_t state_smem_floats() {
  return 3 * kC * kKp + 2 * kC * kCp + 3 * kC * kTileV + kMaxDim * kTileV + kC + kMaxDim;
}

// Kernel 2, head blockIdx.x, value columns j0 .. j0 + 15 (j0 = 16 blockIdx.y): chunks c1 - 1 down
// to c0 from `initial` (the gradient of the state leaving chunk c1 - 1; null: zero). slots [c1 - c0
// + 1, heads, dk, dv]: slot c - c0 receives the gradient of the state entering chunk c (slot c1 - c0
// `initial` itself); d_initial, if not null, that of chunk 0. `initial` may be slot 0 (the previous,
// later segment's last write): each CTA reads its own columns of it before writing any slot.
__global__ void __launch_bounds__(kThreads)
    kda_bwd_state_kernel(const __nv_bfloat16* __restrict__ q, const __nv_bfloat16* __restrict__ k,
                         const float* __restrict__ g, const float* __restrict__ beta,
                         const __nv_bfloat16* __restrict__ dout, const float* __restrict__ mats, float* slots,
                         const float* initial, float* __restrict__ d_initial, int64_t c0, int64_t c1,
                         int64_t tokens, int heads, int dk, int dv) {
  extern __shared__ float smem[];
  const int h = blockIdx.x, j0 = blockIdx.y * kTileV, tid = threadIdx.x;
  const int64_t SS = static_cast<int64_t>(dk) * dv;
  const int slice = dk * kTileV;
  float* Qg = smem;                   // [C, kKp]: q, then exp(G) q
  float* W = Qg + kC * kKp;           // [C, kKp]: k, then exp(G) k
  float* Kb = W + kC * kKp;           // [C, kKp]: G, then exp(G_last - G) k
  float* Aq = Kb + kC * kKp;          // [C, kCp]
  float* Tinv = Aq + kC * kCp;        // [C, kCp]
  float* dO = Tinv + kC * kCp;        // [C, kTileV]
  float* du = dO + kC * kTileV;       // [C, kTileV]
  float* dRb = du + kC * kTileV;      // [C, kTileV]
  float* dS = dRb + kC * kTileV;      // [dk, kTileV]: the tile of the state gradient
  float* bt = dS + kMaxDim * kTileV;  // [C]
  float* glast = bt + kC;             // [kMaxDim]
  for (int idx = tid; idx < slice; idx += kThreads) {
    const int i = idx / kTileV, j = j0 + idx % kTileV;
    dS[idx] = initial != nullptr && j < dv ? initial[h * SS + i * dv + j] : 0.0f;
  }
  __syncthreads();
  for (int idx = tid; idx < slice; idx += kThreads) {
    const int i = idx / kTileV, j = j0 + idx % kTileV;
    if (j < dv) slots[((c1 - c0) * heads + h) * SS + i * dv + j] = dS[idx];
  }
  for (int64_t c = c1 - 1; c >= c0; --c) {
    const int64_t t0 = c * kC;
    const int n = static_cast<int>(min(static_cast<int64_t>(kC), tokens - t0));
    const float* m = mats + ((c - c0) * heads + h) * kMats;
    for (int idx = tid; idx < kC * kC; idx += kThreads) {
      const int t = idx / kC, s = idx - t * kC;
      Aq[t * kCp + s] = m[kC * kC + idx];
      Tinv[t * kCp + s] = m[2 * kC * kC + idx];
    }
    for (int t = tid; t < n; t += kThreads) bt[t] = beta[(t0 + t) * heads + h];
    for (int idx = tid; idx < n * kTileV; idx += kThreads) {
      const int t = idx / kTileV, j = j0 + idx % kTileV;
      dO[idx] = j < dv ? __bfloat162float(dout[((t0 + t) * heads + h) * dv + j]) : 0.0f;
    }
    load_chunk_with_prefix(q, k, g, t0, n, h, heads, dk, kKp, Qg, W, Kb, glast);
    for (int idx = tid; idx < n * dk; idx += kThreads) {
      const int t = idx / dk, i = idx - t * dk, x = t * kKp + i;
      const float G = Kb[x], e = expf(G), kv = W[x];
      Qg[x] *= e;
      W[x] = e * kv;
      Kb[x] = expf(glast[i] - G) * kv;
    }
    __syncthreads();
    // du = Kb dS' + Aq^T dO (Aq lower: s >= t).
    for (int idx = tid; idx < n * kTileV; idx += kThreads) {
      const int t = idx / kTileV, jj = idx - t * kTileV;
      float acc = 0.0f;
      for (int i = 0; i < dk; ++i) acc = fmaf(Kb[t * kKp + i], dS[i * kTileV + jj], acc);
      for (int s = t; s < n; ++s) acc = fmaf(Aq[s * kCp + t], dO[s * kTileV + jj], acc);
      du[idx] = acc;
    }
    __syncthreads();
    // dRb = diag(beta) Tinv^T du (Tinv lower: s >= t).
    for (int idx = tid; idx < n * kTileV; idx += kThreads) {
      const int t = idx / kTileV, jj = idx - t * kTileV;
      float acc = 0.0f;
      for (int s = t; s < n; ++s) acc = fmaf(Tinv[s * kCp + t], du[s * kTileV + jj], acc);
      dRb[idx] = bt[t] * acc;
    }
    __syncthreads();
    // dS = diag(exp G_last) dS' + Qg^T dO - W^T dRb, in place: each element is read and written by
    // one thread, and the barrier above ordered the du products' reads of it.
    for (int idx = tid; idx < slice; idx += kThreads) {
      const int i = idx / kTileV, jj = idx - i * kTileV, j = j0 + jj;
      float acc = expf(glast[i]) * dS[idx];
      for (int t = 0; t < n; ++t) {
        acc = fmaf(Qg[t * kKp + i], dO[t * kTileV + jj], acc);
        acc = fmaf(-W[t * kKp + i], dRb[t * kTileV + jj], acc);
      }
      dS[idx] = acc;
      if (j < dv) {
        slots[((c - c0) * heads + h) * SS + i * dv + j] = acc;
        if (c == 0 && d_initial != nullptr) d_initial[h * SS + i * dv + j] = acc;
      }
    }
    __syncthreads();  // the next chunk's loads overwrite what these products read
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
  float* slots = workspace + segment * heads * kMats;
  set_smem(reinterpret_cast<const void*>(kda_bwd_prep_kernel), prep_smem_floats());
  set_smem(reinterpret_cast<const void*>(kda_bwd_state_kernel), state_smem_floats());
  set_smem(reinterpret_cast<const void*>(kda_bwd_grad_kernel), grad_smem_floats());
  const int H = static_cast<int>(heads), dki = static_cast<int>(dk), dvi = static_cast<int>(dv);
  // Segments start at multiples of the segment length; the last (first walked) may be shorter.
  for (int64_t c1 = chunks; c1 > 0;) {
    const int64_t c0 = (c1 - 1) / kKdaBackwardSegmentChunks * kKdaBackwardSegmentChunks;
    const dim3 chunk_grid(static_cast<unsigned>(c1 - c0), static_cast<unsigned>(heads));
    kda_bwd_prep_kernel<<<chunk_grid, kThreads, prep_smem_floats() * sizeof(float), stream>>>(
        q, k, g, beta, mats, c0, tokens, H, dki);
    SPINDLE_LAUNCHED("kda_bwd_prep_kernel");
    // A later segment left the gradient of this one's exit state in slot 0.
    const float* initial = c1 == chunks ? d_final_state : slots;
    const dim3 state_grid(static_cast<unsigned>(heads), static_cast<unsigned>(value_tiles(dv)));
    kda_bwd_state_kernel<<<state_grid, kThreads, state_smem_floats() * sizeof(float), stream>>>(
        q, k, g, beta, dout, mats, slots, initial, d_initial_state, c0, c1, tokens, H, dki, dvi);
    SPINDLE_LAUNCHED("kda_bwd_state_kernel");
    kda_bwd_grad_kernel<<<chunk_grid, kThreads, grad_smem_floats() * sizeof(float), stream>>>(
        q, k, v, g, beta, dout, mats, chunk_states, slots, dq, dk_out, dv_out, dg, dbeta, c0, tokens, H, dki,
        dvi);
    SPINDLE_LAUNCHED("kda_bwd_grad_kernel");
    c1 = c0;
  }
}

}  // namespace spindle::cuda
