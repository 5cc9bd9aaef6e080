// Kimi Delta Attention, chunked. The recurrence is independent per value column (S's column j
// sees only v[:, j]; k, g and beta are shared), so the grid is heads x value tiles of 16 columns:
// a CTA of 256 threads owns the [dk, 16] slice of one head's fp32 state and walks the chunks in
// order (16 heads x dv 128 give 128 CTAs, the width of an H200). Scalar fp32 FMAs, no tensor cores.
//
// Forward, per chunk of C = 64 tokens:
//   1. load k, q (bf16 -> fp32) and g; per-channel prefix sums G_t = sum_{s<=t} g_s;
//   2. A[t][s] = sum_i k_t,i exp(G_t,i - G_s,i) k_s,i (s < t) and Aq[t][s] likewise with q_t
//      (s <= t), exponent differences taken directly (always <= 0: no overflow however long the
//      chunk's cumulative decay). A separate kernel computes them for a segment of 256 chunks at
//      once (grid chunks x heads: all of the GPU), before the sequential kernel walks the segment;
//   3. rhs_t = v_t - (exp(G_t) * k_t)^T S;  u_t = beta_t (rhs_t - sum_{s<t} A[t][s] u_s), a unit
//      lower-triangular forward substitution, 16 lanes per value column (shuffle sums);
//   4. o_t = (exp(G_t) * q_t)^T S + sum_{s<=t} Aq[t][s] u_s;
//   5. S = diag(exp(G_last)) S + sum_s (exp(G_last - G_s) * k_s) u_s^T.
// Backward, chunks in reverse, the state gradient dS in registers (thread (jj, ig) owns column jj
// and rows ig, ig + 16, ..): the chunk's states are recomputed from its stored entry state, first
// to the entries of its four 16-token sub-chunks, then per sub-chunk (last first) every token's
// state into shared memory, and the token-by-token reverse rule of cpu::kda_recurrence_backward
// runs over them. Sums over the value column (dq, dk, dg, dbeta) are partial per tile and added
// to the outputs with fp32 atomics.
//
// Tensor-core version (next): a chunk-parallel kernel (grid chunks x heads) computes A, Aq and
// T = (I + diag(beta) A)^-1 diag(beta) with wgmma, so that u = T (v - Kexp S) and the effective
// keys W = T Kexp are GEMMs; the sequential kernel then carries S with two [dk, 64] x [64, dv]
// GEMMs per chunk, and the backward becomes the same in reverse.
#include <algorithm>

#include "backend/cuda/check.h"
#include "core/error.h"
#include "kernels/cuda/kda.h"
#include "kernels/cuda/kda_chunk.cuh"

namespace spindle::cuda {

namespace {

constexpr int kThreads = 256;
constexpr int kWarps = kThreads / 32;
constexpr int kC = static_cast<int>(kKdaChunk);
constexpr int kTileV = 16;                      // value columns per CTA
constexpr int kRowGroups = kThreads / kTileV;   // thread (jj = tid % 16, ig = tid / 16)
constexpr int kRows = kKdaMaxDim / kRowGroups;  // state rows per thread: ig + 16 r
constexpr int kSub = 16;                        // backward sub-chunk (tokens)
constexpr unsigned kFull = 0xffffffffu;
static_assert(kWarps * 2 == kTileV, "the forward substitution gives each warp two value columns");
static_assert(kC % kSub == 0, "sub-chunks tile the chunk");

int value_tiles(int64_t dv) { return static_cast<int>((dv + kTileV - 1) / kTileV); }

size_t matrices_smem_bytes(int dk) { return sizeof(float) * static_cast<size_t>(3 * kC * (dk + 1)); }

// Step 2 for chunk c0 + blockIdx.x of head blockIdx.y: A and Aq into mats [chunks, heads, 2, C, C]
// (zero outside s < t, resp. s <= t, and past the last token).
__global__ void __launch_bounds__(kThreads)
    kda_chunk_matrices_kernel(const __nv_bfloat16* __restrict__ q, const __nv_bfloat16* __restrict__ k,
                              const float* __restrict__ g, float* __restrict__ mats, int64_t c0,
                              int64_t tokens, int heads, int dk) {
  extern __shared__ float smem[];
  const int h = blockIdx.y, kp = dk + 1;
  const int64_t t0 = (c0 + blockIdx.x) * kC;
  const int n = static_cast<int>(min(static_cast<int64_t>(kC), tokens - t0));
  float* kb = smem;
  float* qb = kb + kC * kp;
  float* Gb = qb + kC * kp;
  load_chunk_with_prefix(q, k, g, t0, n, h, heads, dk, kp, qb, kb, Gb, nullptr);
  float* A = mats + (static_cast<int64_t>(blockIdx.x) * heads + h) * 2 * kC * kC;
  float* Aq = A + kC * kC;
  for (int idx = threadIdx.x; idx < kC * kC; idx += kThreads) {
    const int t = idx / kC, s = idx - t * kC;
    float a = 0.0f, aq = 0.0f;
    if (t < n && s <= t) {
      for (int i = 0; i < dk; ++i) {
        const float w = expf(Gb[t * kp + i] - Gb[s * kp + i]) * kb[s * kp + i];
        a = fmaf(kb[t * kp + i], w, a);
        aq = fmaf(qb[t * kp + i], w, aq);
      }
    }
    A[idx] = s < t ? a : 0.0f;
    Aq[idx] = aq;
  }
}

size_t forward_smem_bytes(int dk) {
  const int kp = dk + 1;  // padded row stride of the [C, dk] tiles: conflict-free column walks
  return sizeof(float) * static_cast<size_t>(dk * kTileV + 3 * kC * kp + kC * kTileV + 2 * kC * kC + kC + dk);
}

// Chunks [c0, c1) from `initial` (null: zero), writing chunk_states[c0 .. c1]. `initial` may be
// chunk_states[c0] itself (a later segment): each CTA reads its columns before writing them back.
__global__ void __launch_bounds__(kThreads)
    kda_forward_kernel(const __nv_bfloat16* __restrict__ q, const __nv_bfloat16* __restrict__ k,
                       const __nv_bfloat16* __restrict__ v, const float* __restrict__ g,
                       const float* __restrict__ beta, const float* __restrict__ mats,
                       __nv_bfloat16* __restrict__ out, float* chunk_states, const float* initial, int64_t c0,
                       int64_t c1, int64_t tokens, int heads, int dk, int dv) {
  extern __shared__ float smem[];
  const int h = blockIdx.x, j0 = blockIdx.y * kTileV, tid = threadIdx.x, kp = dk + 1;
  const int64_t SS = static_cast<int64_t>(dk) * dv;
  const int slice = dk * kTileV;
  float* S = smem;             // [dk, kTileV]: columns j0 .. j0 + 15 of the state
  float* kb = S + slice;       // [C, kp]: k, then exp(G_t) k_t
  float* qb = kb + kC * kp;    // [C, kp]: q, then exp(G_t) q_t
  float* Gb = qb + kC * kp;    // [C, kp]: G, then exp(G_last - G_t) k_t
  float* u = Gb + kC * kp;     // [C, kTileV]
  float* A = u + kC * kTileV;  // [C, C]
  float* Aq = A + kC * kC;     // [C, C]
  float* bt = Aq + kC * kC;    // [C]
  float* gl = bt + kC;         // [dk]: G of the chunk's last token
  for (int idx = tid; idx < slice; idx += kThreads) {
    const int i = idx / kTileV, j = j0 + idx % kTileV;
    S[idx] = initial != nullptr && j < dv ? initial[h * SS + i * dv + j] : 0.0f;
  }
  __syncthreads();
  for (int64_t c = c0; c <= c1; ++c) {
    float* state_out = chunk_states + (c * heads + h) * SS;
    for (int idx = tid; idx < slice; idx += kThreads) {
      const int i = idx / kTileV, j = j0 + idx % kTileV;
      if (j < dv) state_out[i * dv + j] = S[idx];
    }
    if (c == c1) break;
    const int64_t t0 = c * kC;
    const int n = static_cast<int>(min(static_cast<int64_t>(kC), tokens - t0));
    const float* chunk_mats = mats + ((c - c0) * heads + h) * 2 * kC * kC;
    for (int idx = tid; idx < 2 * kC * kC; idx += kThreads) A[idx] = chunk_mats[idx];  // A, then Aq
    for (int t = tid; t < n; t += kThreads) bt[t] = beta[(t0 + t) * heads + h];
    load_chunk_with_prefix(q, k, g, t0, n, h, heads, dk, kp, qb, kb, Gb, gl);
    for (int idx = tid; idx < n * dk; idx += kThreads) {
      const int t = idx / dk, i = idx - t * dk;
      const float G = Gb[t * kp + i], e = expf(G);
      qb[t * kp + i] *= e;
      Gb[t * kp + i] = kb[t * kp + i] * expf(gl[i] - G);
      kb[t * kp + i] *= e;
    }
    __syncthreads();
    for (int idx = tid; idx < n * kTileV; idx += kThreads) {
      const int t = idx / kTileV, jj = idx - t * kTileV, j = j0 + jj;
      float acc = j < dv ? __bfloat162float(v[((t0 + t) * heads + h) * dv + j]) : 0.0f;
      for (int i = 0; i < dk; ++i) acc = fmaf(-kb[t * kp + i], S[i * kTileV + jj], acc);
      u[t * kTileV + jj] = acc;
    }
    __syncthreads();
    {
      // Forward substitution: 16 lanes per value column split each row's sum; a warp owns two
      // columns, so rows follow each other with only a warp barrier.
      const int lane = tid & 31, jj = 2 * (tid >> 5) + (lane >> 4), sub = lane & 15;
      for (int t = 0; t < n; ++t) {
        float acc = 0.0f;
        for (int s = sub; s < t; s += 16) acc = fmaf(A[t * kC + s], u[s * kTileV + jj], acc);
        for (int offset = 8; offset > 0; offset >>= 1) acc += __shfl_xor_sync(kFull, acc, offset);
        if (sub == 0) u[t * kTileV + jj] = bt[t] * (u[t * kTileV + jj] - acc);
        __syncwarp();
      }
    }
    __syncthreads();
    for (int idx = tid; idx < n * kTileV; idx += kThreads) {
      const int t = idx / kTileV, jj = idx - t * kTileV, j = j0 + jj;
      if (j >= dv) continue;
      float o = 0.0f;
      for (int i = 0; i < dk; ++i) o = fmaf(qb[t * kp + i], S[i * kTileV + jj], o);
      for (int s = 0; s <= t; ++s) o = fmaf(Aq[t * kC + s], u[s * kTileV + jj], o);
      out[((t0 + t) * heads + h) * dv + j] = __float2bfloat16(o);
    }
    __syncthreads();
    for (int idx = tid; idx < slice; idx += kThreads) {
      const int i = idx / kTileV, jj = idx - i * kTileV;
      float s_new = expf(gl[i]) * S[idx];
      for (int s = 0; s < n; ++s) s_new = fmaf(Gb[s * kp + i], u[s * kTileV + jj], s_new);
      S[idx] = s_new;
    }
    __syncthreads();
  }
}

// Backward shared memory: the states of one sub-chunk, the entries of a chunk's sub-chunks, the
// per-row partials of three row sums (dq, dk, dg) and two buffers of column-sum partials.
size_t backward_smem_bytes(int dk) {
  const size_t slice = static_cast<size_t>(dk) * kTileV;
  const size_t row_partials =
      (3 * static_cast<size_t>(dk) * (kTileV + 1) + 1) / 2 * 2;  // float2-aligned after
  return sizeof(float) * ((kSub + 1) * slice + (kC / kSub) * slice + row_partials + 2 * 2 * kWarps * kTileV);
}

// The sum over all state rows of each thread's partials for its value column (two at once).
// `scratch`: [kWarps, kTileV] float2; callers alternate two of them, so a fast thread's next call
// never overwrites values a slow thread still reads (the barrier in between orders them).
__device__ __forceinline__ float2 column_sum(float2 partial, float2* scratch) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, jj = threadIdx.x % kTileV;
  partial.x += __shfl_xor_sync(kFull, partial.x, 16);
  partial.y += __shfl_xor_sync(kFull, partial.y, 16);
  if (lane < 16) scratch[warp * kTileV + jj] = partial;
  __syncthreads();
  float2 total = make_float2(0.0f, 0.0f);
  for (int w = 0; w < kWarps; ++w) {
    const float2 p = scratch[w * kTileV + jj];
    total.x += p.x;
    total.y += p.y;
  }
  return total;
}

// One token of the forward recurrence on the thread's own state elements `S`:
// S = diag(exp g) S + k (beta (v - (exp(g) k)^T S))^T.
__device__ __forceinline__ void forward_step(float (&S)[kRows], const __nv_bfloat16* __restrict__ k,
                                             const __nv_bfloat16* __restrict__ v, const float* __restrict__ g,
                                             const float* __restrict__ beta, int64_t row, int dk, int dv,
                                             int j, int ig, float2* scratch) {
  float kk[kRows], ee[kRows];
  float part = 0.0f;
#pragma unroll
  for (int r = 0; r < kRows; ++r) {
    const int i = ig + kRowGroups * r;
    kk[r] = i < dk ? __bfloat162float(k[row * dk + i]) : 0.0f;
    ee[r] = i < dk ? expf(g[row * dk + i]) : 0.0f;
    part = fmaf(ee[r] * kk[r], S[r], part);
  }
  const float vj = j < dv ? __bfloat162float(v[row * dv + j]) : 0.0f;
  const float kv = column_sum(make_float2(part, 0.0f), scratch).x;
  const float delta = beta[row] * (vj - kv);
#pragma unroll
  for (int r = 0; r < kRows; ++r) S[r] = fmaf(kk[r], delta, ee[r] * S[r]);
}

__global__ void __launch_bounds__(kThreads, 1)
    kda_backward_kernel(const __nv_bfloat16* __restrict__ q, const __nv_bfloat16* __restrict__ k,
                        const __nv_bfloat16* __restrict__ v, const float* __restrict__ g,
                        const float* __restrict__ beta, const __nv_bfloat16* __restrict__ dout,
                        const float* __restrict__ chunk_states, const float* __restrict__ d_final,
                        float* __restrict__ d_initial, float* __restrict__ dq, float* __restrict__ dk_out,
                        float* __restrict__ dv_out, float* __restrict__ dg, float* __restrict__ dbeta,
                        int64_t tokens, int heads, int dk, int dv) {
  extern __shared__ float smem[];
  const int h = blockIdx.x, tid = threadIdx.x, lane = tid & 31, jj = tid % kTileV, ig = tid / kTileV;
  const int j = blockIdx.y * kTileV + jj;
  const int64_t SS = static_cast<int64_t>(dk) * dv;
  const int slice = dk * kTileV;
  float* states = smem;                          // [kSub + 1, dk, kTileV]
  float* entries = states + (kSub + 1) * slice;  // [C / kSub, dk, kTileV]
  float* rows = entries + (kC / kSub) * slice;   // [3, dk, kTileV + 1]
  float2* cols =
      reinterpret_cast<float2*>(rows + (3 * dk * (kTileV + 1) + 1) / 2 * 2);  // [2, kWarps, kTileV]
  int flip = 0;
  const auto next_scratch = [&] {
    flip ^= 1;
    return cols + flip * kWarps * kTileV;
  };
  // Own element r: state row ig + 16 r, column j; its offset in a [dk, kTileV] slice.
  const auto own = [&](int r) { return (ig + kRowGroups * r) * kTileV + jj; };
  const auto row_ok = [&](int r) { return ig + kRowGroups * r < dk; };  // else past the slice
  const auto owned = [&](int r) { return row_ok(r) && j < dv; };

  float dS[kRows];
#pragma unroll
  for (int r = 0; r < kRows; ++r)
    dS[r] = d_final != nullptr && owned(r) ? d_final[h * SS + (ig + kRowGroups * r) * dv + j] : 0.0f;

  const int64_t chunks = (tokens + kC - 1) / kC;
  for (int64_t c = chunks - 1; c >= 0; --c) {
    const int64_t t0 = c * kC;
    const int n = static_cast<int>(min(static_cast<int64_t>(kC), tokens - t0));
    const int subs = (n + kSub - 1) / kSub;
    // The chunk's entry state, stepped forward to each sub-chunk's entry.
    float S[kRows];
    const float* entry = chunk_states + (c * heads + h) * SS;
#pragma unroll
    for (int r = 0; r < kRows; ++r) S[r] = owned(r) ? entry[(ig + kRowGroups * r) * dv + j] : 0.0f;
    for (int m = 0; m < (subs - 1) * kSub; ++m) {
      if (m % kSub == 0)
#pragma unroll
        for (int r = 0; r < kRows; ++r)
          if (row_ok(r)) entries[(m / kSub) * slice + own(r)] = S[r];
      forward_step(S, k, v, g, beta, (t0 + m) * heads + h, dk, dv, j, ig, next_scratch());
    }
#pragma unroll
    for (int r = 0; r < kRows; ++r)
      if (row_ok(r)) entries[(subs - 1) * slice + own(r)] = S[r];

    for (int sub = subs - 1; sub >= 0; --sub) {
      const int m0 = sub * kSub, ns = min(kSub, n - m0);
      // states[m] is the state before token m0 + m.
#pragma unroll
      for (int r = 0; r < kRows; ++r) {
        S[r] = row_ok(r) ? entries[sub * slice + own(r)] : 0.0f;
        if (row_ok(r)) states[own(r)] = S[r];
      }
      for (int m = 0; m < ns; ++m) {
        forward_step(S, k, v, g, beta, (t0 + m0 + m) * heads + h, dk, dv, j, ig, next_scratch());
#pragma unroll
        for (int r = 0; r < kRows; ++r)
          if (row_ok(r)) states[(m + 1) * slice + own(r)] = S[r];
      }
      for (int m = ns - 1; m >= 0; --m) {
        const int64_t row = (t0 + m0 + m) * heads + h;
        const float* prev = states + m * slice;
        const float* cur = prev + slice;
        const float vj = j < dv ? __bfloat162float(v[row * dv + j]) : 0.0f;
        const float doj = j < dv ? __bfloat162float(dout[row * dv + j]) : 0.0f;
        const float b = beta[row];
        float kk[kRows], ee[kRows], pa[kRows], cq[kRows];
        float2 part = make_float2(0.0f, 0.0f);
#pragma unroll
        for (int r = 0; r < kRows; ++r) {
          const int i = ig + kRowGroups * r;
          const float qi = i < dk ? __bfloat162float(q[row * dk + i]) : 0.0f;
          kk[r] = i < dk ? __bfloat162float(k[row * dk + i]) : 0.0f;
          ee[r] = i < dk ? expf(g[row * dk + i]) : 0.0f;
          pa[r] = i < dk ? ee[r] * prev[own(r)] : 0.0f;  // S_a = diag(exp g) S_{t-1}
          cq[r] = i < dk ? cur[own(r)] * doj : 0.0f;     // o = S_t^T q: dq = S_t do
          dS[r] = fmaf(qi, doj, dS[r]);                  // dS += q do^T
          part.x = fmaf(kk[r], pa[r], part.x);           // kv = S_a^T k
          part.y = fmaf(kk[r], dS[r], part.y);           // ddelta = dS^T k
        }
        const float2 total = column_sum(part, next_scratch());
        const float delta = b * (vj - total.x), dkv = -b * total.y;
        if (ig == 0 && j < dv) dv_out[row * dv + j] = b * total.y;
        // dk = dS delta + S_a dkv; dS += k dkv^T; dg = rowsum(dS o S_a); dS *= exp g.
        float* rows_k = rows + dk * (kTileV + 1);
        float* rows_g = rows_k + dk * (kTileV + 1);
#pragma unroll
        for (int r = 0; r < kRows; ++r) {
          const int i = ig + kRowGroups * r;
          float s = dS[r];
          const float ck = fmaf(s, delta, pa[r] * dkv);
          s = fmaf(kk[r], dkv, s);
          if (i < dk) {  // after column_sum's barrier: the previous token's row sums are read
            rows[i * (kTileV + 1) + jj] = cq[r];
            rows_k[i * (kTileV + 1) + jj] = ck;
            rows_g[i * (kTileV + 1) + jj] = s * pa[r];
          }
          dS[r] = s * ee[r];
        }
        if (tid < 32) {  // dbeta = sum_j ddelta_j (v_j - kv_j): lanes 0..15 hold one column each
          float red = j < dv ? total.y * (vj - total.x) : 0.0f;
          for (int offset = 8; offset > 0; offset >>= 1) red += __shfl_xor_sync(kFull, red, offset);
          if (lane == 0) atomicAdd(dbeta + row, red);
        }
        __syncthreads();
        if (tid < dk) {
          float sq = 0.0f, sk = 0.0f, sg = 0.0f;
          for (int x = 0; x < kTileV; ++x) {
            sq += rows[tid * (kTileV + 1) + x];
            sk += rows_k[tid * (kTileV + 1) + x];
            sg += rows_g[tid * (kTileV + 1) + x];
          }
          atomicAdd(dq + row * dk + tid, sq);
          atomicAdd(dk_out + row * dk + tid, sk);
          atomicAdd(dg + row * dk + tid, sg);
        }
        // The next token's first barrier (in column_sum) orders these reads before its writes.
      }
    }
  }
  if (d_initial != nullptr)
#pragma unroll
    for (int r = 0; r < kRows; ++r)
      if (owned(r)) d_initial[h * SS + (ig + kRowGroups * r) * dv + j] = dS[r];
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
                         cudaStream_t stream, const float* initial_state) {
  check_shape("kda_chunked_forward", tokens, heads, dk, dv);
  if (heads == 0) return;
  const size_t smem = forward_smem_bytes(static_cast<int>(dk)),
               mats_smem = matrices_smem_bytes(static_cast<int>(dk));
  SPINDLE_CUDA(cudaFuncSetAttribute(kda_forward_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                    static_cast<int>(smem)));
  SPINDLE_CUDA(cudaFuncSetAttribute(kda_chunk_matrices_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                    static_cast<int>(mats_smem)));
  const int64_t chunks = kda_chunks(tokens), SS = dk * dv;
  const dim3 grid(static_cast<unsigned>(heads), static_cast<unsigned>(value_tiles(dv)));
  int64_t c0 = 0;
  do {
    const int64_t c1 = std::min(chunks, c0 + kKdaSegmentChunks);
    if (c1 > c0) {
      const dim3 mats_grid(static_cast<unsigned>(c1 - c0), static_cast<unsigned>(heads));
      kda_chunk_matrices_kernel<<<mats_grid, kThreads, mats_smem, stream>>>(
          q, k, g, workspace, c0, tokens, static_cast<int>(heads), static_cast<int>(dk));
      SPINDLE_LAUNCHED("kda_chunk_matrices_kernel");
    }
    const float* initial = c0 == 0 ? initial_state : chunk_states + c0 * heads * SS;
    kda_forward_kernel<<<grid, kThreads, smem, stream>>>(q, k, v, g, beta, workspace, out, chunk_states,
                                                         initial, c0, c1, tokens, static_cast<int>(heads),
                                                         static_cast<int>(dk), static_cast<int>(dv));
    SPINDLE_LAUNCHED("kda_forward_kernel");
    c0 = c1;
  } while (c0 < chunks);
}

void kda_chunked_backward(const __nv_bfloat16* q, const __nv_bfloat16* k, const __nv_bfloat16* v,
                          const float* g, const float* beta, const __nv_bfloat16* dout,
                          const float* chunk_states, float* dq, float* dk_out, float* dv_out, float* dg,
                          float* dbeta, int64_t tokens, int64_t heads, int64_t dk, int64_t dv,
                          cudaStream_t stream, const float* d_final_state, float* d_initial_state) {
  check_shape("kda_chunked_backward", tokens, heads, dk, dv);
  if (heads == 0) return;
  // The value tiles add their partial sums into these.
  SPINDLE_CUDA(cudaMemsetAsync(dq, 0, static_cast<size_t>(tokens * heads * dk) * sizeof(float), stream));
  SPINDLE_CUDA(cudaMemsetAsync(dk_out, 0, static_cast<size_t>(tokens * heads * dk) * sizeof(float), stream));
  SPINDLE_CUDA(cudaMemsetAsync(dg, 0, static_cast<size_t>(tokens * heads * dk) * sizeof(float), stream));
  SPINDLE_CUDA(cudaMemsetAsync(dbeta, 0, static_cast<size_t>(tokens * heads) * sizeof(float), stream));
  const size_t smem = backward_smem_bytes(static_cast<int>(dk));
  SPINDLE_CUDA(cudaFuncSetAttribute(kda_backward_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                    static_cast<int>(smem)));
  const dim3 grid(static_cast<unsigned>(heads), static_cast<unsigned>(value_tiles(dv)));
  kda_backward_kernel<<<grid, kThreads, smem, stream>>>(
      q, k, v, g, beta, dout, chunk_states, d_final_state, d_initial_state, dq, dk_out, dv_out, dg, dbeta,
      tokens, static_cast<int>(heads), static_cast<int>(dk), static_cast<int>(dv));
  SPINDLE_LAUNCHED("kda_backward_kernel");
}

}  // namespace spindle::cuda
