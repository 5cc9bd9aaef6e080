// mHC hyper-connections. The coefficient kernels (forward and backward) take a tile of 64 tokens
// per block of 256 threads, H a template parameter:
//   1. the mix raw = x [tokens, H D] fn^T [H D, (2 + H) H] and each token's sum of squares, a thin
//      fp32 GEMM over slices of H D staged in shared memory (each fn slice is read once per tile,
//      not once per token from L2, which made the per-token kernels 10x slower);
//   2. the tiny per-token work (softmax, 2 iters - 1 Sinkhorn passes and their backward), one warp
//      per token, lane a owning row or column a;
//   3. the collapse (forward) or the streams' gradient dn = dm fn (backward), fn held in
//      registers per column while the tile's tokens go by.
// hc_combine and its backward take one warp per token (memory bound); dfn = dm^T normed sums
// 1024-token chunks per block (one atomic per fn entry per chunk).
#include <algorithm>
#include <cstdint>
#include <initializer_list>

#include "backend/cuda/check.h"
#include "core/error.h"
#include "kernels/cuda/memory_bound.cuh"
#include "kernels/cuda/mhc.h"
#include "kernels/cuda/mma.cuh"

namespace spindle::cuda {

namespace {

constexpr int kThreads = 256;
constexpr int kWarps = kThreads / 32;
constexpr int kMaxStreams = 8;
constexpr int kTileTokens = 64;                  // tokens per block of the coefficient kernels
constexpr int kGroups = kThreads / kTileTokens;  // mix outputs split in 4 groups, a warp pair each
constexpr int kSlice = 64;                       // mix reduction slice staged in shared memory
constexpr int kXStride = kSlice + 8;    // bf16; rows 16-byte aligned, 16-byte reads by 8 rows hit 32 banks
constexpr int kTokenChunk = 64;         // tokens of dm staged at once by hc_dfn_kernel
constexpr int kChunksPerDfnBlock = 16;  // 1024 tokens per hc_dfn_kernel block
constexpr size_t kMaxDynamicShared = 160 * 1024;  // the backward's Sinkhorn stages share this

__device__ __forceinline__ float sigmoid(float a) { return 1.0f / (1.0f + expf(-a)); }

// Index of the scale (0 pre, 1 post, 2 comb) that mix output o is multiplied by.
template <int H>
__device__ __forceinline__ int group_of(int o) {
  return o < H ? 0 : (o < 2 * H ? 1 : 2);
}

__device__ __forceinline__ float warp_sum(float v) {
  for (int offset = 16; offset > 0; offset /= 2) v += __shfl_xor_sync(0xffffffffu, v, offset);
  return v;
}

// Shared-memory layout of the coefficient kernels for H streams.
template <int H>
struct Tile {
  static constexpr int M = (2 + H) * H;                  // mix outputs
  static constexpr int P = (M + kGroups - 1) / kGroups;  // mix outputs per thread
  static constexpr int MP = (M + 3) / 4 * 4;             // dm row stride (float4 reads)
  static constexpr int HH = H * H;
  static constexpr size_t kXBytes = kTileTokens * kXStride * sizeof(__nv_bfloat16);
  static constexpr size_t kSliceBytes = kXBytes + kGroups * P * kSlice * sizeof(float);
  // Two slices (double-buffered), then raw [64, M + 1] (sum of squares last), pre [64, H], then
  // per-kernel data.
  static constexpr size_t kRawOffset = 2 * kSliceBytes;
  static constexpr size_t kPreOffset = kRawOffset + kTileTokens * (M + 1) * sizeof(float);
  static constexpr size_t kCommonBytes = kPreOffset + kTileTokens * H * sizeof(float);
  static_assert(kTileTokens * MP * sizeof(float) <= kRawOffset, "dm must fit where the slices were");
  static_assert(kXBytes % 16 == 0 && kSliceBytes % 16 == 0, "slices must be 16-byte aligned");
};

// Stages slice [k0, k0 + kSlice) of x [count, K] and fn [M, K] into buf (zeros past the ends).
// `vec` (D % 8 == 0, 16-byte aligned pointers): by cp.async, to be waited for; else plain loads.
template <int H>
__device__ void stage_slice(const __nv_bfloat16* x, int count, const float* fn, int K, int k0, bool vec,
                            unsigned char* buf) {
  using T = Tile<H>;
  __nv_bfloat16* xs = reinterpret_cast<__nv_bfloat16*>(buf);
  float* fs = reinterpret_cast<float*>(buf + T::kXBytes);
  if (vec) {
    for (int e = threadIdx.x; e < kTileTokens * kSlice / 8; e += kThreads) {
      const int tt = e / (kSlice / 8), kk = e % (kSlice / 8) * 8, k = k0 + kk;
      const bool valid = tt < count && k < K;
      copy16(xs + tt * kXStride + kk, valid ? x + static_cast<int64_t>(tt) * K + k : x, valid);
    }
    for (int e = threadIdx.x; e < kGroups * T::P * kSlice / 4; e += kThreads) {
      const int o = e / (kSlice / 4), kk = e % (kSlice / 4) * 4, k = k0 + kk;
      const bool valid = o < T::M && k < K;
      copy16(fs + o * kSlice + kk, valid ? fn + static_cast<int64_t>(o) * K + k : fn, valid);
    }
    copy_commit();
    return;
  }
  for (int e = threadIdx.x; e < kTileTokens * kSlice; e += kThreads) {
    const int tt = e / kSlice, kk = e % kSlice, k = k0 + kk;
    xs[tt * kXStride + kk] =
        tt < count && k < K ? x[static_cast<int64_t>(tt) * K + k] : __float2bfloat16(0.0f);
  }
  for (int e = threadIdx.x; e < kGroups * T::P * kSlice; e += kThreads) {
    const int o = e / kSlice, kk = e % kSlice, k = k0 + kk;
    fs[e] = o < T::M && k < K ? __ldg(fn + static_cast<int64_t>(o) * K + k) : 0.0f;
  }
}

// Mix of one tile: raw[tt, o] = sum_i x[tt, i] fn[o, i] for o < M, raw[tt, M] = sum_i x[tt, i]^2,
// for the tile's `count` tokens x [count, K], slice by slice, the next slice arriving (cp.async)
// while this one is summed. Warp w computes output group w / 2 for tokens (w % 2) 32 + lane.
template <int H>
__device__ void mix_tile(const __nv_bfloat16* x, int count, const float* fn, int K, bool vec,
                         unsigned char* smem) {
  using T = Tile<H>;
  float* raw = reinterpret_cast<float*>(smem + T::kRawOffset);
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int group = warp / 2, token = (warp % 2) * 32 + lane;
  float acc[T::P], sq = 0.0f;
#pragma unroll
  for (int p = 0; p < T::P; ++p) acc[p] = 0.0f;
  stage_slice<H>(x, count, fn, K, 0, vec, smem);
  for (int k0 = 0, slot = 0; k0 < K; k0 += kSlice, slot ^= 1) {
    if (k0 + kSlice < K) {
      stage_slice<H>(x, count, fn, K, k0 + kSlice, vec, smem + (slot ^ 1) * T::kSliceBytes);
      if (vec) copy_wait_all_but_newest();
    } else if (vec) {
      copy_wait_all();
    }
    __syncthreads();
    const unsigned char* buf = smem + slot * T::kSliceBytes;
    const __nv_bfloat16* xr = reinterpret_cast<const __nv_bfloat16*>(buf) + token * kXStride;
    const float* fr = reinterpret_cast<const float*>(buf + T::kXBytes) + group * T::P * kSlice;
#pragma unroll 2
    for (int kk = 0; kk < kSlice; kk += 8) {
      float xv[8];
      load<8>(xr + kk, xv);
      if (group == 0) {
#pragma unroll
        for (int j = 0; j < 8; ++j) sq = fmaf(xv[j], xv[j], sq);
      }
#pragma unroll
      for (int p = 0; p < T::P; ++p) {
        const float4 f0 = *reinterpret_cast<const float4*>(fr + p * kSlice + kk);
        const float4 f1 = *reinterpret_cast<const float4*>(fr + p * kSlice + kk + 4);
        acc[p] = fmaf(xv[0], f0.x, fmaf(xv[1], f0.y, fmaf(xv[2], f0.z, fmaf(xv[3], f0.w, acc[p]))));
        acc[p] = fmaf(xv[4], f1.x, fmaf(xv[5], f1.y, fmaf(xv[6], f1.z, fmaf(xv[7], f1.w, acc[p]))));
      }
    }
    __syncthreads();  // this slot is staged again two slices on
  }
  if (token < count) {
#pragma unroll
    for (int p = 0; p < T::P; ++p) {
      const int o = group * T::P + p;
      if (o < T::M) raw[token * (T::M + 1) + o] = acc[p];
    }
    if (group == 0) raw[token * (T::M + 1) + T::M] = sq;
  }
  __syncthreads();
}

// Row softmax of the comb logits plus eps, into c [H, H]; lane i of the calling warp owns row i.
// Also keeps the softmax itself in p when given.
template <int H>
__device__ void comb_softmax(int lane, const float* m, const float* base, float scale2, float eps, float* c,
                             float* p) {
  const int i = lane;
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

// One Sinkhorn pass from c into next (may alias c): along columns or rows; lane a of the calling
// warp owns column or row a. Stores sum + eps per lane in sums when given.
template <int H>
__device__ void sinkhorn_pass(int lane, bool columns, const float* c, float* next, float eps, float* sums) {
  const int a = lane;
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
                           int64_t tokens, int D, float rms_eps, float hc_eps, int iters, bool vec) {
  using T = Tile<H>;
  constexpr int M = T::M, HH = T::HH;
  extern __shared__ float4 shared_words[];
  unsigned char* smem = reinterpret_cast<unsigned char*>(shared_words);
  const float* raw = reinterpret_cast<const float*>(smem + T::kRawOffset);
  float* pre_s = reinterpret_cast<float*>(smem + T::kPreOffset);
  float* scratch = reinterpret_cast<float*>(smem + T::kCommonBytes);  // per warp: m [M], c [HH]
  const int64_t t0 = static_cast<int64_t>(blockIdx.x) * kTileTokens;
  const int count = static_cast<int>(tokens - t0 < kTileTokens ? tokens - t0 : kTileTokens);
  const int K = H * D;
  const __nv_bfloat16* x = streams + t0 * K;
  mix_tile<H>(x, count, fn, K, vec, smem);

  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  float* m = scratch + warp * (M + HH);
  float* c = m + M;
  for (int tt = warp; tt < count; tt += kWarps) {
    const float* r = raw + tt * (M + 1);
    const float inv = rsqrtf(r[M] / static_cast<float>(K) + rms_eps);
    for (int o = lane; o < M; o += 32) m[o] = r[o] * inv;
    __syncwarp();
    const int64_t t = t0 + tt;
    if (lane < H) {
      const int h = lane;
      pre_s[tt * H + h] = sigmoid(m[h] * scale[0] + base[h]) + hc_eps;
      pre[t * H + h] = pre_s[tt * H + h];
      post[t * H + h] = 2.0f * sigmoid(m[H + h] * scale[1] + base[H + h]);
    }
    // Sinkhorn as transformers writes it: one column pass, then (iters - 1) row + column passes.
    comb_softmax<H>(lane, m, base, scale[2], hc_eps, c, nullptr);
    sinkhorn_pass<H>(lane, true, c, c, hc_eps, nullptr);
    for (int it = 0; it + 1 < iters; ++it) {
      sinkhorn_pass<H>(lane, false, c, c, hc_eps, nullptr);
      sinkhorn_pass<H>(lane, true, c, c, hc_eps, nullptr);
    }
    for (int k = lane; k < HH; k += 32) comb[t * HH + k] = c[k];
    __syncwarp();
  }
  __syncthreads();
  if (vec) {
    const int per_token = D / 8;
    for (int e = threadIdx.x; e < count * per_token; e += kThreads) {
      const int tt = e / per_token, d = e % per_token * 8;
      float acc[8] = {}, v[8];
#pragma unroll
      for (int h = 0; h < H; ++h) {
        load<8>(x + static_cast<int64_t>(tt) * K + h * D + d, v);
        const float ph = pre_s[tt * H + h];
#pragma unroll
        for (int j = 0; j < 8; ++j) acc[j] = fmaf(ph, v[j], acc[j]);
      }
      store<8>(collapsed + (t0 + tt) * D + d, acc);
    }
    return;
  }
  for (int e = threadIdx.x; e < count * D; e += kThreads) {
    const int tt = e / D, d = e % D;
    float acc = 0.0f;
#pragma unroll
    for (int h = 0; h < H; ++h)
      acc = fmaf(pre_s[tt * H + h], __bfloat162float(x[static_cast<int64_t>(tt) * K + h * D + d]), acc);
    collapsed[(t0 + tt) * D + d] = __float2bfloat16(acc);
  }
}

// One warp per token (8 per block), V consecutive elements per lane at a time.
template <int H, int V>
__global__ void __launch_bounds__(kThreads)
    hc_combine_kernel(const __nv_bfloat16* streams, const __nv_bfloat16* y, const float* post,
                      const float* comb, __nv_bfloat16* out, int64_t tokens, int64_t D) {
  const int64_t t = static_cast<int64_t>(blockIdx.x) * kWarps + threadIdx.x / 32;
  if (t >= tokens) return;
  const int lane = threadIdx.x % 32;
  float po[H], cm[H][H];
#pragma unroll
  for (int h = 0; h < H; ++h) {
    po[h] = post[t * H + h];
#pragma unroll
    for (int j = 0; j < H; ++j) cm[j][h] = comb[t * H * H + j * H + h];
  }
  const __nv_bfloat16* x = streams + t * H * D;
  for (int64_t d = lane * V; d < D; d += 32 * V) {
    float xv[H][V], yv[V];
#pragma unroll
    for (int j = 0; j < H; ++j) load<V>(x + j * D + d, xv[j]);
    load<V>(y + t * D + d, yv);
#pragma unroll
    for (int h = 0; h < H; ++h) {
      float acc[V];
#pragma unroll
      for (int e = 0; e < V; ++e) {
        acc[e] = po[h] * yv[e];
#pragma unroll
        for (int j = 0; j < H; ++j) acc[e] = fmaf(cm[j][h], xv[j][e], acc[e]);
      }
      store<V>(out + (t * H + h) * D + d, acc);
    }
  }
}

// One warp per token (8 per block), V consecutive elements per lane at a time; d_comb is a warp sum.
template <int H, int V>
__global__ void __launch_bounds__(kThreads)
    hc_combine_backward_kernel(const __nv_bfloat16* streams, const float* post, const float* comb,
                               const float* dout, float* dstreams, __nv_bfloat16* dy, float* d_comb,
                               int64_t tokens, int64_t D) {
  constexpr int N = H * H;  // d_comb [j * H + h]
  const int64_t t = static_cast<int64_t>(blockIdx.x) * kWarps + threadIdx.x / 32;
  if (t >= tokens) return;
  const int lane = threadIdx.x % 32;
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
  for (int64_t d = lane * V; d < D; d += 32 * V) {
    float gv[H][V], dyv[V];
#pragma unroll
    for (int h = 0; h < H; ++h) load<V>(g + h * D + d, gv[h]);
#pragma unroll
    for (int e = 0; e < V; ++e) {
      dyv[e] = 0.0f;
#pragma unroll
      for (int h = 0; h < H; ++h) dyv[e] = fmaf(po[h], gv[h][e], dyv[e]);
    }
    store<V>(dy + t * D + d, dyv);
#pragma unroll
    for (int j = 0; j < H; ++j) {
      float xv[V], acc[V];
      load<V>(x + j * D + d, xv);
      load<V>(dx + j * D + d, acc);
#pragma unroll
      for (int e = 0; e < V; ++e) {
#pragma unroll
        for (int h = 0; h < H; ++h) {
          acc[e] = fmaf(cm[j][h], gv[h][e], acc[e]);
          v[j * H + h] = fmaf(gv[h][e], xv[e], v[j * H + h]);
        }
      }
      store<V>(dx + j * D + d, acc);
    }
  }
#pragma unroll
  for (int k = 0; k < N; ++k) {
    const float sum = warp_sum(v[k]);
    if (lane == 0) d_comb[t * H * H + k] = sum;
  }
}

// d_post[t, h] = dout[t, h, :] . y[t, :]: one warp per token.
template <int H, int V>
__global__ void __launch_bounds__(kThreads)
    hc_post_gradient_kernel(const __nv_bfloat16* y, const float* dout, float* d_post, int64_t tokens,
                            int64_t D) {
  const int64_t t = static_cast<int64_t>(blockIdx.x) * kWarps + threadIdx.x / 32;
  if (t >= tokens) return;
  const int lane = threadIdx.x % 32;
  float v[H];
#pragma unroll
  for (int h = 0; h < H; ++h) v[h] = 0.0f;
  const float* g = dout + t * H * D;
  for (int64_t d = lane * V; d < D; d += 32 * V) {
    float yv[V];
    load<V>(y + t * D + d, yv);
#pragma unroll
    for (int h = 0; h < H; ++h) {
      float gv[V];
      load<V>(g + h * D + d, gv);
#pragma unroll
      for (int e = 0; e < V; ++e) v[h] = fmaf(gv[e], yv[e], v[h]);
    }
  }
#pragma unroll
  for (int h = 0; h < H; ++h) {
    const float sum = warp_sum(v[h]);
    if (lane == 0) d_post[t * H + h] = sum;
  }
}

// Floats of one warp's Sinkhorn backward scratch: m, g [M], p, dc [HH], the stages
// [(passes + 1) HH] and each pass's sums [passes H].
template <int H>
__host__ __device__ constexpr int sinkhorn_scratch_floats(int passes) {
  return 2 * Tile<H>::M + 2 * Tile<H>::HH + (passes + 1) * Tile<H>::HH + passes * H;
}

// Per tile: the mix again, the dots dpre[h] = sum_d dcol[d] x[h, d], the Sinkhorn stages forward
// and back (warps 0 .. sinkhorn_warps - 1, one token each at a time), d_pre/d_post/d_comb (and the
// collapse) back to the mix gradient dm; then dstreams += inv dn - x inv^3 (dm . raw) / (H D) +
// pre[h] dcol with dn = dm fn (the RMS-norm and collapse paths). Leaves g (the gradient before
// the scale), m and the RMS factor in the workspace row [g (M), m (M), inv] for hc_dfn_kernel.
template <int H>
__global__ void __launch_bounds__(kThreads, 1)
    hc_coefficients_backward_kernel(const __nv_bfloat16* streams, const float* fn, const float* base,
                                    const float* scale, const float* d_pre, const float* d_post,
                                    const float* d_comb, const __nv_bfloat16* d_collapsed, float* dstreams,
                                    float* workspace, int64_t tokens, int D, float rms_eps, float hc_eps,
                                    int iters, int sinkhorn_warps, bool vec) {
  using T = Tile<H>;
  constexpr int M = T::M, HH = T::HH, MP = T::MP;
  extern __shared__ float4 shared_words[];
  unsigned char* smem = reinterpret_cast<unsigned char*>(shared_words);
  const float* raw = reinterpret_cast<const float*>(smem + T::kRawOffset);
  float* pre_s = reinterpret_cast<float*>(smem + T::kPreOffset);
  float* dpre_s = reinterpret_cast<float*>(smem + T::kCommonBytes);  // [64, H]
  float* inv_s = dpre_s + kTileTokens * H;                           // [64]
  float* corr_s = inv_s + kTileTokens;                               // [64]
  float* scratch = corr_s + kTileTokens;                             // per Sinkhorn warp
  float* dm_s = reinterpret_cast<float*>(smem);                      // [64, MP], where the slices were
  const int passes = 2 * iters - 1;
  const int64_t t0 = static_cast<int64_t>(blockIdx.x) * kTileTokens;
  const int count = static_cast<int>(tokens - t0 < kTileTokens ? tokens - t0 : kTileTokens);
  const int K = H * D;
  const __nv_bfloat16* x = streams + t0 * K;
  const __nv_bfloat16* dcol = d_collapsed + t0 * D;
  mix_tile<H>(x, count, fn, K, vec, smem);

  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  for (int tt = warp; tt < count; tt += kWarps) {
    float v[H];
#pragma unroll
    for (int h = 0; h < H; ++h) v[h] = 0.0f;
    if (vec) {
      for (int d = lane * 8; d < D; d += 32 * 8) {
        float g[8], xv[8];
        load<8>(dcol + tt * D + d, g);
#pragma unroll
        for (int h = 0; h < H; ++h) {
          load<8>(x + static_cast<int64_t>(tt) * K + h * D + d, xv);
#pragma unroll
          for (int j = 0; j < 8; ++j) v[h] = fmaf(g[j], xv[j], v[h]);
        }
      }
    } else {
      for (int d = lane; d < D; d += 32) {
        const float g = __bfloat162float(dcol[tt * D + d]);
#pragma unroll
        for (int h = 0; h < H; ++h)
          v[h] = fmaf(g, __bfloat162float(x[static_cast<int64_t>(tt) * K + h * D + d]), v[h]);
      }
    }
#pragma unroll
    for (int h = 0; h < H; ++h) {
      const float s = warp_sum(v[h]);
      if (lane == 0) dpre_s[tt * H + h] = s + (d_pre != nullptr ? d_pre[(t0 + tt) * H + h] : 0.0f);
    }
  }
  for (int e = threadIdx.x; e < kTileTokens * MP; e += kThreads) dm_s[e] = 0.0f;  // padding and absent tokens
  __syncthreads();

  if (warp < sinkhorn_warps) {
    float* m = scratch + warp * sinkhorn_scratch_floats<H>(passes);
    float* g = m + M;
    float* p = g + M;
    float* dc = p + HH;
    float* stages = dc + HH;
    float* sums = stages + (passes + 1) * HH;
    for (int tt = warp; tt < count; tt += sinkhorn_warps) {
      const int64_t t = t0 + tt;
      const float* r = raw + tt * (M + 1);
      const float inv = rsqrtf(r[M] / static_cast<float>(K) + rms_eps);
      for (int o = lane; o < M; o += 32) m[o] = r[o] * inv;
      for (int k = lane; k < HH; k += 32) dc[k] = d_comb[t * HH + k];
      __syncwarp();
      // Forward again, keeping each stage and each pass's sums.
      comb_softmax<H>(lane, m, base, scale[2], hc_eps, stages, p);
      for (int k = 0; k < passes; ++k)
        sinkhorn_pass<H>(lane, k % 2 == 0, stages + k * HH, stages + (k + 1) * HH, hc_eps, sums + k * H);
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
        const float sp = sigmoid(m[h] * scale[0] + base[h]);
        g[h] = dpre_s[tt * H + h] * sp * (1.0f - sp);
        pre_s[tt * H + h] = sp + hc_eps;
        const float so = sigmoid(m[H + h] * scale[1] + base[H + h]);
        g[H + h] = d_post[t * H + h] * 2.0f * so * (1.0f - so);
      }
      __syncwarp();
      float* row = workspace + t * (2 * M + 1);
      float dot = 0.0f;  // dm . raw, for the RMS factor's gradient
      for (int o = lane; o < M; o += 32) {
        const float dm = g[o] * scale[group_of<H>(o)];
        dm_s[tt * MP + o] = dm;
        dot = fmaf(dm, r[o], dot);
        row[o] = g[o];
        row[M + o] = m[o];
      }
      dot = warp_sum(dot);
      if (lane == 0) {
        row[2 * M] = inv;
        inv_s[tt] = inv;
        corr_s[tt] = inv * inv * inv * dot / static_cast<float>(K);
      }
      __syncwarp();
    }
  }
  __syncthreads();

  float* dx = dstreams + t0 * K;
  for (int i = threadIdx.x; i < K; i += kThreads) {
    float f[MP];
#pragma unroll
    for (int o = 0; o < MP; ++o) f[o] = o < M ? __ldg(fn + static_cast<int64_t>(o) * K + i) : 0.0f;
    const int h = i / D, d = i % D;
#pragma unroll 4
    for (int tt = 0; tt < count; ++tt) {
      const float* dmr = dm_s + tt * MP;
      float dn = 0.0f;
#pragma unroll
      for (int o = 0; o < MP; o += 4) {
        const float4 q = *reinterpret_cast<const float4*>(dmr + o);
        dn = fmaf(q.x, f[o], fmaf(q.y, f[o + 1], fmaf(q.z, f[o + 2], fmaf(q.w, f[o + 3], dn))));
      }
      const int64_t at = static_cast<int64_t>(tt) * K + i;
      dx[at] += inv_s[tt] * dn - __bfloat162float(x[at]) * corr_s[tt] +
                pre_s[tt * H + h] * __bfloat162float(dcol[tt * D + d]);
    }
  }
}

// dfn[o, i] += sum_t dm[t, o] x[t, i] inv[t] over kChunksPerDfnBlock chunks of tokens per block
// (one atomic per fn entry per block); the first column of blocks also reduces dbase and dscale.
template <int H>
__global__ void __launch_bounds__(kThreads)
    hc_dfn_kernel(const __nv_bfloat16* streams, const float* scale, const float* workspace, float* dfn,
                  float* dbase, float* dscale, int64_t tokens, int64_t D) {
  constexpr int M = (2 + H) * H;
  __shared__ float dm[kTokenChunk * M], inv[kTokenChunk];
  const int64_t flat = H * D, i = static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x;
  const float s0 = scale[0], s1 = scale[1], s2 = scale[2];
  float acc[M], gb = 0.0f, gsc = 0.0f;
#pragma unroll
  for (int o = 0; o < M; ++o) acc[o] = 0.0f;
  const int64_t first = static_cast<int64_t>(blockIdx.y) * kTokenChunk * kChunksPerDfnBlock;
  for (int chunk = 0; chunk < kChunksPerDfnBlock; ++chunk) {
    const int64_t t0 = first + static_cast<int64_t>(chunk) * kTokenChunk;
    if (t0 >= tokens) break;
    const int nt = static_cast<int>(tokens - t0 < kTokenChunk ? tokens - t0 : kTokenChunk);
    __syncthreads();  // the previous chunk's dm is no longer read
    for (int e = threadIdx.x; e < nt * M; e += kThreads) {
      const int tt = e / M, o = e % M;
      const float gs = o < H ? s0 : (o < 2 * H ? s1 : s2);
      dm[e] = workspace[(t0 + tt) * (2 * M + 1) + o] * gs;
    }
    for (int tt = threadIdx.x; tt < nt; tt += kThreads) inv[tt] = workspace[(t0 + tt) * (2 * M + 1) + 2 * M];
    __syncthreads();
    if (blockIdx.x == 0 && threadIdx.x < M) {
      const int o = threadIdx.x;
      for (int tt = 0; tt < nt; ++tt) {
        const float* row = workspace + (t0 + tt) * (2 * M + 1);
        gb += row[o];
        gsc = fmaf(row[o], row[M + o], gsc);
      }
    }
    if (i < flat) {
      for (int tt = 0; tt < nt; ++tt) {
        const float v = __bfloat162float(streams[(t0 + tt) * flat + i]) * inv[tt];
#pragma unroll
        for (int o = 0; o < M; ++o) acc[o] = fmaf(dm[tt * M + o], v, acc[o]);
      }
    }
  }
  if (blockIdx.x == 0 && threadIdx.x < M) {
    atomicAdd(dbase + threadIdx.x, gb);
    atomicAdd(dscale + group_of<H>(threadIdx.x), gsc);
  }
  if (i >= flat) return;
#pragma unroll
  for (int o = 0; o < M; ++o) atomicAdd(dfn + o * flat + i, acc[o]);
}

void check_shape(const cpu::HcShape& s, const char* what) {
  check(s.streams >= 1 && s.streams <= kMaxStreams, what, ": hc_mult ", s.streams, " (expected 1 to ",
        kMaxStreams, ")");
  check(s.tokens >= 0 && s.tokens <= 0x7fffffff, what, ": ", s.tokens, " tokens is too many for one launch");
  check(s.hidden >= 1 && s.streams * s.hidden <= (1 << 24), what, ": hidden size ", s.hidden, " at hc_mult ",
        s.streams, " (expected 1 to 2^24 stream elements per token)");
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

// Whether the kernels can move 8 values at a time (16 bytes of bf16, two 16-byte fp32 accesses):
// rows of a multiple of 8 (so H D too) and aligned pointers.
bool vector_rows(const cpu::HcShape& s, std::initializer_list<Access> accesses) {
  return vector_width(accesses, s.hidden) == 8;
}

// Launches `kernel` with `bytes` of dynamic shared memory, raising its limit past 48 KiB if needed.
template <class Kernel, class... Args>
void launch_tiled(Kernel kernel, const cpu::HcShape& s, size_t bytes, cudaStream_t stream, const char* name,
                  Args... args) {
  if (bytes > 48 * 1024)
    SPINDLE_CUDA(
        cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(bytes)));
  const auto blocks = static_cast<unsigned>((s.tokens + kTileTokens - 1) / kTileTokens);
  kernel<<<blocks, kThreads, bytes, stream>>>(args...);
  check_cuda(cudaGetLastError(), name, __FILE__, __LINE__);
}

void hc_coefficients(const cpu::HcShape& s, const __nv_bfloat16* streams, const float* fn, const float* base,
                     const float* scale, float* pre, float* post, float* comb, __nv_bfloat16* collapsed,
                     cudaStream_t stream) {
  check_shape(s, "hc_coefficients");
  if (s.tokens == 0) return;
  const float rms_eps = static_cast<float>(s.rms_eps), hc_eps = static_cast<float>(s.hc_eps);
  const int iters = static_cast<int>(s.sinkhorn_iters), D = static_cast<int>(s.hidden);
  const bool vec = vector_rows(s, {{streams, 2}, {fn, 4}, {collapsed, 2}});
  SPINDLE_HC_DISPATCH({
    const size_t bytes = Tile<H>::kCommonBytes + kWarps * (Tile<H>::M + Tile<H>::HH) * sizeof(float);
    launch_tiled(hc_coefficients_kernel<H>, s, bytes, stream, "hc_coefficients_kernel", streams, fn, base,
                 scale, pre, post, comb, collapsed, s.tokens, D, rms_eps, hc_eps, iters, vec);
  })
}

void hc_combine(const cpu::HcShape& s, const __nv_bfloat16* streams, const __nv_bfloat16* y,
                const float* post, const float* comb, __nv_bfloat16* out, cudaStream_t stream) {
  check_shape(s, "hc_combine");
  if (s.tokens == 0) return;
  const auto blocks = static_cast<unsigned>((s.tokens + kWarps - 1) / kWarps);
  if (vector_rows(s, {{streams, 2}, {y, 2}, {out, 2}})) {
    SPINDLE_HC_DISPATCH(hc_combine_kernel<H, 8>
                        <<<blocks, kThreads, 0, stream>>>(streams, y, post, comb, out, s.tokens, s.hidden))
  } else {
    SPINDLE_HC_DISPATCH(hc_combine_kernel<H, 1>
                        <<<blocks, kThreads, 0, stream>>>(streams, y, post, comb, out, s.tokens, s.hidden))
  }
  SPINDLE_LAUNCHED("hc_combine_kernel");
}

void hc_combine_backward(const cpu::HcShape& s, const __nv_bfloat16* streams, const float* post,
                         const float* comb, const float* dout, float* dstreams, __nv_bfloat16* dy,
                         float* d_comb, cudaStream_t stream) {
  check_shape(s, "hc_combine_backward");
  if (s.tokens == 0) return;
  const auto blocks = static_cast<unsigned>((s.tokens + kWarps - 1) / kWarps);
  if (vector_rows(s, {{streams, 2}, {dout, 4}, {dstreams, 4}, {dy, 2}})) {
    SPINDLE_HC_DISPATCH(hc_combine_backward_kernel<H, 8><<<blocks, kThreads, 0, stream>>>(
        streams, post, comb, dout, dstreams, dy, d_comb, s.tokens, s.hidden))
  } else {
    SPINDLE_HC_DISPATCH(hc_combine_backward_kernel<H, 1><<<blocks, kThreads, 0, stream>>>(
        streams, post, comb, dout, dstreams, dy, d_comb, s.tokens, s.hidden))
  }
  SPINDLE_LAUNCHED("hc_combine_backward_kernel");
}

void hc_post_gradient(const cpu::HcShape& s, const __nv_bfloat16* y, const float* dout, float* d_post,
                      cudaStream_t stream) {
  check_shape(s, "hc_post_gradient");
  if (s.tokens == 0) return;
  const auto blocks = static_cast<unsigned>((s.tokens + kWarps - 1) / kWarps);
  if (vector_rows(s, {{y, 2}, {dout, 4}})) {
    SPINDLE_HC_DISPATCH(hc_post_gradient_kernel<H, 8>
                        <<<blocks, kThreads, 0, stream>>>(y, dout, d_post, s.tokens, s.hidden))
  } else {
    SPINDLE_HC_DISPATCH(hc_post_gradient_kernel<H, 1>
                        <<<blocks, kThreads, 0, stream>>>(y, dout, d_post, s.tokens, s.hidden))
  }
  SPINDLE_LAUNCHED("hc_post_gradient_kernel");
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
  const float rms_eps = static_cast<float>(s.rms_eps), hc_eps = static_cast<float>(s.hc_eps);
  const int iters = static_cast<int>(s.sinkhorn_iters), passes = 2 * iters - 1,
            D = static_cast<int>(s.hidden);
  const bool vec = vector_rows(s, {{streams, 2}, {fn, 4}, {d_collapsed, 2}});
  const int64_t flat = s.streams * s.hidden;
  const dim3 dfn_grid(static_cast<unsigned>((flat + kThreads - 1) / kThreads),
                      static_cast<unsigned>((s.tokens + kTokenChunk * kChunksPerDfnBlock - 1) /
                                            (kTokenChunk * kChunksPerDfnBlock)));
  SPINDLE_HC_DISPATCH({
    // As many warps run the Sinkhorn backward at once as their stages fit in shared memory.
    const size_t fixed = Tile<H>::kCommonBytes + (kTileTokens * H + 2 * kTileTokens) * sizeof(float);
    const size_t per_warp = static_cast<size_t>(sinkhorn_scratch_floats<H>(passes)) * sizeof(float);
    const int warps = static_cast<int>(std::min<size_t>(kWarps, (kMaxDynamicShared - fixed) / per_warp));
    check(warps >= 1, "hc_coefficients_backward: ", iters, " Sinkhorn iterations at hc_mult ", s.streams,
          " need ", fixed + per_warp, " bytes of shared memory (at most ", kMaxDynamicShared, ")");
    launch_tiled(hc_coefficients_backward_kernel<H>, s, fixed + warps * per_warp, stream,
                 "hc_coefficients_backward_kernel", streams, fn, base, scale, d_pre, d_post, d_comb,
                 d_collapsed, dstreams, workspace, s.tokens, D, rms_eps, hc_eps, iters, warps, vec);
    hc_dfn_kernel<H><<<dfn_grid, kThreads, 0, stream>>>(streams, scale, workspace, dfn, dbase, dscale,
                                                        s.tokens, s.hidden);
    SPINDLE_LAUNCHED("hc_dfn_kernel");
  })
}

#undef SPINDLE_HC_DISPATCH

}  // namespace spindle::cuda
