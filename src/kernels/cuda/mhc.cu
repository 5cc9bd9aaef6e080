// mHC hyper-connections: one block of 256 threads per token (the coefficients, the collapse,
// hc_combine and both backward passes), H a template parameter so per-thread partial sums stay in
// registers. The tiny per-token work (softmax, 2 iters - 1 Sinkhorn passes and their backward)
// runs on warp 0, lane a owning row or column a, in shared memory.
//
// The mix projection normed[tokens, H D] x fn^T [H D, (2 + H) H] is a thin GEMM written here as a
// per-token block reduction: correct and simple, but each token re-reads all of fn (from L2),
// (2 + H) H fp32 values per stream element. Candidate for a tensor-core path later (several
// tokens per block, or a bf16 wgmma over a token tile with fn staged in shared memory); the
// same holds for dfn = dm^T normed, done here by hc_dfn_kernel over token chunks.
#include "backend/cuda/check.h"
#include "core/error.h"
#include "kernels/cuda/mhc.h"

namespace spindle::cuda {

namespace {

constexpr int kThreads = 256;
constexpr int kWarps = kThreads / 32;
constexpr int kMaxStreams = 8;
constexpr int kTokenChunk = 64;  // tokens per block of hc_dfn_kernel: one atomic per fn entry per chunk

__device__ __forceinline__ float sigmoid(float a) { return 1.0f / (1.0f + expf(-a)); }

// Index of the scale (0 pre, 1 post, 2 comb) that mix output o is multiplied by.
template <int H>
__device__ __forceinline__ int group_of(int o) {
  return o < H ? 0 : (o < 2 * H ? 1 : 2);
}

// Sums each of N per-thread values over the block into out[N] (shared), visible to all threads
// on return. scratch holds kWarps * N floats.
template <int N>
__device__ void block_sums(const float (&v)[N], float* scratch, float* out) {
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
#pragma unroll
  for (int k = 0; k < N; ++k) {
    float s = v[k];
    for (int offset = 16; offset > 0; offset /= 2) s += __shfl_xor_sync(0xffffffffu, s, offset);
    if (lane == 0) scratch[warp * N + k] = s;
  }
  __syncthreads();
  for (int k = threadIdx.x; k < N; k += kThreads) {
    float s = 0.0f;
    for (int w = 0; w < kWarps; ++w) s += scratch[w * N + k];
    out[k] = s;
  }
  __syncthreads();
}

// First pass over one token's streams x [H, D]: raw[o] = sum_i x[i] fn[o, i] (the mix before the
// RMS factor), the sum of squares, and with d_collapsed the dots dpre[h] = sum_d dcol[d] x[h, d].
// Results in red: raw [M], sum of squares [1], dpre [H] (backward only).
template <int H, bool kBackward>
__device__ void mix_pass(const __nv_bfloat16* x, const float* fn, const __nv_bfloat16* dcol, int64_t D,
                         float* scratch, float* red) {
  constexpr int M = (2 + H) * H;
  constexpr int N = M + 1 + (kBackward ? H : 0);
  const int64_t flat = H * D;
  float v[N];
#pragma unroll
  for (int k = 0; k < N; ++k) v[k] = 0.0f;
#pragma unroll
  for (int h = 0; h < H; ++h) {
    for (int64_t d = threadIdx.x; d < D; d += kThreads) {
      const int64_t i = h * D + d;
      const float xv = __bfloat162float(x[i]);
      v[M] = fmaf(xv, xv, v[M]);
#pragma unroll
      for (int o = 0; o < M; ++o) v[o] = fmaf(xv, __ldg(fn + o * flat + i), v[o]);
      if constexpr (kBackward) v[M + 1 + h] = fmaf(xv, __bfloat162float(dcol[d]), v[M + 1 + h]);
    }
  }
  block_sums<N>(v, scratch, red);
}

// Row softmax of the comb logits plus eps, into c [H, H]; warp 0, lane i owns row i. Also keeps
// the softmax itself in p when given.
template <int H>
__device__ void comb_softmax(const float* m, const float* base, float scale2, float eps, float* c, float* p) {
  const int i = threadIdx.x;
  if (i < H) {
    float row[H];
    float mx = -INFINITY;
#pragma unroll
    for (int j = 0; j < H; ++j) {
      row[j] = m[2 * H + i * H + j] * scale2 + base[2 * H + i * H + j];
      mx = fmaxf(mx, row[j]);
    }
    float z = 0.0f;
#pragma unroll
    for (int j = 0; j < H; ++j) z += (row[j] = expf(row[j] - mx));
#pragma unroll
    for (int j = 0; j < H; ++j) {
      const float q = row[j] / z;
      if (p != nullptr) p[i * H + j] = q;
      c[i * H + j] = q + eps;
    }
  }
  __syncwarp();
}

// One Sinkhorn pass from c into next (may alias c): along columns (k even) or rows; lane a owns
// column or row a. Stores sum + eps per lane in sums when given.
template <int H>
__device__ void sinkhorn_pass(bool columns, const float* c, float* next, float eps, float* sums) {
  const int a = threadIdx.x;
  if (a < H) {
    float sum = 0.0f;
#pragma unroll
    for (int b = 0; b < H; ++b) sum += columns ? c[b * H + a] : c[a * H + b];
    const float S = sum + eps;
    if (sums != nullptr) sums[a] = S;
#pragma unroll
    for (int b = 0; b < H; ++b) {
      const int idx = columns ? b * H + a : a * H + b;
      next[idx] = c[idx] / S;
    }
  }
  __syncwarp();
}

template <int H>
__global__ void __launch_bounds__(kThreads, 1)
    hc_coefficients_kernel(const __nv_bfloat16* streams, const float* fn, const float* base,
                           const float* scale, float* pre, float* post, float* comb, __nv_bfloat16* collapsed,
                           int64_t D, float rms_eps, float hc_eps, int iters) {
  constexpr int M = (2 + H) * H;
  __shared__ float scratch[kWarps * (M + 1)], red[M + 1], m[M], c[H * H], pre_s[H];
  const int64_t t = blockIdx.x, flat = H * D;
  const __nv_bfloat16* x = streams + t * flat;
  mix_pass<H, false>(x, fn, nullptr, D, scratch, red);
  const float inv = rsqrtf(red[M] / static_cast<float>(flat) + rms_eps);
  if (threadIdx.x < M) m[threadIdx.x] = red[threadIdx.x] * inv;
  __syncthreads();
  if (threadIdx.x < 32) {
    const int h = threadIdx.x;
    if (h < H) {
      pre_s[h] = sigmoid(m[h] * scale[0] + base[h]) + hc_eps;
      pre[t * H + h] = pre_s[h];
      post[t * H + h] = 2.0f * sigmoid(m[H + h] * scale[1] + base[H + h]);
    }
    // Sinkhorn as transformers writes it: one column pass, then (iters - 1) row + column passes.
    comb_softmax<H>(m, base, scale[2], hc_eps, c, nullptr);
    sinkhorn_pass<H>(true, c, c, hc_eps, nullptr);
    for (int it = 0; it + 1 < iters; ++it) {
      sinkhorn_pass<H>(false, c, c, hc_eps, nullptr);
      sinkhorn_pass<H>(true, c, c, hc_eps, nullptr);
    }
    for (int k = threadIdx.x; k < H * H; k += 32) comb[t * H * H + k] = c[k];
  }
  __syncthreads();
  float p[H];
#pragma unroll
  for (int h = 0; h < H; ++h) p[h] = pre_s[h];
  for (int64_t d = threadIdx.x; d < D; d += kThreads) {
    float acc = 0.0f;
#pragma unroll
    for (int h = 0; h < H; ++h) acc = fmaf(p[h], __bfloat162float(x[h * D + d]), acc);
    collapsed[t * D + d] = __float2bfloat16(acc);
  }
}

template <int H>
__global__ void __launch_bounds__(kThreads)
    hc_combine_kernel(const __nv_bfloat16* streams, const __nv_bfloat16* y, const float* post,
                      const float* comb, __nv_bfloat16* out, int64_t D) {
  const int64_t t = blockIdx.x;
  float po[H], cm[H][H];
#pragma unroll
  for (int h = 0; h < H; ++h) {
    po[h] = post[t * H + h];
#pragma unroll
    for (int j = 0; j < H; ++j) cm[j][h] = comb[t * H * H + j * H + h];
  }
  const __nv_bfloat16* x = streams + t * H * D;
  for (int64_t d = threadIdx.x; d < D; d += kThreads) {
    float xv[H];
#pragma unroll
    for (int j = 0; j < H; ++j) xv[j] = __bfloat162float(x[j * D + d]);
    const float yv = __bfloat162float(y[t * D + d]);
#pragma unroll
    for (int h = 0; h < H; ++h) {
      float acc = po[h] * yv;
#pragma unroll
      for (int j = 0; j < H; ++j) acc = fmaf(cm[j][h], xv[j], acc);
      out[(t * H + h) * D + d] = __float2bfloat16(acc);
    }
  }
}

template <int H>
__global__ void __launch_bounds__(kThreads)
    hc_combine_backward_kernel(const __nv_bfloat16* streams, const __nv_bfloat16* y, const float* post,
                               const float* comb, const float* dout, float* dstreams, __nv_bfloat16* dy,
                               float* d_post, float* d_comb, int64_t D) {
  constexpr int N = H + H * H;  // d_post [H], then d_comb [j * H + h]
  __shared__ float scratch[kWarps * N], red[N];
  const int64_t t = blockIdx.x;
  float po[H], cm[H][H], v[N];
#pragma unroll
  for (int h = 0; h < H; ++h) {
    po[h] = post[t * H + h];
#pragma unroll
    for (int j = 0; j < H; ++j) cm[j][h] = comb[t * H * H + j * H + h];
  }
#pragma unroll
  for (int k = 0; k < N; ++k) v[k] = 0.0f;
  const __nv_bfloat16* x = streams + t * H * D;
  const float* g = dout + t * H * D;
  float* dx = dstreams + t * H * D;
  for (int64_t d = threadIdx.x; d < D; d += kThreads) {
    float xv[H], gv[H];
#pragma unroll
    for (int h = 0; h < H; ++h) {
      xv[h] = __bfloat162float(x[h * D + d]);
      gv[h] = g[h * D + d];
    }
    const float yv = __bfloat162float(y[t * D + d]);
    float dyv = 0.0f;
#pragma unroll
    for (int h = 0; h < H; ++h) {
      dyv = fmaf(po[h], gv[h], dyv);
      v[h] = fmaf(gv[h], yv, v[h]);
    }
    dy[t * D + d] = __float2bfloat16(dyv);
#pragma unroll
    for (int j = 0; j < H; ++j) {
      float acc = dx[j * D + d];
#pragma unroll
      for (int h = 0; h < H; ++h) {
        acc = fmaf(cm[j][h], gv[h], acc);
        v[H + j * H + h] = fmaf(gv[h], xv[j], v[H + j * H + h]);
      }
      dx[j * D + d] = acc;
    }
  }
  block_sums<N>(v, scratch, red);
  for (int k = threadIdx.x; k < N; k += kThreads) {
    if (k < H)
      d_post[t * H + k] = red[k];
    else
      d_comb[t * H * H + (k - H)] = red[k];
  }
}

// Per token: recomputes the mix and the Sinkhorn stages, back-propagates d_pre/d_post/d_comb (and
// the collapse) to the mix gradient dm, accumulates dstreams (collapse + RMS-norm path), and
// leaves g (gradient before the scale), m and the RMS factor in the workspace row
// [g (M), m (M), inv] for hc_dfn_kernel.
template <int H>
__global__ void __launch_bounds__(kThreads)
    hc_coefficients_backward_kernel(const __nv_bfloat16* streams, const float* fn, const float* base,
                                    const float* scale, const float* d_pre, const float* d_post,
                                    const float* d_comb, const __nv_bfloat16* d_collapsed, float* dstreams,
                                    float* workspace, int64_t D, float rms_eps, float hc_eps, int iters) {
  constexpr int M = (2 + H) * H, HH = H * H;
  constexpr int N = M + 1 + H;
  __shared__ float scratch[kWarps * N], red[N], m[M], g[M], dm[M], pre_s[H], p[HH], dc[HH];
  extern __shared__ float dynamic[];  // stages [(passes + 1) HH], then sums [passes H]
  const int passes = 2 * iters - 1;
  float* stages = dynamic;
  float* sums = dynamic + (passes + 1) * HH;
  const int64_t t = blockIdx.x, flat = H * D;
  const __nv_bfloat16* x = streams + t * flat;
  const __nv_bfloat16* dcol = d_collapsed + t * D;
  mix_pass<H, true>(x, fn, dcol, D, scratch, red);
  const float inv = rsqrtf(red[M] / static_cast<float>(flat) + rms_eps);
  if (threadIdx.x < M) m[threadIdx.x] = red[threadIdx.x] * inv;
  __syncthreads();
  if (threadIdx.x < 32) {
    const int lane = threadIdx.x;
    // Forward again, keeping each stage and each pass's sums.
    comb_softmax<H>(m, base, scale[2], hc_eps, stages, p);
    for (int k = 0; k < passes; ++k)
      sinkhorn_pass<H>(k % 2 == 0, stages + k * HH, stages + (k + 1) * HH, hc_eps, sums + k * H);
    for (int k = lane; k < HH; k += 32) dc[k] = d_comb[t * HH + k];
    __syncwarp();
    // Back through the passes: c' = c / (S + eps) along rows or columns.
    for (int k = passes - 1; k >= 0; --k) {
      const bool columns = k % 2 == 0;
      const float* c = stages + k * HH;
      if (lane < H) {
        const float S = sums[k * H + lane];
        float dot = 0.0f;
#pragma unroll
        for (int b = 0; b < H; ++b) {
          const int idx = columns ? b * H + lane : lane * H + b;
          dot = fmaf(dc[idx], c[idx], dot);
        }
#pragma unroll
        for (int b = 0; b < H; ++b) {
          const int idx = columns ? b * H + lane : lane * H + b;
          dc[idx] = dc[idx] / S - dot / (S * S);
        }
      }
      __syncwarp();
    }
    if (lane < H) {
      // Row softmax backward.
      const int i = lane;
      float dot = 0.0f;
#pragma unroll
      for (int j = 0; j < H; ++j) dot = fmaf(p[i * H + j], dc[i * H + j], dot);
#pragma unroll
      for (int j = 0; j < H; ++j) g[2 * H + i * H + j] = p[i * H + j] * (dc[i * H + j] - dot);
      // pre (which also feeds the collapse) and post.
      const int h = lane;
      const float dpre = (d_pre != nullptr ? d_pre[t * H + h] : 0.0f) + red[M + 1 + h];
      const float sp = sigmoid(m[h] * scale[0] + base[h]);
      g[h] = dpre * sp * (1.0f - sp);
      pre_s[h] = sp + hc_eps;
      const float so = sigmoid(m[H + h] * scale[1] + base[H + h]);
      g[H + h] = d_post[t * H + h] * 2.0f * so * (1.0f - so);
    }
  }
  __syncthreads();
  float* row = workspace + t * (2 * M + 1);
  if (threadIdx.x < M) {
    const int o = threadIdx.x;
    dm[o] = g[o] * scale[group_of<H>(o)];
    row[o] = g[o];
    row[M + o] = m[o];
  }
  if (threadIdx.x == 0) row[2 * M] = inv;
  __syncthreads();
  // RMS-norm backward: dx = inv dn - x inv^3 (dn . x) / flat with dn = dm fn, and dn . x = dm . raw.
  float dot = 0.0f;
#pragma unroll
  for (int o = 0; o < M; ++o) dot = fmaf(dm[o], red[o], dot);
  const float corr = inv * inv * inv * dot / static_cast<float>(flat);
  float dmr[M];
#pragma unroll
  for (int o = 0; o < M; ++o) dmr[o] = dm[o];
  float* dx = dstreams + t * flat;
#pragma unroll
  for (int h = 0; h < H; ++h) {
    const float ph = pre_s[h];
    for (int64_t d = threadIdx.x; d < D; d += kThreads) {
      const int64_t i = h * D + d;
      float dn = 0.0f;
#pragma unroll
      for (int o = 0; o < M; ++o) dn = fmaf(dmr[o], __ldg(fn + o * flat + i), dn);
      const float xv = __bfloat162float(x[i]);
      dx[i] += inv * dn - xv * corr + ph * __bfloat162float(dcol[d]);
    }
  }
}

// dfn[o, i] += sum_t dm[t, o] x[t, i] inv[t] over a chunk of tokens per block (one atomic per fn
// entry per chunk); the first column of blocks also reduces dbase and dscale over its chunk.
template <int H>
__global__ void __launch_bounds__(kThreads)
    hc_dfn_kernel(const __nv_bfloat16* streams, const float* scale, const float* workspace, float* dfn,
                  float* dbase, float* dscale, int64_t tokens, int64_t D) {
  constexpr int M = (2 + H) * H;
  __shared__ float dm[kTokenChunk * M], inv[kTokenChunk];
  const int64_t flat = H * D, t0 = static_cast<int64_t>(blockIdx.y) * kTokenChunk;
  const int nt = static_cast<int>(tokens - t0 < kTokenChunk ? tokens - t0 : kTokenChunk);
  const float s0 = scale[0], s1 = scale[1], s2 = scale[2];
  for (int e = threadIdx.x; e < nt * M; e += kThreads) {
    const int tt = e / M, o = e % M;
    const float gs = o < H ? s0 : (o < 2 * H ? s1 : s2);
    dm[e] = workspace[(t0 + tt) * (2 * M + 1) + o] * gs;
  }
  for (int tt = threadIdx.x; tt < nt; tt += kThreads) inv[tt] = workspace[(t0 + tt) * (2 * M + 1) + 2 * M];
  __syncthreads();
  if (blockIdx.x == 0 && threadIdx.x < M) {
    const int o = threadIdx.x;
    float gb = 0.0f, gsc = 0.0f;
    for (int tt = 0; tt < nt; ++tt) {
      const float* row = workspace + (t0 + tt) * (2 * M + 1);
      gb += row[o];
      gsc = fmaf(row[o], row[M + o], gsc);
    }
    atomicAdd(dbase + o, gb);
    atomicAdd(dscale + group_of<H>(o), gsc);
  }
  const int64_t i = static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x;
  if (i >= flat) return;
  float acc[M];
#pragma unroll
  for (int o = 0; o < M; ++o) acc[o] = 0.0f;
  for (int tt = 0; tt < nt; ++tt) {
    const float v = __bfloat162float(streams[(t0 + tt) * flat + i]) * inv[tt];
#pragma unroll
    for (int o = 0; o < M; ++o) acc[o] = fmaf(dm[tt * M + o], v, acc[o]);
  }
#pragma unroll
  for (int o = 0; o < M; ++o) atomicAdd(dfn + o * flat + i, acc[o]);
}

void check_shape(const cpu::HcShape& s, const char* what) {
  check(s.streams >= 1 && s.streams <= kMaxStreams, what, ": hc_mult ", s.streams, " (expected 1 to ",
        kMaxStreams, ")");
  check(s.tokens >= 0 && s.tokens <= 0x7fffffff, what, ": ", s.tokens, " tokens is too many for one launch");
  check(s.hidden >= 1, what, ": hidden size ", s.hidden, " (expected at least 1)");
  check(s.sinkhorn_iters >= 1 && s.sinkhorn_iters <= 1000, what, ": sinkhorn_iters ", s.sinkhorn_iters,
        " (expected 1 to 1000)");
}

}  // namespace

// Runs BODY with a compile-time H equal to s.streams (checked to be 1 to 8).
#define SPINDLE_HC_DISPATCH(...) \
  switch (s.streams) {           \
    case 1: {                    \
      constexpr int H = 1;       \
      __VA_ARGS__;               \
    } break;                     \
    case 2: {                    \
      constexpr int H = 2;       \
      __VA_ARGS__;               \
    } break;                     \
    case 3: {                    \
      constexpr int H = 3;       \
      __VA_ARGS__;               \
    } break;                     \
    case 4: {                    \
      constexpr int H = 4;       \
      __VA_ARGS__;               \
    } break;                     \
    case 5: {                    \
      constexpr int H = 5;       \
      __VA_ARGS__;               \
    } break;                     \
    case 6: {                    \
      constexpr int H = 6;       \
      __VA_ARGS__;               \
    } break;                     \
    case 7: {                    \
      constexpr int H = 7;       \
      __VA_ARGS__;               \
    } break;                     \
    default: {                   \
      constexpr int H = 8;       \
      __VA_ARGS__;               \
    } break;                     \
  }

void hc_coefficients(const cpu::HcShape& s, const __nv_bfloat16* streams, const float* fn, const float* base,
                     const float* scale, float* pre, float* post, float* comb, __nv_bfloat16* collapsed,
                     cudaStream_t stream) {
  check_shape(s, "hc_coefficients");
  if (s.tokens == 0) return;
  const auto blocks = static_cast<unsigned>(s.tokens);
  const float rms_eps = static_cast<float>(s.rms_eps), hc_eps = static_cast<float>(s.hc_eps);
  const int iters = static_cast<int>(s.sinkhorn_iters);
  SPINDLE_HC_DISPATCH(hc_coefficients_kernel<H><<<blocks, kThreads, 0, stream>>>(
      streams, fn, base, scale, pre, post, comb, collapsed, s.hidden, rms_eps, hc_eps, iters))
  SPINDLE_LAUNCHED("hc_coefficients_kernel");
}

void hc_combine(const cpu::HcShape& s, const __nv_bfloat16* streams, const __nv_bfloat16* y,
                const float* post, const float* comb, __nv_bfloat16* out, cudaStream_t stream) {
  check_shape(s, "hc_combine");
  if (s.tokens == 0) return;
  const auto blocks = static_cast<unsigned>(s.tokens);
  SPINDLE_HC_DISPATCH(hc_combine_kernel<H>
                      <<<blocks, kThreads, 0, stream>>>(streams, y, post, comb, out, s.hidden))
  SPINDLE_LAUNCHED("hc_combine_kernel");
}

void hc_combine_backward(const cpu::HcShape& s, const __nv_bfloat16* streams, const __nv_bfloat16* y,
                         const float* post, const float* comb, const float* dout, float* dstreams,
                         __nv_bfloat16* dy, float* d_post, float* d_comb, cudaStream_t stream) {
  check_shape(s, "hc_combine_backward");
  if (s.tokens == 0) return;
  const auto blocks = static_cast<unsigned>(s.tokens);
  SPINDLE_HC_DISPATCH(hc_combine_backward_kernel<H><<<blocks, kThreads, 0, stream>>>(
      streams, y, post, comb, dout, dstreams, dy, d_post, d_comb, s.hidden))
  SPINDLE_LAUNCHED("hc_combine_backward_kernel");
}

int64_t hc_coefficients_backward_workspace(const cpu::HcShape& s) {
  return s.tokens * (2 * (2 + s.streams) * s.streams + 1);
}

void hc_coefficients_backward(const cpu::HcShape& s, const __nv_bfloat16* streams, const float* fn,
                              const float* base, const float* scale, const float* d_pre, const float* d_post,
                              const float* d_comb, const __nv_bfloat16* d_collapsed, float* dstreams,
                              float* dfn, float* dbase, float* dscale, float* workspace,
                              cudaStream_t stream) {
  check_shape(s, "hc_coefficients_backward");
  if (s.tokens == 0) return;
  const auto blocks = static_cast<unsigned>(s.tokens);
  const float rms_eps = static_cast<float>(s.rms_eps), hc_eps = static_cast<float>(s.hc_eps);
  const int iters = static_cast<int>(s.sinkhorn_iters), passes = 2 * iters - 1;
  const int64_t HH = s.streams * s.streams;
  const size_t dynamic = static_cast<size_t>(((passes + 1) * HH + passes * s.streams)) * sizeof(float);
  check(dynamic <= 48 * 1024, "hc_coefficients_backward: ", iters, " Sinkhorn iterations at hc_mult ",
        s.streams, " need ", dynamic, " bytes of shared memory (at most 48 KiB)");
  const int64_t flat = s.streams * s.hidden;
  const dim3 dfn_grid(static_cast<unsigned>((flat + kThreads - 1) / kThreads),
                      static_cast<unsigned>((s.tokens + kTokenChunk - 1) / kTokenChunk));
  SPINDLE_HC_DISPATCH({
    hc_coefficients_backward_kernel<H>
        <<<blocks, kThreads, dynamic, stream>>>(streams, fn, base, scale, d_pre, d_post, d_comb, d_collapsed,
                                                dstreams, workspace, s.hidden, rms_eps, hc_eps, iters);
    SPINDLE_LAUNCHED("hc_coefficients_backward_kernel");
    hc_dfn_kernel<H><<<dfn_grid, kThreads, 0, stream>>>(streams, scale, workspace, dfn, dbase, dscale,
                                                        s.tokens, s.hidden);
    SPINDLE_LAUNCHED("hc_dfn_kernel");
  })
}

#undef SPINDLE_HC_DISPATCH

}  // namespace spindle::cuda
