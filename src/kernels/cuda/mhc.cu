// mHC hyper-connections. The coefficient kernels (forward and backward) take a tile of 64 tokens
// per block of 256 threads, H a template parameter:
//   1. the mix raw = x [tokens, H D] fn^T [H D, (2 + H) H] and each token's sum of squares, a thin
//      GEMM on the tensor cores: x is bf16 already and fn (fp32) is split into bf16 hi + lo, so
//      that x hi + x lo keeps fp32 accuracy; slices of x and fn stream through a 3-stage cp.async
//      ring (two loading while one is multiplied), each fn slice read once per tile, not once per
//      token. hc_coefficients writes the mix out for the site's backward (and for
//      hc_coefficients_from_mix, where a recomputation kept it), which loads it instead;
//   2. the tiny per-token work: the softmax and the 2 iters - 1 Sinkhorn passes in one thread's
//      registers; backward, the same again keeping each pass's line sums in shared memory, then
//      back through the passes, each pass's input rebuilt from its output and sums;
//   3. the collapse (forward), each thread's vectors of x through its own cp.async ring, the first
//      loading during the Sinkhorn passes (with load_mix's copies, where the mix was kept); backward,
//      the stream gradient dstreams += dm fn with the RMS and collapse paths is a kernel of its own
//      (hc_stream_gradient_kernel), whose blocks each walk a run of tokens, in one wave.
// hc_combine and its backward take one warp per token (memory bound); hc_combine_mix, the forward's
// form at hc_mult 4, combines a 64-token tile slice by slice and multiplies it by the next site's fn
// (mix_slice) as it goes; dfn = w^T x, w = dm times the
// RMS factor (left by the backward in its workspace, transposed and split in bf16 hi + lo), is a
// tensor-core GEMM over 1024-token chunks.
//
// What each call must move and compute at T tokens, K = H D, M = (2 + H) H (in brackets: H = 4,
// D = 2048, T = 16384, K = 8192, M = 24, at the ~4.3 TB/s an H200 reaches):
//   hc_coefficients: x 2 T K + collapsed 2 T D + pre, post, comb 4 T (2 H + H^2) bytes [336 MB,
//     0.08 ms]; 2 T K M (the mix) + 4 T K FLOPs [6.7 GFLOP: 0.1 ms on the CUDA cores' fp32, so the
//     tensor cores]. A tile's x (1 MB) leaves L2 before its collapse reads it again: x is read
//     twice [604 MB, 0.14 ms].
//   hc_coefficients_backward: x 2 T K + d_collapsed 2 T D + dstreams (bf16) read and written 4 T K
//     + w 4 T M bytes [874 MB, 0.20 ms]; 2 T K M (dn = dm fn) + ~8 T K FLOPs [7.5 GFLOP]. x is read
//     twice (dpre, the stream pass) and d_collapsed twice [1210 MB, 0.28 ms].
//   hc_dfn: x 2 T K + w 4 T M + dfn's atomics 4 M K per 1024 tokens [282 MB, 0.066 ms]; 2 T K M
//     FLOPs [6.4 GFLOP, twice that on the tensor cores for w's hi + lo].
#include <algorithm>
#include <cstdint>
#include <initializer_list>
#include <type_traits>

#include "backend/cuda/check.h"
#include "backend/cuda/device_memory.h"
#include "core/error.h"
#include "kernels/cuda/launch.cuh"
#include "kernels/cuda/memory_bound.cuh"
#include "kernels/cuda/mhc.h"
#include "kernels/cuda/mma.cuh"
#include "kernels/cuda/norms.h"
#include "kernels/cuda/shared_memory_limit.h"
#include "kernels/cuda/warp_reduce.cuh"

namespace spindle::cuda {

namespace {

constexpr int kThreads = 256;
constexpr int kWarps = kThreads / 32;
constexpr int kMaxStreams = 8;
constexpr int kTileTokens = 64;  // tokens per block of the coefficient kernels: 4 MMA rows of 16
// Mix reduction slice: 32-wide k chunks, alternately for each half of the warps. Three stages of
// 128 (two loading while one is multiplied) still fit two blocks per SM at hc_mult 4; with two (one
// slice a tile in flight) the mix ran well below the DRAM's bandwidth.
constexpr int kSlice = 128;
constexpr int kStages = 3;
// Row strides of a staged slice. A quarter warp reads rows g and g + 1 with 16-byte accesses at 16 c
// (x) or 32 c (fn) bytes: rows 64 mod 128 bytes apart (x) or 4 words mod 32 (fn) hit disjoint banks.
constexpr int kXStride = kSlice + 32;  // bf16
constexpr int kFStride = kSlice + 4;   // fp32
static_assert(kTileTokens == kWarps * 8, "the forward's Sinkhorn takes 8 tokens per warp");

__device__ __forceinline__ float sigmoid(float a) { return 1.0f / (1.0f + expf(-a)); }

// Index of the scale (0 pre, 1 post, 2 comb) that mix output o is multiplied by.
template <int H>
__device__ __forceinline__ int group_of(int o) {
  return o < H ? 0 : (o < 2 * H ? 1 : 2);
}

// The collapse of one token's V columns: acc = sum_h pre[h] v[h], h in order.
template <int H, int V>
__device__ __forceinline__ void collapse_columns(const float (&v)[H][V], const float* pre, float (&acc)[V]) {
#pragma unroll
  for (int j = 0; j < V; ++j) acc[j] = 0.0f;
#pragma unroll
  for (int h = 0; h < H; ++h) {
    const float ph = pre[h];
#pragma unroll
    for (int j = 0; j < V; ++j) acc[j] = fmaf(ph, v[h][j], acc[j]);
  }
}

// Slots of the forward's collapse ring (see stage_collapse), each a 16-byte vector of every stream a
// thread: four in flight while one is summed.
constexpr int kCollapseSlots = 5;

// What comes before raw in a coefficient kernel's shared memory: the mix's ring (the kernel multiplies
// the mix; the collapse's ring takes its place after the mix), the collapse's ring alone (it loads a
// mix kept since), or nothing (the backward).
enum class Ring { kMix, kCollapse, kNone };

// Shared-memory layout of the coefficient kernels for H streams.
template <int H, Ring kRing = Ring::kMix>
struct Tile {
  static constexpr int M = (2 + H) * H;   // mix outputs
  static constexpr int NT = (M + 7) / 8;  // MMA column tiles of the mix (fn rows staged: 8 NT)
  static constexpr int HH = H * H;
  static constexpr size_t kXBytes = kTileTokens * kXStride * sizeof(__nv_bfloat16);
  static constexpr size_t kStageBytes = kXBytes + NT * 8 * kFStride * sizeof(float);
  static constexpr size_t kCollapseBytes = size_t{kCollapseSlots} * H * kThreads * 16;
  // The ring, then raw [64, M + 1] (sum of squares last), pre [64, H], then per-kernel data.
  static constexpr size_t kRawOffset =
      kRing == Ring::kMix ? kStages * kStageBytes : (kRing == Ring::kCollapse ? kCollapseBytes : 0);
  static constexpr size_t kPreOffset = kRawOffset + kTileTokens * (M + 1) * sizeof(float);
  static constexpr size_t kCommonBytes = kPreOffset + kTileTokens * H * sizeof(float);
  static_assert(kXBytes % 16 == 0 && kStageBytes % 16 == 0, "stages must be 16-byte aligned");
  static_assert(kCollapseBytes <= kStages * kStageBytes, "the collapse's ring in the mix's");
  static_assert(H > 4 || 2 * (kCommonBytes + 1024) <= 228 * 1024,
                "two blocks an SM (1 KiB reserved a block)");
};

// What hc_coefficients_backward_kernel leaves in its workspace for hc_stream_gradient_kernel and
// hc_dfn_kernel: a row of kInputStride floats a token, [w = dm inv (M), zeros up to kWStride,
// corr = inv^3 (dm . raw) / K, pre (H), unused up to whole float4s] (the stream pass's shared copy of
// it, taken by 16-byte copies), then w^T as bf16 hi and lo [M, tokens] each (the dfn product's A
// operand, split once rather than in each of its column blocks); hc_coefficients_backward_workspace
// sizes it.
template <int H>
constexpr int kWStride = ((2 + H) * H + 3) / 4 * 4;
template <int H>
constexpr int kInputStride = (kWStride<H> + 1 + H + 3) / 4 * 4;
// w^T's hi rows [M, tokens]; the lo rows follow them.
template <int H, class F,
          class B = std::conditional_t<std::is_const_v<F>, const __nv_bfloat16, __nv_bfloat16>>
__device__ __forceinline__ B* split_w_transposed(F* workspace, int64_t tokens) {
  return reinterpret_cast<B*>(workspace + tokens * kInputStride<H>);
}

// fn split once per call into bf16 hi + lo (hi + lo = fn to about 2^-16), a 32-bit word per value:
// hi in the low half, lo in the high half. The mix's MMAs take fn's B fragments as bf16 pairs; split
// at the mix, the 12 conversions per thread and slice were most of its integer instructions.
__global__ void __launch_bounds__(kThreads) split_fn_kernel(const float* fn, uint32_t* split, int64_t n) {
  wait_for_earlier_kernels();
  for (int64_t i = blockIdx.x * int64_t{kThreads} + threadIdx.x; i < n; i += int64_t{gridDim.x} * kThreads) {
    const Bf16Split f = split_bf16(fn[i]);
    split[i] = static_cast<uint32_t>(__bfloat16_as_ushort(f.hi)) |
               static_cast<uint32_t>(__bfloat16_as_ushort(f.lo)) << 16;
  }
}

// The bf16x2 pair (first's, second's) of two split words' hi halves, and of their lo halves.
__device__ __forceinline__ uint32_t high_halves(uint32_t first, uint32_t second) {
  return __byte_perm(first, second, 0x5410);
}
__device__ __forceinline__ uint32_t low_halves(uint32_t first, uint32_t second) {
  return __byte_perm(first, second, 0x7632);
}

// Stages slice [k0, k0 + kSlice) of x [count, K] and fn [M, K] (split, split_fn_kernel) into buf
// (zeros past the ends and in fn's padding rows), as one commit group (empty past K). `vec` (D % 8 == 0,
// 16-byte aligned pointers): by cp.async, to be waited for; else plain loads.
template <int H>
__device__ void stage_slice(const __nv_bfloat16* x, int count, const uint32_t* fn, int K, int k0, bool vec,
                            unsigned char* buf) {
  using T = Tile<H>;
  constexpr int kRows = T::NT * 8;
  __nv_bfloat16* xs = reinterpret_cast<__nv_bfloat16*>(buf);
  uint32_t* fs = reinterpret_cast<uint32_t*>(buf + T::kXBytes);
  if (k0 < K && vec) {
    for (int e = threadIdx.x; e < kTileTokens * kSlice / 8; e += kThreads) {
      const int tt = e / (kSlice / 8), kk = e % (kSlice / 8) * 8, k = k0 + kk;
      const bool valid = tt < count && k < K;
      copy16(xs + tt * kXStride + kk, valid ? x + static_cast<int64_t>(tt) * K + k : x, valid);
    }
    for (int e = threadIdx.x; e < kRows * kSlice / 4; e += kThreads) {
      const int o = e / (kSlice / 4), kk = e % (kSlice / 4) * 4, k = k0 + kk;
      const bool valid = o < T::M && k < K;
      copy16(fs + o * kFStride + kk, valid ? fn + static_cast<int64_t>(o) * K + k : fn, valid);
    }
  } else if (k0 < K) {
    for (int e = threadIdx.x; e < kTileTokens * kSlice; e += kThreads) {
      const int tt = e / kSlice, kk = e % kSlice, k = k0 + kk;
      xs[tt * kXStride + kk] =
          tt < count && k < K ? x[static_cast<int64_t>(tt) * K + k] : __float2bfloat16(0.0f);
    }
    for (int e = threadIdx.x; e < kRows * kSlice; e += kThreads) {
      const int o = e / kSlice, kk = e % kSlice, k = k0 + kk;
      fs[o * kFStride + kk] = o < T::M && k < K ? __ldg(fn + static_cast<int64_t>(o) * K + k) : 0u;
    }
  }
  copy_commit();  // every call commits a group, so that the ring's wait counts stay fixed
}

// The mix's accumulators of one thread: acc [NT][4] over fn's rows, the squares' two diagonal
// blocks (see mix_slice).
template <int H>
struct MixAccumulators {
  float acc[Tile<H>::NT][4] = {}, sq_top[4] = {}, sq_bottom[4] = {};
};

// One staged slice's products into the accumulators: xs [64, kXStride] bf16 (the tile's tokens,
// kSlice k values), fs [8 NT, kFStride] (fn's split words of the same k). Warp w multiplies tokens
// 16 (w % 4) .. + 15 by the 32-wide k chunks w / 4, w / 4 + 2 of the slice; the two halves add up
// in store_mix.
//
// Within a chunk the k order is permuted (the sum does not care): thread (g, c) = (lane / 4, lane % 4)
// reads elements 8c .. 8c + 7 of its rows g and g + 8 in one 16-byte access each and gives them to
// two m16n8k16 as their k = 2c, 2c + 1, 2c + 8, 2c + 9; fn's B fragments follow the same order.
// The sums of squares come from two more MMAs per k16: x x^T of the 16 rows against rows 0-7 and
// 8-15 (B is the thread's own x registers), whose diagonals are the sums (bf16 products are exact).
template <int H>
__device__ __forceinline__ void mix_slice(const __nv_bfloat16* xs, const uint32_t* fs,
                                          MixAccumulators<H>& m) {
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, c = lane % 4;
  const int row = (warp % 4) * 16 + g, half = warp / 4;
#pragma unroll 1
  for (int sub = 0; sub < kSlice / 64; ++sub) {
    const int kc = sub * 64 + half * 32 + 8 * c;
    const uint4 top = *reinterpret_cast<const uint4*>(xs + row * kXStride + kc);
    const uint4 bottom = *reinterpret_cast<const uint4*>(xs + (row + 8) * kXStride + kc);
    const uint32_t a0[4] = {top.x, bottom.x, top.y, bottom.y}, a1[4] = {top.z, bottom.z, top.w, bottom.w};
    mma_bf16(m.sq_top, a0, top.x, top.y);
    mma_bf16(m.sq_top, a1, top.z, top.w);
    mma_bf16(m.sq_bottom, a0, bottom.x, bottom.y);
    mma_bf16(m.sq_bottom, a1, bottom.z, bottom.w);
#pragma unroll
    for (int n = 0; n < Tile<H>::NT; ++n) {
      const uint32_t* f = fs + (n * 8 + g) * kFStride + kc;
      const uint4 f0 = *reinterpret_cast<const uint4*>(f), f1 = *reinterpret_cast<const uint4*>(f + 4);
      const uint32_t hi[4] = {high_halves(f0.x, f0.y), high_halves(f0.z, f0.w), high_halves(f1.x, f1.y),
                              high_halves(f1.z, f1.w)};
      const uint32_t lo[4] = {low_halves(f0.x, f0.y), low_halves(f0.z, f0.w), low_halves(f1.x, f1.y),
                              low_halves(f1.z, f1.w)};
      mma_bf16(m.acc[n], a0, hi[0], hi[1]);
      mma_bf16(m.acc[n], a0, lo[0], lo[1]);
      mma_bf16(m.acc[n], a1, hi[2], hi[3]);
      mma_bf16(m.acc[n], a1, lo[2], lo[3]);
    }
  }
}

// The accumulators into raw [64, M + 1] (sum of squares last): the second half of the warps stores,
// then the first adds; ends with a barrier.
template <int H>
__device__ void store_mix(const MixAccumulators<H>& m, float* raw) {
  constexpr int M = Tile<H>::M;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, c = lane % 4;
  const int row = (warp % 4) * 16 + g, half = warp / 4;
  // C fragment: acc[n][e] is (row + 8 (e / 2), column 8 n + 2 c + e % 2). The diagonal entry of the
  // squares, (g, g) and (g + 8, 8 + g), sits in the thread with c = g / 2, element g % 2 (+ 2).
  const bool diagonal = c == g / 2;
  const float sq0 = g % 2 == 0 ? m.sq_top[0] : m.sq_top[1],
              sq1 = g % 2 == 0 ? m.sq_bottom[2] : m.sq_bottom[3];
  for (int pass = 1; pass >= 0; --pass) {
    if (half == pass) {
#pragma unroll
      for (int n = 0; n < Tile<H>::NT; ++n) {
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const int o = n * 8 + 2 * c + e % 2;
          float& r = raw[(row + 8 * (e / 2)) * (M + 1) + o];
          if (o < M) r = pass == 1 ? m.acc[n][e] : r + m.acc[n][e];
        }
      }
      if (diagonal) {
        float& r0 = raw[row * (M + 1) + M];
        float& r1 = raw[(row + 8) * (M + 1) + M];
        r0 = pass == 1 ? sq0 : r0 + sq0;
        r1 = pass == 1 ? sq1 : r1 + sq1;
      }
    }
    __syncthreads();
  }
}

// Mix of one tile into raw (see Tile): raw[tt, o] = sum_k x[tt, k] fn[o, k] for o < M and raw[tt, M]
// = sum_k x[tt, k]^2, for the tile's `count` tokens x [count, K], its slices through the ring.
template <int H>
__device__ void mix_tile(const __nv_bfloat16* x, int count, const uint32_t* fn, int K, bool vec,
                         unsigned char* smem) {
  using T = Tile<H>;
  MixAccumulators<H> m;
  const int slices = (K + kSlice - 1) / kSlice;
#pragma unroll
  for (int s = 0; s < kStages - 1; ++s)
    stage_slice<H>(x, count, fn, K, s * kSlice, vec, smem + s * T::kStageBytes);
  for (int s = 0; s < slices; ++s) {
    copy_wait<kStages - 2>();  // this thread's copies of slice s have landed
    __syncthreads();           // everyone's have, and nobody reads slice s - 1 any more
    stage_slice<H>(x, count, fn, K, (s + kStages - 1) * kSlice, vec,
                   smem + (s + kStages - 1) % kStages * T::kStageBytes);
    const unsigned char* buf = smem + s % kStages * T::kStageBytes;
    mix_slice<H>(reinterpret_cast<const __nv_bfloat16*>(buf),
                 reinterpret_cast<const uint32_t*>(buf + T::kXBytes), m);
  }
  copy_wait<0>();  // only empty groups are left, but the ring is reused after this
  store_mix<H>(m, reinterpret_cast<float*>(smem + T::kRawOffset));
}

// The row softmax of a token's comb logits (raw r [M + 1] times the RMS factor inv, the comb scale
// and base) into p, in the calling thread's registers.
template <int H>
__device__ __forceinline__ void comb_softmax(const float* r, float inv, float comb_scale, const float* base,
                                             float (&p)[H][H]) {
#pragma unroll
  for (int i = 0; i < H; ++i) {
    float mx = -INFINITY;
#pragma unroll
    for (int j = 0; j < H; ++j) {
      p[i][j] = r[2 * H + i * H + j] * inv * comb_scale + base[2 * H + i * H + j];
      mx = fmaxf(mx, p[i][j]);
    }
    float z = 0.0f;
#pragma unroll
    for (int j = 0; j < H; ++j) z += (p[i][j] = expf(p[i][j] - mx));
#pragma unroll
    for (int j = 0; j < H; ++j) p[i][j] = p[i][j] / z;
  }
}

// One Sinkhorn pass over a matrix in the calling thread's registers: each column (or row) divided
// by its sum + eps, as a multiplication by the reciprocal (within an ulp of the division; H^2
// divisions per pass would be most of the forward's Sinkhorn time). Keeps each line's sum + eps in
// sums [H] when given, for the backward.
template <int H, bool kColumns>
__device__ __forceinline__ void normalize_lines(float (&c)[H][H], float eps, float* sums = nullptr) {
#pragma unroll
  for (int a = 0; a < H; ++a) {
    float sum = 0.0f;
#pragma unroll
    for (int b = 0; b < H; ++b) sum += kColumns ? c[b][a] : c[a][b];
    const float S = sum + eps, r = 1.0f / S;
    if (sums != nullptr) sums[a] = S;
#pragma unroll
    for (int b = 0; b < H; ++b) (kColumns ? c[b][a] : c[a][b]) *= r;
  }
}

// Back through one normalize_lines pass, given its output c' in c and its sums S: with r = 1 / S,
// c' = c r along each line, so dc = (dc' - dc' . c') r; and c becomes the pass's input c' S.
template <int H, bool kColumns>
__device__ __forceinline__ void normalize_lines_backward(float (&c)[H][H], float (&dc)[H][H],
                                                         const float* sums) {
#pragma unroll
  for (int a = 0; a < H; ++a) {
    const float S = sums[a], r = 1.0f / S;
    float dot = 0.0f;
#pragma unroll
    for (int b = 0; b < H; ++b) dot = fmaf(kColumns ? dc[b][a] : dc[a][b], kColumns ? c[b][a] : c[a][b], dot);
#pragma unroll
    for (int b = 0; b < H; ++b) {
      float& d = kColumns ? dc[b][a] : dc[a][b];
      d = (d - dot) * r;
      (kColumns ? c[b][a] : c[a][b]) *= S;
    }
  }
}

// A tile's mix rows [count, M + 1] (raw, as mix_tile leaves them) from a kept mix [tokens, M + 1]
// into shared memory by cp.async, as one commit group: all of a thread's loads in flight at once
// (plain loads went one after the other). Threads 0 .. threads - 1 call it; they wait for the group,
// then a barrier.
template <int H>
__device__ void load_mix(const float* mix, int64_t t0, int count, float* raw, int threads = kThreads) {
  constexpr int W = Tile<H>::M + 1;
  for (int e = threadIdx.x; e < count * W; e += threads) copy4(raw + e, mix + t0 * W + e, true);
  copy_commit();
}

// The order a thread takes the collapse's items in (vec: D % 8 == 0, 16-byte aligned rows; an item is
// 8 columns of a token): warp w takes the tile's tokens w, w + kWarps, ..., and in each its lane l the
// items l, l + 32, ... (per_lane of them; the last ones past D where D / 8 is not a multiple of 32). A
// token is one warp's, so its norm needs the warp's sum of squares alone: no barrier in the collapse.
struct CollapsePlan {
  int per_lane, rounds;
  __device__ explicit CollapsePlan(int D)
      : per_lane((D / 8 + 31) / 32), rounds(kTileTokens / kWarps * per_lane) {}
  __device__ int token(int k) const { return static_cast<int>(threadIdx.x) / 32 + kWarps * (k / per_lane); }
  __device__ int column(int k) const { return (k % per_lane * 32 + static_cast<int>(threadIdx.x) % 32) * 8; }
};

// The thread's item k: H streams of x (the tile's rows [count, H D]) into slot k % kCollapseSlots of
// its own ring, as one commit group (empty past the tile's items). The thread reads back only what
// it copied: no barriers, and the loads are in flight without holding registers.
template <int H>
__device__ __forceinline__ void stage_collapse(const __nv_bfloat16* x, int D, int count,
                                               const CollapsePlan& plan, int k, uint4* ring) {
  const int token = plan.token(k), d = plan.column(k);
  if (token < count && d < D) {
    const __nv_bfloat16* src = x + static_cast<int64_t>(token) * H * D + d;
    uint4* slot = ring + k % kCollapseSlots * H * kThreads + threadIdx.x;  // [slot, h, thread]
#pragma unroll
    for (int h = 0; h < H; ++h) copy16(slot + h * kThreads, src + h * D, true);
  }
  copy_commit();
}

// A token's normed row (HcNorm) from its collapsed row as stored (the lane's own items, read back)
// and the warp's sum of their squares.
__device__ __forceinline__ void store_normed(const __nv_bfloat16* collapsed_row, float sum, int D,
                                             const CollapsePlan& plan, const HcNorm& norm,
                                             __nv_bfloat16* normed_row) {
  const float inv = rsqrtf(sum / static_cast<float>(D) + norm.eps);
  for (int j = 0; j < plan.per_lane; ++j) {
    const int d = (j * 32 + static_cast<int>(threadIdx.x) % 32) * 8;
    if (d >= D) break;
    float v[8], w[8], out[8];
    load<8>(collapsed_row + d, v);
    load<8>(norm.weight + d, w);
#pragma unroll
    for (int i = 0; i < 8; ++i) out[i] = w[i] * (v[i] * inv);
    store<8>(normed_row + d, out);
  }
}

// kFromMix: the mix comes from `kept_mix` (written by an earlier call), else it is multiplied here
// and written to `mix_out` where given. Everything after the mix is the same code either way.
// norm.normed null: no norm here (the host runs rms_norm_forward after, see hc_norm_fused).
// kCombine (from the mix, vec): hc_combine_backward's dy, d_comb and d_post too (`grad`), item by
// item in the collapse's pass over the streams, each sum in that kernel's order (the same bits).
template <int H, bool kFromMix, bool kCombine = false>
__global__ void __launch_bounds__(kThreads, H <= 4 ? 2 : 1)
    hc_coefficients_kernel(const __nv_bfloat16* streams, const uint32_t* fn, const float* kept_mix,
                           float* mix_out, const float* base, const float* scale, float* pre, float* post,
                           float* comb, __nv_bfloat16* collapsed, HcNorm norm, HcCombineGrad grad,
                           int64_t tokens, int D, float rms_eps, float hc_eps, int iters, bool vec) {
  wait_for_earlier_kernels();
  using T = Tile<H, kFromMix ? Ring::kCollapse : Ring::kMix>;
  constexpr int M = T::M;
  extern __shared__ float4 shared_words[];
  unsigned char* smem = reinterpret_cast<unsigned char*>(shared_words);
  uint4* ring = reinterpret_cast<uint4*>(smem);  // the collapse's, once the mix is done with its own
  float* raw = reinterpret_cast<float*>(smem + T::kRawOffset);
  float* pre_s = reinterpret_cast<float*>(smem + T::kPreOffset);
  const int64_t t0 = static_cast<int64_t>(blockIdx.x) * kTileTokens;
  const int count = static_cast<int>(tokens - t0 < kTileTokens ? tokens - t0 : kTileTokens);
  const int K = H * D;
  const __nv_bfloat16* x = streams + t0 * K;
  // The collapse's first items start loading as soon as the ring is free, so that the DRAM is busy
  // during the Sinkhorn passes too (they need nothing but the mix).
  const CollapsePlan plan(D);
  const int staged = vec ? count : 0;  // tokens the ring loads
  const auto start_collapse = [&] {
#pragma unroll
    for (int k = 0; k < kCollapseSlots - 1; ++k) stage_collapse<H>(x, D, staged, plan, k, ring);
  };
  if constexpr (kFromMix) {
    load_mix<H>(kept_mix, t0, count, raw);
    start_collapse();
    copy_wait<kCollapseSlots - 1>();  // the mix has landed (committed before the collapse's items)
    __syncthreads();
  } else {
    mix_tile<H>(x, count, fn, K, vec, smem);
    start_collapse();
    if (mix_out != nullptr)
      for (int e = threadIdx.x; e < count * (M + 1); e += kThreads) mix_out[t0 * (M + 1) + e] = raw[e];
  }

  // One thread per token, the first 8 lanes of every warp: the passes are serial, so eight warps
  // interleave them rather than two full ones.
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, tt = warp * 8 + lane;
  if (lane < 8 && tt < count) {
    const float* r = raw + tt * (M + 1);
    const float inv = rsqrtf(r[M] / static_cast<float>(K) + rms_eps);
    const int64_t t = t0 + tt;
#pragma unroll
    for (int h = 0; h < H; ++h) {
      pre_s[tt * H + h] = sigmoid(r[h] * inv * scale[0] + base[h]) + hc_eps;
      pre[t * H + h] = pre_s[tt * H + h];
      post[t * H + h] = 2.0f * sigmoid(r[H + h] * inv * scale[1] + base[H + h]);
    }
    // Row softmax plus eps, then Sinkhorn as transformers writes it: one column pass, then
    // (iters - 1) row + column passes.
    float cm[H][H];
    comb_softmax<H>(r, inv, scale[2], base, cm);
#pragma unroll
    for (int i = 0; i < H; ++i)
#pragma unroll
      for (int j = 0; j < H; ++j) cm[i][j] += hc_eps;
    normalize_lines<H, true>(cm, hc_eps);
    for (int it = 0; it + 1 < iters; ++it) {
      normalize_lines<H, false>(cm, hc_eps);
      normalize_lines<H, true>(cm, hc_eps);
    }
#pragma unroll
    for (int i = 0; i < H; ++i) {
#pragma unroll
      for (int j = 0; j < H; ++j) comb[t * T::HH + i * H + j] = cm[i][j];
    }
  }
  __syncthreads();
  if (vec) {
    // The thread's items through its ring (stage_collapse), kCollapseSlots - 1 in flight (the tile's
    // x is no longer in L2 by now); with kCombine, the item's rows of dout and y one item ahead.
    float squares = 0.0f;  // of the lane's items of its warp's current token
    // kCombine's sums over the lane's items of the token (d_comb [j * H + h]), the token's post, and
    // the next item's rows of dout (H) and y.
    [[maybe_unused]] float d_comb[kCombine ? H * H : 1] = {}, d_post[kCombine ? H : 1] = {},
                                                     po[kCombine ? H : 1] = {};
    [[maybe_unused]] uint4 grad_rows[kCombine ? H + 1 : 1];
    const auto load_grad_rows = [&](int k) {
      if constexpr (kCombine) {
        const int token = plan.token(k), d = plan.column(k);
        if (token >= count || d >= D) return;
        const int64_t t = t0 + token;
#pragma unroll
        for (int h = 0; h < H; ++h)
          grad_rows[h] = *reinterpret_cast<const uint4*>(grad.dout + (t * H + h) * D + d);
        grad_rows[H] = *reinterpret_cast<const uint4*>(grad.y + t * D + d);
      }
    };
    load_grad_rows(0);
    for (int k = 0; k < plan.rounds; ++k) {
      copy_wait<kCollapseSlots - 2>();  // item k has landed
      // Into the slot of item k - 1, whose values this thread has summed and stored already.
      stage_collapse<H>(x, D, staged, plan, k + kCollapseSlots - 1, ring);
      const int token = plan.token(k), d = plan.column(k);
      const int64_t t = t0 + token;
      [[maybe_unused]] uint4 rows[kCombine ? H + 1 : 1];
      if constexpr (kCombine) {
        if (k % plan.per_lane == 0 && token < count)
#pragma unroll
          for (int h = 0; h < H; ++h) po[h] = post[t * H + h];  // written before the barrier above
#pragma unroll
        for (int i = 0; i <= H; ++i) rows[i] = grad_rows[i];
        load_grad_rows(k + 1);
      }
      if (token < count && d < D) {
        const uint4* slot = ring + k % kCollapseSlots * H * kThreads + threadIdx.x;
        float v[H][8], out[8];
#pragma unroll
        for (int h = 0; h < H; ++h)
          load<8>(reinterpret_cast<const __nv_bfloat16*>(slot + h * kThreads), v[h]);
        collapse_columns<H, 8>(v, pre_s + token * H, out);
#pragma unroll
        for (int j = 0; j < 8; ++j) {
          out[j] = __bfloat162float(__float2bfloat16(out[j]));  // the norm reads the stored value
          squares = fmaf(out[j], out[j], squares);
        }
        store<8>(collapsed + t * D + d, out);
        if constexpr (kCombine) {
          float yv[8], dyv[8] = {};
          load<8>(reinterpret_cast<const __nv_bfloat16*>(&rows[H]), yv);
#pragma unroll
          for (int h = 0; h < H; ++h) {
            float g[8];
            load<8>(reinterpret_cast<const __nv_bfloat16*>(&rows[h]), g);
#pragma unroll
            for (int e = 0; e < 8; ++e) dyv[e] = fmaf(po[h], g[e], dyv[e]);
#pragma unroll
            for (int e = 0; e < 8; ++e) d_post[h] = fmaf(g[e], yv[e], d_post[h]);
#pragma unroll
            for (int j = 0; j < H; ++j)
#pragma unroll
              for (int e = 0; e < 8; ++e) d_comb[j * H + h] = fmaf(g[e], v[j][e], d_comb[j * H + h]);
          }
          store<8>(grad.dy + t * D + d, dyv);
        }
      }
      if (k % plan.per_lane != plan.per_lane - 1) continue;
      // The warp's token is complete (the same token and branch for every lane).
      if (norm.normed != nullptr) {
        const float sum = warp_sum(squares);
        if (token < count) store_normed(collapsed + t * D, sum, D, plan, norm, norm.normed + t * D);
      }
      squares = 0.0f;
      if constexpr (kCombine) {
#pragma unroll
        for (int i = 0; i < H * H; ++i) {
          const float sum = warp_sum(d_comb[i]);
          if (lane == 0 && token < count) grad.d_comb[t * H * H + i] = sum;
          d_comb[i] = 0.0f;
        }
#pragma unroll
        for (int h = 0; h < H; ++h) {
          const float sum = warp_sum(d_post[h]);
          if (lane == 0 && token < count) grad.d_post[t * H + h] = sum;
          d_post[h] = 0.0f;
        }
      }
    }
    copy_wait<0>();  // only empty groups are left
    return;
  }
  for (int e = threadIdx.x; e < count * D; e += kThreads) {
    const int tt = e / D, d = e % D;
    float v[H][1], acc[1];
#pragma unroll
    for (int h = 0; h < H; ++h) v[h][0] = __bfloat162float(x[static_cast<int64_t>(tt) * K + h * D + d]);
    collapse_columns<H, 1>(v, pre_s + tt * H, acc);
    collapsed[(t0 + tt) * D + d] = __float2bfloat16(acc[0]);
  }
}

// One warp per token (8 per block), V consecutive elements per lane at a time.
template <int H, int V>
__global__ void __launch_bounds__(kThreads)
    hc_combine_kernel(const __nv_bfloat16* streams, const __nv_bfloat16* y, const float* post,
                      const float* comb, __nv_bfloat16* out, int64_t tokens, int64_t D) {
  wait_for_earlier_kernels();
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

// hc_combine of a 64-token tile and the next site's mix of its output in one pass (hc_mult 4): the
// combine's output is the next site's streams, so the mix's product reads it from shared memory where
// it was just written instead of from DRAM in the next site's hc_coefficients. Per slice of kMixColumns
// columns of each stream (kSlice values of k, the mix's slice), through a ring of kCombineStages
// stages by cp.async: thread (token tid / 4, 8 columns (tid % 4) 8 ..) copies its columns of the 4
// streams into the stage's x tile and of y into the tile's padding columns, combines them in place
// exactly as hc_combine_kernel does (its own copies: no barrier first), stores them to `out`, and
// after the slice's barrier the warps multiply the tile by fn's split slice (mix_slice) while two
// more slices load. (The next slice's inputs in registers, one slice a tile in flight, ran at 2.3
// TB/s: too few bytes in flight for the DRAM's latency.)
constexpr int kMixColumns = kSlice / 4;
constexpr int kCombineStages = 3;
static_assert(kXStride - kSlice >= kMixColumns, "y's slice in the x tile's padding columns");

// copy16 telling the L2 to fetch the source's whole 128-byte line: hc_combine_mix reads each row's
// line in two slices, so the DRAM sees whole lines and the second slice finds its half in the L2.
__device__ __forceinline__ void copy16_line(void* dst, const void* src, bool valid) {
  asm volatile("cp.async.cg.shared.global.L2::128B [%0], [%1], 16, %2;\n" ::"r"(shared_address(dst)),
               "l"(src), "r"(valid ? 16 : 0)
               : "memory");
}

// hc_combine_mix_kernel's shared memory: the ring (each stage the x tile, then fn's split slice as
// Tile's), raw [64, M + 1], then the tile's post [64, H] and comb [64, H, H].
template <int H>
struct CombineMixTile {
  static constexpr size_t kRawOffset = kCombineStages * Tile<H>::kStageBytes;
  static constexpr size_t kPostOffset = kRawOffset + kTileTokens * (Tile<H>::M + 1) * sizeof(float);
  static constexpr size_t kBytes = kPostOffset + kTileTokens * (H + H * H) * sizeof(float);
  static_assert(2 * (kBytes + 1024) <= 228 * 1024, "two blocks an SM (228 KiB, 1 KiB reserved a block)");
};

template <int H>
__global__ void __launch_bounds__(kThreads, 2)
    hc_combine_mix_kernel(const __nv_bfloat16* streams, const __nv_bfloat16* y, const float* post,
                          const float* comb, __nv_bfloat16* out, const uint32_t* fn_next, float* mix,
                          int64_t tokens, int D) {
  wait_for_earlier_kernels();
  static_assert(H * kMixColumns == kSlice && kTileTokens * H == kThreads, "a thread per token and 8 columns");
  using T = Tile<H>;
  using L = CombineMixTile<H>;
  constexpr int M = T::M;
  extern __shared__ float4 shared_words[];
  unsigned char* smem = reinterpret_cast<unsigned char*>(shared_words);
  const int64_t t0 = static_cast<int64_t>(blockIdx.x) * kTileTokens;
  const int count = static_cast<int>(tokens - t0 < kTileTokens ? tokens - t0 : kTileTokens);
  const int K = H * D, slices = D / kMixColumns;
  const int tt = static_cast<int>(threadIdx.x) / 4, cc = static_cast<int>(threadIdx.x) % 4 * 8;
  const bool live = tt < count;
  const int64_t t = t0 + (live ? tt : 0);
  const __nv_bfloat16* x = streams + t * K + cc;
  const __nv_bfloat16* yr = y + t * D + cc;
  // Slice `slice` into its stage as one commit group (empty past the last slice): the thread's own
  // columns of the streams at kk = j 32 + c and of y at kSlice + c (zeros past the tokens), and its
  // share of fn's columns of this slice of every stream.
  const auto stage = [&](int slice) {
    unsigned char* buf = smem + slice % kCombineStages * T::kStageBytes;
    if (slice < slices) {
      const int d = slice * kMixColumns;
      __nv_bfloat16* row = reinterpret_cast<__nv_bfloat16*>(buf) + tt * kXStride + cc;
#pragma unroll
      for (int j = 0; j < H; ++j) copy16_line(row + j * kMixColumns, x + j * D + d, live);
      copy16_line(row + kSlice, yr + d, live);
      uint32_t* fs = reinterpret_cast<uint32_t*>(buf + T::kXBytes);
      for (int e = threadIdx.x; e < T::NT * 8 * kSlice / 4; e += kThreads) {
        const int o = e / (kSlice / 4), kk = e % (kSlice / 4) * 4;
        const int64_t k = static_cast<int64_t>(kk / kMixColumns) * D + d + kk % kMixColumns;
        copy16(fs + o * kFStride + kk, o < M ? fn_next + o * static_cast<int64_t>(K) + k : fn_next, o < M);
      }
    }
    copy_commit();
  };
#pragma unroll
  for (int s = 0; s < kCombineStages - 1; ++s) stage(s);
  // The tile's post and comb in shared memory (in registers they spill).
  float* post_s = reinterpret_cast<float*>(smem + L::kPostOffset);
  float* comb_s = post_s + kTileTokens * H;
  for (int e = threadIdx.x; e < count * H; e += kThreads) post_s[e] = post[t0 * H + e];
  for (int e = threadIdx.x; e < count * H * H; e += kThreads) comb_s[e] = comb[t0 * H * H + e];
  const float* po = post_s + tt * H;
  const float* cm = comb_s + tt * H * H;  // cm[j H + h]: stream j's weight in output stream h
  __syncthreads();                        // post and comb are in
  MixAccumulators<H> m;
  for (int s = 0; s < slices; ++s) {
    unsigned char* buf = smem + s % kCombineStages * T::kStageBytes;
    __nv_bfloat16* xs = reinterpret_cast<__nv_bfloat16*>(buf);
    copy_wait<kCombineStages - 2>();  // this thread's copies of slice s have landed
    if (live) {                       // past the tokens the rows stay the copies' zeros
      __nv_bfloat16* row = xs + tt * kXStride + cc;
      float xf[H][8], yf[8];
#pragma unroll
      for (int j = 0; j < H; ++j) load<8>(row + j * kMixColumns, xf[j]);
      load<8>(row + kSlice, yf);
#pragma unroll
      for (int h = 0; h < H; ++h) {
        float acc[8];
#pragma unroll
        for (int e = 0; e < 8; ++e) {
          acc[e] = po[h] * yf[e];
#pragma unroll
          for (int j = 0; j < H; ++j) acc[e] = fmaf(cm[j * H + h], xf[j][e], acc[e]);
        }
        store<8>(row + h * kMixColumns, acc);
        store<8>(out + t * K + h * D + s * kMixColumns + cc, acc);
      }
    }
    __syncthreads();  // everyone's rows and copies of fn's slice are in; nobody reads slice s - 1 any more
    stage(s + kCombineStages - 1);
    mix_slice<H>(xs, reinterpret_cast<const uint32_t*>(buf + T::kXBytes), m);
  }
  copy_wait<0>();  // only empty groups are left
  float* raw = reinterpret_cast<float*>(smem + L::kRawOffset);
  store_mix<H>(m, raw);
  for (int e = threadIdx.x; e < count * (M + 1); e += kThreads) mix[t0 * (M + 1) + e] = raw[e];
}

// One warp per token (8 per block), V consecutive elements per lane at a time; d_comb is a warp sum.
// dstreams is written, not accumulated: the first gradient of a site's streams, so that no pass
// zeroes it and this one does not read it (a quarter of the site backward's stream bytes).
// kPost: also d_post[t, h] = dout[t, h, :] . y[t, :] (hc_post_gradient's work) while dout is at
// hand, when y is known already. Up to H = 4 each step loads all its rows (dout, x and y: one
// 16-byte access each at V = 8) before its first store, which the loads could not pass: with dout
// in bf16 as many bytes are in flight as its fp32 rows alone were. Past 4 the x rows come one at a
// time (all of them would not fit the registers), after the H rows of dout.
template <int H, int V, bool kPost>
__global__ void __launch_bounds__(kThreads)
    hc_combine_backward_kernel(const __nv_bfloat16* streams, const float* post, const float* comb,
                               const __nv_bfloat16* dout, const __nv_bfloat16* y, __nv_bfloat16* dstreams,
                               __nv_bfloat16* dy, float* d_comb, float* d_post, int64_t tokens, int64_t D) {
  wait_for_earlier_kernels();
  constexpr int N = H * H;  // d_comb [j * H + h]
  const int64_t t = static_cast<int64_t>(blockIdx.x) * kWarps + threadIdx.x / 32;
  if (t >= tokens) return;
  const int lane = threadIdx.x % 32;
  float po[H], cm[H][H], v[N], vp[H];
#pragma unroll
  for (int h = 0; h < H; ++h) {
    po[h] = post[t * H + h];
    vp[h] = 0.0f;
#pragma unroll
    for (int j = 0; j < H; ++j) cm[j][h] = comb[t * H * H + j * H + h];
  }
#pragma unroll
  for (int k = 0; k < N; ++k) v[k] = 0.0f;
  const __nv_bfloat16* x = streams + t * H * D;
  const __nv_bfloat16* g = dout + t * H * D;
  const bool write_streams = dstreams != nullptr;  // else the coefficients' stream pass adds this part
  constexpr bool kRowsFirst = H <= 4;
  for (int64_t d = lane * V; d < D; d += 32 * V) {
    float gv[H][V], xv[H][V], yv[V], dyv[V];
#pragma unroll
    for (int h = 0; h < H; ++h) load<V>(g + h * D + d, gv[h]);
#pragma unroll
    for (int j = 0; j < H; ++j)
      if constexpr (kRowsFirst) load<V>(x + j * D + d, xv[j]);
    if constexpr (kPost) load<V>(y + t * D + d, yv);
#pragma unroll
    for (int e = 0; e < V; ++e) {
      dyv[e] = 0.0f;
#pragma unroll
      for (int h = 0; h < H; ++h) dyv[e] = fmaf(po[h], gv[h][e], dyv[e]);
    }
    store<V>(dy + t * D + d, dyv);
    if constexpr (kPost) {
#pragma unroll
      for (int h = 0; h < H; ++h)
#pragma unroll
        for (int e = 0; e < V; ++e) vp[h] = fmaf(gv[h][e], yv[e], vp[h]);
    }
#pragma unroll
    for (int j = 0; j < H; ++j) {
      if constexpr (!kRowsFirst) load<V>(x + j * D + d, xv[j]);
#pragma unroll
      for (int e = 0; e < V; ++e)
#pragma unroll
        for (int h = 0; h < H; ++h) v[j * H + h] = fmaf(gv[h][e], xv[j][e], v[j * H + h]);
      if (write_streams) {
        float acc[V];
#pragma unroll
        for (int e = 0; e < V; ++e) {
          acc[e] = 0.0f;
#pragma unroll
          for (int h = 0; h < H; ++h) acc[e] = fmaf(cm[j][h], gv[h][e], acc[e]);
        }
        store<V>(dstreams + (t * H + j) * D + d, acc);
      }
    }
  }
#pragma unroll
  for (int k = 0; k < N; ++k) {
    const float sum = warp_sum(v[k]);
    if (lane == 0) d_comb[t * H * H + k] = sum;
  }
  if constexpr (kPost) {
#pragma unroll
    for (int h = 0; h < H; ++h) {
      const float sum = warp_sum(vp[h]);
      if (lane == 0) d_post[t * H + h] = sum;
    }
  }
}

// d_post[t, h] = dout[t, h, :] . y[t, :]: one warp per token. Two steps unrolled: their loads (no
// stores between) in flight together, as many bytes as one step's with dout in fp32.
template <int H, int V>
__global__ void __launch_bounds__(kThreads)
    hc_post_gradient_kernel(const __nv_bfloat16* y, const __nv_bfloat16* dout, float* d_post, int64_t tokens,
                            int64_t D) {
  wait_for_earlier_kernels();
  const int64_t t = static_cast<int64_t>(blockIdx.x) * kWarps + threadIdx.x / 32;
  if (t >= tokens) return;
  const int lane = threadIdx.x % 32;
  float v[H];
#pragma unroll
  for (int h = 0; h < H; ++h) v[h] = 0.0f;
  const __nv_bfloat16* g = dout + t * H * D;
#pragma unroll 2
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

// The stream gradient, a pass of its own after hc_coefficients_backward_kernel has left each token's
// w = dm inv [M], corr and pre [H] in the workspace: dx[t, h, d] = g + dn[t, i] - x[t, i] corr[t] +
// pre[t, h] dcol[t, d] with dn = w fn (i = h D + d), where g is dx itself (accumulated) or, given
// the site's comb and dout, hc_combine's part sum_k comb[t, h, k] dout[t, k, d] (dx written once:
// hc_combine_backward then leaves dx alone). A block takes kStreamColumns<H, V> columns d of every
// stream of a run of tokens, so that each dout value is read once and used by the H streams'
// threads; thread (h, d) owns V adjacent columns with their fn [M] in registers, w comes from shared
// memory (broadcast). This pass moves most of the backward's bytes (dx or dout in, dx out, bf16),
// and fn leaves the registers little room for loads in flight: the rows (and each token's w, corr
// and pre) come through a ring of shared-memory stages of kStreamRows tokens by cp.async instead
// (two stages loading while one is used). The grid is one wave of runs (column blocks times runs of
// tokens), each block's ring running on along its run: blocks of 64-token tiles in many waves paid
// fn's loads, w's staging and the ring's filling and draining once a tile, 0.54 ms at 16k tokens
// where the bytes take 0.33.
constexpr int kStreamRows = 8;    // tokens per stage
constexpr int kStreamStages = 3;  // stages in the ring

// Columns d per block for H streams at V a thread: the block's threads over the H streams, in
// multiples of 8 (whole 16-byte copies of bf16).
template <int H, int V>
constexpr int kStreamColumns = kThreads* V / H / 8 * 8;

// A stage: g [rows, H, C] (dx or dout), x [rows, H, C], dcol [rows, C] (all bf16), comb [rows, H, H]
// fp32 (C = kStreamColumns), and the rows' w, corr and pre [rows, kInputStride] (see there).
template <int H, int V>
struct StreamStage {
  static constexpr int C = kStreamColumns<H, V>;
  static constexpr size_t kXOffset = kStreamRows * H * C * sizeof(__nv_bfloat16);
  static constexpr size_t kColOffset = kXOffset + kStreamRows * H * C * sizeof(__nv_bfloat16);
  static constexpr size_t kCombOffset = kColOffset + kStreamRows * C * sizeof(__nv_bfloat16);
  static constexpr size_t kWOffset = kCombOffset + kStreamRows * H * H * sizeof(float);
  static constexpr size_t kBytes = kWOffset + kStreamRows * kInputStride<H> * sizeof(float);
  static constexpr size_t kRingBytes = kStreamStages * kBytes;
  static_assert(kXOffset % 16 == 0 && kColOffset % 16 == 0 && kCombOffset % 16 == 0 && kWOffset % 16 == 0,
                "16-byte aligned rows");
};

// Stages rows [r0, r0 + kStreamRows) of the run of `count` tokens from t0: g's, x's and dcol's
// columns [d0, d0 + C) of every stream, each token's row of w, corr and pre (kInputStride, from
// `workspace`), and its comb when given, into buf: zeros past the run and past D, as one commit
// group. `vec` (D % 8 == 0, 16-byte aligned rows): g, x and dcol by cp.async of 8 columns; else by
// plain loads. The kernel's own pointers and t0, not the run's: pointers of the run's would each
// hold two registers through the kernel.
template <int H, int V>
__device__ void stage_stream_rows(const __nv_bfloat16* g, const __nv_bfloat16* x, const __nv_bfloat16* dcol,
                                  const float* comb, const float* workspace, int64_t t0, int count, int D,
                                  int d0, int r0, bool vec, unsigned char* buf) {
  using S = StreamStage<H, V>;
  constexpr int C = S::C;
  const int K = H * D;
  // The stage's first rows; offsets from them are ints (8 rows of at most 2^24 elements).
  const int64_t first = t0 + r0;
  const __nv_bfloat16* g_rows = g + first * K;
  const __nv_bfloat16* x_rows = x + first * K;
  const __nv_bfloat16* col_rows = dcol + first * D;
  __nv_bfloat16* gs = reinterpret_cast<__nv_bfloat16*>(buf);
  __nv_bfloat16* xs = reinterpret_cast<__nv_bfloat16*>(buf + S::kXOffset);
  __nv_bfloat16* cs = reinterpret_cast<__nv_bfloat16*>(buf + S::kColOffset);
  if (vec) {
    for (int e = threadIdx.x; e < kStreamRows * H * C / 8; e += kThreads) {
      const int r = e / (H * C / 8), h = e / (C / 8) % H, c = e % (C / 8) * 8, d = d0 + c;
      const bool valid = r0 + r < count && d < D;
      const int offset = (r * H + h) * C + c;
      copy16(gs + offset, valid ? g_rows + (r * K + h * D + d) : g, valid);
      copy16(xs + offset, valid ? x_rows + (r * K + h * D + d) : x, valid);
    }
    for (int e = threadIdx.x; e < kStreamRows * C / 8; e += kThreads) {
      const int r = e / (C / 8), c = e % (C / 8) * 8, d = d0 + c;
      const bool valid = r0 + r < count && d < D;
      copy16(cs + r * C + c, valid ? col_rows + (r * D + d) : dcol, valid);
    }
  } else {
    for (int e = threadIdx.x; e < kStreamRows * H * C; e += kThreads) {
      const int r = e / (H * C), h = e / C % H, c = e % C, d = d0 + c;
      const bool valid = r0 + r < count && d < D;
      gs[e] = valid ? g_rows[r * K + h * D + d] : __float2bfloat16(0.0f);
      xs[e] = valid ? x_rows[r * K + h * D + d] : __float2bfloat16(0.0f);
    }
    for (int e = threadIdx.x; e < kStreamRows * C; e += kThreads) {
      const int r = e / C, c = e % C, d = d0 + c;
      cs[e] = r0 + r < count && d < D ? col_rows[r * D + d] : __float2bfloat16(0.0f);
    }
  }
  // The workspace's rows as they are (16-byte aligned: hc_coefficients_backward checks).
  constexpr int kRowCopies = kInputStride<H> / 4;
  float* ws = reinterpret_cast<float*>(buf + S::kWOffset);
  const float* w_rows = workspace + first * kInputStride<H>;
  for (int e = threadIdx.x; e < kStreamRows * kRowCopies; e += kThreads) {
    const bool valid = r0 + e / kRowCopies < count;
    copy16(ws + 4 * e, valid ? w_rows + 4 * e : workspace, valid);
  }
  if (comb != nullptr) {
    // A stage's comb rows are contiguous and start 16-byte aligned (first is a multiple of
    // kStreamRows, comb checked); float4s of them where none straddles two rows.
    constexpr int kWidth = H * H % 4 == 0 ? 4 : 1;
    float* ms = reinterpret_cast<float*>(buf + S::kCombOffset);
    for (int e = threadIdx.x * kWidth; e < kStreamRows * H * H; e += kThreads * kWidth) {
      const bool valid = r0 + e / (H * H) < count;
      if constexpr (kWidth == 4)
        copy16(ms + e, valid ? comb + first * H * H + e : comb, valid);
      else
        copy4(ms + e, valid ? comb + first * H * H + e : comb, valid);
    }
  }
  copy_commit();  // every call commits a group, so that the ring's wait counts stay fixed
}

// Runs of `run_tokens` tokens (a multiple of kStreamRows, at most 2^30), one per blockIdx.y.
template <int H, int V>
__global__ void __launch_bounds__(kThreads, H <= 4 ? 2 : 1)
    hc_stream_gradient_kernel(const __nv_bfloat16* streams, const __nv_bfloat16* d_collapsed, const float* fn,
                              const float* workspace, const float* comb, const __nv_bfloat16* dout,
                              __nv_bfloat16* dstreams, int64_t tokens, int D, int run_tokens, bool vec) {
  wait_for_earlier_kernels();
  using S = StreamStage<H, V>;
  constexpr int M = Tile<H>::M, MP = kWStride<H>, C = S::C;
  extern __shared__ float4 shared_words[];
  unsigned char* ring = reinterpret_cast<unsigned char*>(shared_words);
  const int K = H * D;
  const int64_t t0 = static_cast<int64_t>(blockIdx.y) * run_tokens;
  const int count = static_cast<int>(tokens - t0 < run_tokens ? tokens - t0 : run_tokens);
  const int d0 = static_cast<int>(blockIdx.x) * C;
  const bool fused = comb != nullptr;
  const __nv_bfloat16* g = fused ? dout : dstreams;
  // V > 1 is launched only where vec: the plain loads' path compiled out (its registers spilled).
  const bool by_copies = V > 1 || vec;
  const auto stage = [&](int s) {
    stage_stream_rows<H, V>(g, streams, d_collapsed, comb, workspace, t0, count, D, d0, s * kStreamRows,
                            by_copies, ring + s % kStreamStages * S::kBytes);
  };
#pragma unroll
  for (int s = 0; s < kStreamStages - 1; ++s) stage(s);

  const int h = static_cast<int>(threadIdx.x) / (C / V), c = static_cast<int>(threadIdx.x) % (C / V) * V;
  const bool mine = h < H && d0 + c < D;
  const int64_t i = static_cast<int64_t>(h) * D + d0 + c;  // the thread's first column of dx
  float f[MP][V];
#pragma unroll
  for (int o = 0; o < MP; ++o) {
    if (o < M && mine) {
      load<V>(fn + static_cast<int64_t>(o) * K + i, f[o]);
    } else {
#pragma unroll
      for (int v = 0; v < V; ++v) f[o][v] = 0.0f;
    }
  }

  __nv_bfloat16* dx = dstreams + t0 * K + i;
  const int stages = (count + kStreamRows - 1) / kStreamRows;
  for (int s = 0; s < stages; ++s) {
    copy_wait<kStreamStages - 2>();  // this thread's copies of stage s have landed
    __syncthreads();                 // everyone's have; stage s - 1 is no longer read
    stage(s + kStreamStages - 1);
    if (!mine) continue;
    const unsigned char* buf = ring + s % kStreamStages * S::kBytes;
    const __nv_bfloat16* gs = reinterpret_cast<const __nv_bfloat16*>(buf);
    const __nv_bfloat16* xs = reinterpret_cast<const __nv_bfloat16*>(buf + S::kXOffset);
    const __nv_bfloat16* cs = reinterpret_cast<const __nv_bfloat16*>(buf + S::kColOffset);
    const float* ms = reinterpret_cast<const float*>(buf + S::kCombOffset);
    const float* ws = reinterpret_cast<const float*>(buf + S::kWOffset);
#pragma unroll 1
    for (int r = 0; r < kStreamRows; ++r) {
      const int tt = s * kStreamRows + r;
      if (tt >= count) break;
      const float* wr = ws + r * kInputStride<H>;
      float dn[V] = {};
#pragma unroll
      for (int o = 0; o < MP; o += 4) {
        const float4 q = *reinterpret_cast<const float4*>(wr + o);
#pragma unroll
        for (int v = 0; v < V; ++v)
          dn[v] = fmaf(q.x, f[o][v],
                       fmaf(q.y, f[o + 1][v], fmaf(q.z, f[o + 2][v], fmaf(q.w, f[o + 3][v], dn[v]))));
      }
      float gv[V] = {}, xv[V], cv[V];
      if (fused) {
#pragma unroll
        for (int k = 0; k < H; ++k) {
          float gk[V];
          load<V>(gs + (r * H + k) * C + c, gk);
          const float weight = ms[(r * H + h) * H + k];
#pragma unroll
          for (int v = 0; v < V; ++v) gv[v] = fmaf(weight, gk[v], gv[v]);
        }
      } else {
        load<V>(gs + (r * H + h) * C + c, gv);
      }
      load<V>(xs + (r * H + h) * C + c, xv);
      load<V>(cs + r * C + c, cv);
      const float corr = wr[MP], ph = wr[MP + 1 + h];
      float out[V];
#pragma unroll
      for (int v = 0; v < V; ++v) out[v] = gv[v] + dn[v] - xv[v] * corr + ph * cv[v];
      store_global<V>(dx + static_cast<int64_t>(tt) * K, out);  // one access: store<V> made V here
    }
  }
  copy_wait<0>();
}

// Per tile: the mix (kept by hc_coefficients), the dots dpre[h] = sum_d dcol[d] x[h, d], the Sinkhorn passes
// forward and back (threads 0 .. sinkhorn_threads - 1, one token each at a time), d_pre/d_post/d_comb (and
// the collapse) back to the mix gradient dm. Adds the tile's dbase and dscale, and leaves w = dm inv, corr =
// inv^3 (dm . raw) / (H D) and pre in the workspace (kInputStride) for hc_dfn_kernel and
// hc_stream_gradient_kernel: dstreams += w fn - x corr + pre[h] dcol, the RMS-norm and collapse paths.
// The Sinkhorn warps take the comb's and post's gradients (all but dpre's part) while the other warps
// stream the dots, which all warps then finish, claiming tokens one at a time: the DRAM keeps working
// during the Sinkhorn passes (one wave of tiles: they ran between the dots and the DRAM idled).
template <int H>
__global__ void __launch_bounds__(kThreads, H <= 4 ? 2 : 1)
    hc_coefficients_backward_kernel(const __nv_bfloat16* streams, const float* mix, const float* base,
                                    const float* scale, const float* d_pre, const float* d_post,
                                    const float* d_comb, const __nv_bfloat16* d_collapsed, float* dbase,
                                    float* dscale, float* workspace, int64_t tokens, int D, float rms_eps,
                                    float hc_eps, int iters, int sinkhorn_threads, bool vec) {
  wait_for_earlier_kernels();
  using T = Tile<H, Ring::kNone>;
  constexpr int M = T::M, HH = T::HH;
  extern __shared__ float4 shared_words[];
  __shared__ int next_token;  // the dots' next token to claim
  unsigned char* smem = reinterpret_cast<unsigned char*>(shared_words);
  float* raw = reinterpret_cast<float*>(smem + T::kRawOffset);
  float* dpre_s = reinterpret_cast<float*>(smem + T::kCommonBytes);  // [64, H]
  float* dbase_s = dpre_s + kTileTokens * H;                         // [M]
  float* dscale_s = dbase_s + M;                                     // [3]
  float* g_s = dscale_s + 3;               // [64, M]: the Sinkhorn's gradients of the mix's outputs H ..
  float* scratch = g_s + kTileTokens * M;  // per Sinkhorn thread
  __nv_bfloat16* w_hi_t = split_w_transposed<H>(workspace, tokens);
  const int passes = 2 * iters - 1;
  const int64_t t0 = static_cast<int64_t>(blockIdx.x) * kTileTokens;
  const int count = static_cast<int>(tokens - t0 < kTileTokens ? tokens - t0 : kTileTokens);
  const int K = H * D;
  const __nv_bfloat16* x = streams + t0 * K;
  const __nv_bfloat16* dcol = d_collapsed + t0 * D;
  const bool sinkhorn = static_cast<int>(threadIdx.x) < sinkhorn_threads;  // whole warps
  // Only the Sinkhorn warps read the mix: they copy it, then wait for one another alone.
  if (sinkhorn) load_mix<H>(mix, t0, count, raw, sinkhorn_threads);
  if (threadIdx.x == 0) next_token = 0;
  for (int o = threadIdx.x; o < M + 3; o += kThreads) dbase_s[o] = 0.0f;  // and dscale_s
  __syncthreads();

  if (sinkhorn) {
    copy_wait<0>();
    asm volatile("bar.sync 1, %0;\n" ::"r"(sinkhorn_threads) : "memory");  // everyone's mix rows are in
    // The Sinkhorn backward, one token per thread with its matrices in registers (the forward's
    // normalize_lines), in rounds of sinkhorn_threads tokens; each pass's line sums + eps in scratch,
    // an odd stride between threads keeping their stores in distinct banks.
    float* sums = scratch + threadIdx.x * (passes * H + 1);
    for (int round = 0; round < count; round += sinkhorn_threads) {
      const int tt = round + static_cast<int>(threadIdx.x);
      if (tt >= count) break;
      const int64_t t = t0 + tt;
      const float* r = raw + tt * (M + 1);
      const float inv = rsqrtf(r[M] / static_cast<float>(K) + rms_eps);
      // Forward again: the comb softmax p, then the passes, keeping their sums.
      float p[H][H], c[H][H], dc[H][H];
      comb_softmax<H>(r, inv, scale[2], base, p);
#pragma unroll
      for (int i = 0; i < H; ++i)
#pragma unroll
        for (int j = 0; j < H; ++j) {
          c[i][j] = p[i][j] + hc_eps;
          dc[i][j] = d_comb[t * HH + i * H + j];
        }
      normalize_lines<H, true>(c, hc_eps, sums);
      for (int it = 1; it < iters; ++it) {
        normalize_lines<H, false>(c, hc_eps, sums + (2 * it - 1) * H);
        normalize_lines<H, true>(c, hc_eps, sums + 2 * it * H);
      }
      // Back through the passes, rebuilding each pass's input from its output.
      for (int it = iters - 1; it >= 1; --it) {
        normalize_lines_backward<H, true>(c, dc, sums + 2 * it * H);
        normalize_lines_backward<H, false>(c, dc, sums + (2 * it - 1) * H);
      }
      normalize_lines_backward<H, true>(c, dc, sums);
      // dc is now the gradient of p + eps: back through the row softmax, and post's part.
      float* g = g_s + tt * M;
#pragma unroll
      for (int i = 0; i < H; ++i) {
        float dot = 0.0f;
#pragma unroll
        for (int j = 0; j < H; ++j) dot = fmaf(p[i][j], dc[i][j], dot);
#pragma unroll
        for (int j = 0; j < H; ++j) g[2 * H + i * H + j] = p[i][j] * (dc[i][j] - dot);
      }
#pragma unroll
      for (int h = 0; h < H; ++h) {
        const float so = sigmoid(r[H + h] * inv * scale[1] + base[H + h]);
        g[H + h] = d_post[t * H + h] * 2.0f * so * (1.0f - so);
      }
    }
  }

  const int lane = threadIdx.x % 32;
  for (;;) {
    int tt = 0;
    if (lane == 0) tt = atomicAdd(&next_token, 1);
    tt = __shfl_sync(0xffffffffu, tt, 0);
    if (tt >= count) break;
    float v[H];
#pragma unroll
    for (int h = 0; h < H; ++h) v[h] = 0.0f;
    if (vec) {
#pragma unroll 2
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
  __syncthreads();

  // pre's part from the dots, then every output's gradient back to dm, in rounds as above (whole
  // warps, for the warp sums; absent tokens add zeros).
  if (sinkhorn) {
    for (int round = 0; round < count; round += sinkhorn_threads) {
      const int tt = round + static_cast<int>(threadIdx.x);
      const bool live = tt < count;
      const int64_t t = t0 + (live ? tt : 0);
      const float* r = raw + (live ? tt : 0) * (M + 1);
      const float inv = rsqrtf(r[M] / static_cast<float>(K) + rms_eps);
      float g[M];
#pragma unroll
      for (int h = 0; h < H; ++h) {
        const float sp = sigmoid(r[h] * inv * scale[0] + base[h]);
        g[h] = live ? dpre_s[tt * H + h] * sp * (1.0f - sp) : 0.0f;
        if (live) workspace[t * kInputStride<H> + kWStride<H> + 1 + h] = sp + hc_eps;
      }
#pragma unroll
      for (int o = H; o < M; ++o) g[o] = live ? g_s[tt * M + o] : 0.0f;
      float dot = 0.0f;  // dm . raw, for the RMS factor's gradient
      float ds[3] = {};  // dscale's three parts
#pragma unroll
      for (int o = 0; o < M; ++o) {
        const float dm = g[o] * scale[group_of<H>(o)];
        dot = fmaf(dm, r[o], dot);
        ds[group_of<H>(o)] += g[o] * r[o] * inv;
        if (live) {
          const float w = dm * inv;
          workspace[t * kInputStride<H> + o] = w;
          const Bf16Split split = split_bf16(w);
          w_hi_t[o * tokens + t] = split.hi;
          w_hi_t[(M + o) * tokens + t] = split.lo;
        }
        const float sum = warp_sum(g[o]);
        if (lane == 0) atomicAdd(dbase_s + o, sum);
      }
#pragma unroll
      for (int k = 0; k < 3; ++k) {
        const float sum = warp_sum(ds[k]);
        if (lane == 0) atomicAdd(dscale_s + k, sum);
      }
      if (live) {
        for (int o = M; o < kWStride<H>; ++o) workspace[t * kInputStride<H> + o] = 0.0f;
        workspace[t * kInputStride<H> + kWStride<H>] = inv * inv * inv * dot / static_cast<float>(K);
      }
    }
  }
  __syncthreads();

  for (int o = threadIdx.x; o < M; o += kThreads) atomicAdd(dbase + o, dbase_s[o]);
  if (threadIdx.x < 3) atomicAdd(dscale + threadIdx.x, dscale_s[threadIdx.x]);
}

constexpr int kDfnColumns = 128;  // columns of x and dfn per block: two 8-column MMA tiles per warp
constexpr int kDfnChunk = 64;     // tokens per stage: four k16 steps
constexpr int kDfnChunks = 16;    // 1024 tokens per block: one atomic per dfn entry per 1024 tokens
constexpr int kDfnStages = 3;     // stages in the ring: two loading while one is multiplied
// ldmatrix reads 8 rows of 16 bytes at once: strides of 16 mod 128 bytes put them in distinct banks.
constexpr int kDfnXStride = kDfnColumns + 8;  // bf16
constexpr int kDfnWStride = kDfnChunk + 8;    // bf16

// Shared-memory layout of hc_dfn_kernel: a ring of stages, each x [64, 128] bf16 and w^T's hi and lo
// [16 MT, 64] bf16 (the A operand, zeros past M and past the tokens).
template <int H>
struct DfnTile {
  static constexpr int M = (2 + H) * H;
  static constexpr int MT = (M + 15) / 16;  // MMA row tiles of dfn
  static constexpr size_t kXBytes = kDfnChunk * kDfnXStride * sizeof(__nv_bfloat16);
  static constexpr size_t kWBytes = MT * 16 * kDfnWStride * sizeof(__nv_bfloat16);  // each of hi, lo
  static constexpr size_t kStageBytes = kXBytes + 2 * kWBytes;
  static constexpr size_t kBytes = kDfnStages * kStageBytes;
  static_assert(kXBytes % 16 == 0 && kWBytes % 16 == 0, "stages must be 16-byte aligned");
};

// Stages chunk [t0, t0 + 64) of x's columns [i0, i0 + 128) and of w^T's split rows (zeros past the
// ends), as one commit group (empty past the tokens). `vec` (flat % 8 == 0, tokens % 8 == 0, 16-byte
// aligned pointers): by cp.async; else plain loads.
template <int H>
__device__ void stage_dfn(const __nv_bfloat16* streams, const __nv_bfloat16* w_hi_t, int64_t tokens,
                          int64_t all_tokens, int64_t flat, int64_t t0, int64_t i0, bool vec,
                          unsigned char* buf) {
  using T = DfnTile<H>;
  constexpr int M = T::M, kRows = T::MT * 16;
  __nv_bfloat16* xs = reinterpret_cast<__nv_bfloat16*>(buf);
  __nv_bfloat16* hs = reinterpret_cast<__nv_bfloat16*>(buf + T::kXBytes);  // hi, then lo
  const int nt = static_cast<int>(tokens - t0 < kDfnChunk ? tokens - t0 : kDfnChunk);
  if (nt > 0 && vec) {
    for (int e = threadIdx.x; e < kDfnChunk * kDfnColumns / 8; e += kThreads) {
      const int tt = e / (kDfnColumns / 8), cc = e % (kDfnColumns / 8) * 8;
      const int64_t i = i0 + cc;
      const bool valid = tt < nt && i < flat;
      copy16(xs + tt * kDfnXStride + cc, valid ? streams + (t0 + tt) * flat + i : streams, valid);
    }
    for (int e = threadIdx.x; e < 2 * kRows * kDfnChunk / 8; e += kThreads) {
      const int half = e / (kRows * kDfnChunk / 8), o = e / (kDfnChunk / 8) % kRows,
                tt = e % (kDfnChunk / 8) * 8;
      const bool valid = o < M && tt < nt;
      copy16(hs + (half * kRows + o) * kDfnWStride + tt,
             valid ? w_hi_t + (half * M + o) * all_tokens + t0 + tt : w_hi_t, valid);
    }
  } else if (nt > 0) {
    for (int e = threadIdx.x; e < kDfnChunk * kDfnColumns; e += kThreads) {
      const int tt = e / kDfnColumns, cc = e % kDfnColumns;
      const int64_t i = i0 + cc;
      xs[tt * kDfnXStride + cc] =
          tt < nt && i < flat ? streams[(t0 + tt) * flat + i] : __float2bfloat16(0.0f);
    }
    for (int e = threadIdx.x; e < 2 * kRows * kDfnChunk; e += kThreads) {
      const int half = e / (kRows * kDfnChunk), o = e / kDfnChunk % kRows, tt = e % kDfnChunk;
      hs[(half * kRows + o) * kDfnWStride + tt] =
          o < M && tt < nt ? w_hi_t[(half * M + o) * all_tokens + t0 + tt] : __float2bfloat16(0.0f);
    }
  }
  copy_commit();  // every call commits a group, so that the ring's wait counts stay fixed
}

// dfn[o, i] += sum_t w[t, o] x[t, i] (w = dm inv, [tokens, M] in the workspace) for 128 columns and
// 1024 tokens per block: dfn^T's tile = x^T w on the tensor cores, w split in bf16 hi + lo (x is bf16
// already), so the sum keeps fp32 accuracy. Warp k owns columns 16 k .. 16 k + 15 and every row o.
template <int H>
__global__ void __launch_bounds__(kThreads, H <= 4 ? 2 : 1)
    hc_dfn_kernel(const __nv_bfloat16* streams, const float* workspace, float* dfn, int64_t tokens,
                  int64_t flat, bool vec) {
  wait_for_earlier_kernels();
  using T = DfnTile<H>;
  constexpr int M = T::M, MT = T::MT;
  extern __shared__ float4 shared_words[];
  unsigned char* smem = reinterpret_cast<unsigned char*>(shared_words);
  const __nv_bfloat16* w_hi_t = split_w_transposed<H>(workspace, tokens);
  const int64_t i0 = static_cast<int64_t>(blockIdx.x) * kDfnColumns;
  const int64_t first = static_cast<int64_t>(blockIdx.y) * kDfnChunk * kDfnChunks;
  const int64_t left = (tokens - first + kDfnChunk - 1) / kDfnChunk;
  const int chunks = static_cast<int>(left < kDfnChunks ? left : kDfnChunks);
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, c = lane % 4;
  float acc[MT][2][4] = {};
#pragma unroll
  for (int s = 0; s < kDfnStages - 1; ++s)
    stage_dfn<H>(streams, w_hi_t, s < chunks ? tokens : 0, tokens, flat, first + s * kDfnChunk, i0, vec,
                 smem + s * T::kStageBytes);
  for (int s = 0; s < chunks; ++s) {
    copy_wait<kDfnStages - 2>();  // this thread's copies of chunk s have landed
    __syncthreads();              // everyone's have; chunk s - 1 is no longer read
    const int next = s + kDfnStages - 1;
    stage_dfn<H>(streams, w_hi_t, next < chunks ? tokens : 0, tokens, flat, first + next * kDfnChunk, i0, vec,
                 smem + next % kDfnStages * T::kStageBytes);
    const unsigned char* buf = smem + s % kDfnStages * T::kStageBytes;
    const __nv_bfloat16* xs = reinterpret_cast<const __nv_bfloat16*>(buf);
    const __nv_bfloat16* w_hi = reinterpret_cast<const __nv_bfloat16*>(buf + T::kXBytes);
    const __nv_bfloat16* w_lo = w_hi + MT * 16 * kDfnWStride;
#pragma unroll
    for (int k = 0; k < kDfnChunk; k += 16) {
      // B: matrices (k 0-7, n 0-7), (k 8-15, n 0-7), (k 0-7, n 8-15), (k 8-15, n 8-15) of the
      // warp's 16 columns, transposed: b0, b1 of its two column tiles.
      uint32_t b[4];
      ldmatrix_x4_trans(b, shared_address(xs + (k + lane % 16) * kDfnXStride + warp * 16 + lane / 16 * 8));
#pragma unroll
      for (int mt = 0; mt < MT; ++mt) {
        // A: rows 0-7 and 8-15 of k 0-7, then of k 8-15: a0 .. a3.
        const int offset = (mt * 16 + lane % 16) * kDfnWStride + k + lane / 16 * 8;
        uint32_t a_hi[4], a_lo[4];
        ldmatrix_x4(a_hi, shared_address(w_hi + offset));
        ldmatrix_x4(a_lo, shared_address(w_lo + offset));
#pragma unroll
        for (int j = 0; j < 2; ++j) {
          mma_bf16(acc[mt][j], a_hi, b[2 * j], b[2 * j + 1]);
          mma_bf16(acc[mt][j], a_lo, b[2 * j], b[2 * j + 1]);
        }
      }
    }
  }
  copy_wait<0>();
  // C fragment: acc[mt][j][e] is (row 16 mt + g + 8 (e / 2), column 16 warp + 8 j + 2 c + e % 2).
#pragma unroll
  for (int mt = 0; mt < MT; ++mt) {
#pragma unroll
    for (int j = 0; j < 2; ++j) {
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int o = mt * 16 + g + 8 * (e / 2);
        const int64_t i = i0 + warp * 16 + j * 8 + 2 * c + e % 2;
        if (o < M && i < flat) atomicAdd(dfn + o * flat + i, acc[mt][j][e]);
      }
    }
  }
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

// fn [(2 + H) H, H D] split for the mix (split_fn_kernel), in a buffer of the call's.
DeviceBuffer<uint32_t> split_fn(const cpu::HcShape& s, const float* fn, cudaStream_t stream) {
  const int64_t n = (2 + s.streams) * s.streams * s.streams * s.hidden;
  DeviceBuffer<uint32_t> split(static_cast<size_t>(n), MemoryCategory::Workspace);
  launch_kernel(split_fn_kernel, grid_blocks(n, kThreads), kThreads, 0, stream, fn, split.data(), n);
  SPINDLE_LAUNCHED("split_fn_kernel");
  return split;
}

// Launches `kernel` with `bytes` of dynamic shared memory, raising its limit past 48 KiB if needed.
template <class Kernel, class... Args>
void launch_tiled(Kernel kernel, const cpu::HcShape& s, size_t bytes, cudaStream_t stream, const char* name,
                  Args... args) {
  allow_shared_memory(kernel, bytes, name, ": hidden ", s.hidden, ", ", s.streams, " streams");
  const auto blocks = static_cast<unsigned>((s.tokens + kTileTokens - 1) / kTileTokens);
  launch_kernel(kernel, blocks, kThreads, bytes, stream, args...);
  check_cuda(cudaGetLastError(), name, __FILE__, __LINE__);
}

int64_t hc_mix_floats(const cpu::HcShape& s) { return s.tokens * ((2 + s.streams) * s.streams + 1); }

namespace {

// hc_coefficients_kernel for every entry point: `fn` split (the mix multiplied here) or null with
// `kept_mix` (the mix loaded); `mix_out` written where given; with grad.dout, the combine's backward
// too (from the mix, hc_site_backward_fused).
void launch_coefficients(const cpu::HcShape& s, const __nv_bfloat16* streams, const uint32_t* fn,
                         const float* kept_mix, float* mix_out, const float* base, const float* scale,
                         float* pre, float* post, float* comb, __nv_bfloat16* collapsed, const HcNorm& norm,
                         cudaStream_t stream, const HcCombineGrad& grad = {}) {
  const float rms_eps = static_cast<float>(s.rms_eps), hc_eps = static_cast<float>(s.hc_eps);
  const int iters = static_cast<int>(s.sinkhorn_iters), D = static_cast<int>(s.hidden);
  const bool vec = vector_rows(s, {{streams, 2}, {collapsed, 2}});  // the split fn is a fresh buffer
  const bool fused = hc_norm_fused(s, streams, collapsed, norm);
  HcNorm in_kernel = norm;
  if (!fused) in_kernel.normed = nullptr;
  const auto launch = [&](auto kernel, size_t bytes) {
    launch_tiled(kernel, s, bytes, stream, "hc_coefficients_kernel", streams, fn, kept_mix, mix_out, base,
                 scale, pre, post, comb, collapsed, in_kernel, grad, s.tokens, D, rms_eps, hc_eps, iters,
                 vec);
  };
  SPINDLE_HC_DISPATCH({
    if (fn != nullptr)
      launch(hc_coefficients_kernel<H, false>, Tile<H>::kCommonBytes);
    else if (grad.dout != nullptr)
      launch(hc_coefficients_kernel<H, true, true>, Tile<H, Ring::kCollapse>::kCommonBytes);
    else
      launch(hc_coefficients_kernel<H, true>, Tile<H, Ring::kCollapse>::kCommonBytes);
  })
  if (!fused && norm.normed != nullptr)
    rms_norm_forward(collapsed, norm.weight, norm.normed, s.tokens, s.hidden, norm.eps, stream);
}

}  // namespace

bool hc_norm_fused(const cpu::HcShape& s, const __nv_bfloat16* streams, const __nv_bfloat16* collapsed,
                   const HcNorm& norm) {
  return norm.normed != nullptr &&
         vector_rows(s, {{streams, 2}, {collapsed, 2}, {norm.weight, 2}, {norm.normed, 2}});
}

bool hc_site_backward_fused(const cpu::HcShape& s, const __nv_bfloat16* streams,
                            const __nv_bfloat16* collapsed, const HcNorm& norm, const HcCombineGrad& grad) {
  return hc_norm_fused(s, streams, collapsed, norm) && grad.dout != nullptr && grad.y != nullptr &&
         grad.dy != nullptr && grad.d_comb != nullptr && grad.d_post != nullptr &&
         vector_rows(s, {{grad.dout, 2}, {grad.y, 2}, {grad.dy, 2}});
}

void hc_site_backward_inputs(const cpu::HcShape& s, const __nv_bfloat16* streams, const float* mix,
                             const float* base, const float* scale, float* pre, float* post, float* comb,
                             __nv_bfloat16* collapsed, const HcNorm& norm, const HcCombineGrad& grad,
                             cudaStream_t stream) {
  check_shape(s, "hc_site_backward_inputs");
  check(hc_site_backward_fused(s, streams, collapsed, norm, grad),
        "hc_site_backward_inputs: rows not in 16-byte vectors (hc_site_backward_fused)");
  if (s.tokens == 0) return;
  launch_coefficients(s, streams, nullptr, mix, nullptr, base, scale, pre, post, comb, collapsed, norm,
                      stream, grad);
}

void hc_coefficients(const cpu::HcShape& s, const __nv_bfloat16* streams, const float* fn, const float* base,
                     const float* scale, float* pre, float* post, float* comb, __nv_bfloat16* collapsed,
                     const HcNorm& norm, cudaStream_t stream, float* mix) {
  check_shape(s, "hc_coefficients");
  if (s.tokens == 0) return;
  const DeviceBuffer<uint32_t> split = split_fn(s, fn, stream);
  launch_coefficients(s, streams, split.data(), nullptr, mix, base, scale, pre, post, comb, collapsed, norm,
                      stream);
}

void hc_coefficients_from_mix(const cpu::HcShape& s, const __nv_bfloat16* streams, const float* mix,
                              const float* base, const float* scale, float* pre, float* post, float* comb,
                              __nv_bfloat16* collapsed, const HcNorm& norm, cudaStream_t stream) {
  check_shape(s, "hc_coefficients_from_mix");
  if (s.tokens == 0) return;
  launch_coefficients(s, streams, nullptr, mix, nullptr, base, scale, pre, post, comb, collapsed, norm,
                      stream);
}

void hc_combine(const cpu::HcShape& s, const __nv_bfloat16* streams, const __nv_bfloat16* y,
                const float* post, const float* comb, __nv_bfloat16* out, cudaStream_t stream) {
  check_shape(s, "hc_combine");
  if (s.tokens == 0) return;
  const auto blocks = static_cast<unsigned>((s.tokens + kWarps - 1) / kWarps);
  if (vector_rows(s, {{streams, 2}, {y, 2}, {out, 2}})) {
    SPINDLE_HC_DISPATCH(launch_kernel(hc_combine_kernel<H, 8>, blocks, kThreads, 0, stream, streams, y, post,
                                      comb, out, s.tokens, s.hidden))
  } else {
    SPINDLE_HC_DISPATCH(launch_kernel(hc_combine_kernel<H, 1>, blocks, kThreads, 0, stream, streams, y, post,
                                      comb, out, s.tokens, s.hidden))
  }
  SPINDLE_LAUNCHED("hc_combine_kernel");
}

bool hc_combine_mix_supported(const cpu::HcShape& s, const __nv_bfloat16* streams, const __nv_bfloat16* y,
                              const __nv_bfloat16* out) {
  return s.streams == 4 && s.hidden % kMixColumns == 0 && vector_rows(s, {{streams, 2}, {y, 2}, {out, 2}});
}

void hc_combine_mix(const cpu::HcShape& s, const __nv_bfloat16* streams, const __nv_bfloat16* y,
                    const float* post, const float* comb, __nv_bfloat16* out, const float* fn_next,
                    float* mix, cudaStream_t stream) {
  check_shape(s, "hc_combine_mix");
  check(hc_combine_mix_supported(s, streams, y, out), "hc_combine_mix: hc_mult ", s.streams, ", hidden ",
        s.hidden, " (it takes hc_mult 4, hidden a multiple of ", kMixColumns, ", 16-byte aligned rows)");
  if (s.tokens == 0) return;
  const DeviceBuffer<uint32_t> split = split_fn(s, fn_next, stream);
  constexpr int H = 4;
  const size_t bytes = CombineMixTile<H>::kBytes;
  allow_shared_memory(hc_combine_mix_kernel<H>, bytes, "hc_combine_mix_kernel");
  const auto blocks = static_cast<unsigned>((s.tokens + kTileTokens - 1) / kTileTokens);
  launch_kernel(hc_combine_mix_kernel<H>, blocks, kThreads, bytes, stream, streams, y, post, comb, out,
                split.data(), mix, s.tokens, static_cast<int>(s.hidden));
  SPINDLE_LAUNCHED("hc_combine_mix_kernel");
}

void hc_combine_backward(const cpu::HcShape& s, const __nv_bfloat16* streams, const float* post,
                         const float* comb, const __nv_bfloat16* dout, __nv_bfloat16* dstreams,
                         __nv_bfloat16* dy, float* d_comb, cudaStream_t stream, const __nv_bfloat16* y,
                         float* d_post) {
  check_shape(s, "hc_combine_backward");
  check((y == nullptr) == (d_post == nullptr), "hc_combine_backward: y and d_post come together");
  if (s.tokens == 0) return;
  const auto blocks = static_cast<unsigned>((s.tokens + kWarps - 1) / kWarps);
  const bool vec =
      vector_rows(s, {{streams, 2}, {dout, 2}, {dstreams, 2}, {dy, 2}, {y != nullptr ? y : dy, 2}});
  const auto run = [&](auto kernel) {
    launch_kernel(kernel, blocks, kThreads, 0, stream, streams, post, comb, dout, y, dstreams, dy, d_comb,
                  d_post, s.tokens, s.hidden);
  };
  SPINDLE_HC_DISPATCH({
    if (vec && y != nullptr)
      run(hc_combine_backward_kernel<H, 8, true>);
    else if (vec)
      run(hc_combine_backward_kernel<H, 8, false>);
    else if (y != nullptr)
      run(hc_combine_backward_kernel<H, 1, true>);
    else
      run(hc_combine_backward_kernel<H, 1, false>);
  })
  SPINDLE_LAUNCHED("hc_combine_backward_kernel");
}

void hc_post_gradient(const cpu::HcShape& s, const __nv_bfloat16* y, const __nv_bfloat16* dout, float* d_post,
                      cudaStream_t stream) {
  check_shape(s, "hc_post_gradient");
  if (s.tokens == 0) return;
  const auto blocks = static_cast<unsigned>((s.tokens + kWarps - 1) / kWarps);
  if (vector_rows(s, {{y, 2}, {dout, 2}})) {
    SPINDLE_HC_DISPATCH(launch_kernel(hc_post_gradient_kernel<H, 8>, blocks, kThreads, 0, stream, y, dout,
                                      d_post, s.tokens, s.hidden))
  } else {
    SPINDLE_HC_DISPATCH(launch_kernel(hc_post_gradient_kernel<H, 1>, blocks, kThreads, 0, stream, y, dout,
                                      d_post, s.tokens, s.hidden))
  }
  SPINDLE_LAUNCHED("hc_post_gradient_kernel");
}

int64_t hc_coefficients_backward_workspace(const cpu::HcShape& s) {
  const int64_t M = (2 + s.streams) * s.streams, row = ((M + 3) / 4 * 4 + 1 + s.streams + 3) / 4 * 4;
  return s.tokens * (row + M);  // kInputStride's rows, then w^T's hi and lo (bf16, M floats a token)
}

void hc_coefficients_backward(const cpu::HcShape& s, const __nv_bfloat16* streams, const float* mix,
                              const float* fn, const float* base, const float* scale, const float* d_pre,
                              const float* d_post, const float* d_comb, const __nv_bfloat16* d_collapsed,
                              const float* comb, const __nv_bfloat16* dout, __nv_bfloat16* dstreams,
                              float* dfn, float* dbase, float* dscale, float* workspace,
                              cudaStream_t stream) {
  check_shape(s, "hc_coefficients_backward");
  check((comb == nullptr) == (dout == nullptr), "hc_coefficients_backward: comb and dout come together");
  check(
      reinterpret_cast<uintptr_t>(workspace) % 16 == 0 && reinterpret_cast<uintptr_t>(comb) % 16 == 0,
      "hc_coefficients_backward: workspace and comb 16-byte aligned (the stream pass copies their rows so)");
  if (s.tokens == 0) return;
  const float rms_eps = static_cast<float>(s.rms_eps), hc_eps = static_cast<float>(s.hc_eps);
  const int iters = static_cast<int>(s.sinkhorn_iters), passes = 2 * iters - 1,
            D = static_cast<int>(s.hidden);
  const bool vec = vector_rows(s, {{streams, 2}, {fn, 4}, {d_collapsed, 2}, {dstreams, 2}, {dout, 2}});
  const bool dfn_vec = vector_rows(s, {{streams, 2}, {workspace, 4}}) && s.tokens % 8 == 0;
  const int64_t flat = s.streams * s.hidden;
  const dim3 dfn_grid(
      static_cast<unsigned>((flat + kDfnColumns - 1) / kDfnColumns),
      static_cast<unsigned>((s.tokens + kDfnChunk * kDfnChunks - 1) / (kDfnChunk * kDfnChunks)));
  SPINDLE_HC_DISPATCH({
    // Threads that run the Sinkhorn backward at once, one token each: whole warps, up to the tile's
    // tokens, as many as their passes' sums fit in shared memory with two blocks per SM (at hc_mult
    // 4 and 20 iterations: 64 threads, 55 KB).
    const size_t fixed = Tile<H, Ring::kNone>::kCommonBytes +
                         (kTileTokens * H + Tile<H>::M + 3 + kTileTokens * Tile<H>::M) * sizeof(float);
    const size_t per_thread = static_cast<size_t>(passes * H + 1) * sizeof(float);
    const size_t budget = kMaxDynamicShared / (H <= 4 ? 2 : 1);
    int threads = kTileTokens;
    while (threads > 32 && fixed + threads * per_thread > budget) threads -= 32;
    check(fixed + threads * per_thread <= kMaxDynamicShared, "hc_coefficients_backward: ", iters,
          " Sinkhorn iterations at hc_mult ", s.streams, " need ", fixed + threads * per_thread,
          " bytes of shared memory (at most ", kMaxDynamicShared, ")");
    launch_tiled(hc_coefficients_backward_kernel<H>, s, fixed + threads * per_thread, stream,
                 "hc_coefficients_backward_kernel", streams, mix, base, scale, d_pre, d_post, d_comb,
                 d_collapsed, dbase, dscale, workspace, s.tokens, D, rms_eps, hc_eps, iters, threads, vec);
    const auto stream_pass = [&](auto kernel, auto width) {
      constexpr int V = decltype(width)::value;
      constexpr size_t bytes = StreamStage<H, V>::kRingBytes;
      allow_shared_memory(kernel, bytes, "hc_stream_gradient_kernel: hc_mult ", H);
      // One wave: the column blocks times as many runs of tokens as the GPU then holds, each run
      // whole stages, at least a tile's 64 tokens (fn's loads and the ring's filling a block stay
      // few; the ring wraps within a run in the tests' small cases too), at most 2^30 (the kernel's
      // stage offsets stay ints).
      const int64_t columns = (s.hidden + kStreamColumns<H, V> - 1) / kStreamColumns<H, V>;
      const int64_t runs = std::max<int64_t>(1, resident_blocks_of(kernel, kThreads, bytes) / columns);
      const int64_t per_run = std::max<int64_t>(kTileTokens, (s.tokens + runs - 1) / runs);
      const int64_t run =
          std::min<int64_t>(per_run + kStreamRows - 1, int64_t{1} << 30) / kStreamRows * kStreamRows;
      const dim3 grid(static_cast<unsigned>(columns), static_cast<unsigned>((s.tokens + run - 1) / run));
      launch_kernel(kernel, grid, kThreads, bytes, stream, streams, d_collapsed, fn, workspace, comb, dout,
                    dstreams, s.tokens, D, static_cast<int>(run), vec);
    };
    // Two columns a thread where they fit the registers, with H a power of two (at H = 3 the
    // thread's stream and column cost the registers of a spill).
    constexpr int kPair = Tile<H>::M <= 24 && (H & (H - 1)) == 0 ? 2 : 1;
    if (vec)
      stream_pass(hc_stream_gradient_kernel<H, kPair>, std::integral_constant<int, kPair>{});
    else
      stream_pass(hc_stream_gradient_kernel<H, 1>, std::integral_constant<int, 1>{});
    SPINDLE_LAUNCHED("hc_stream_gradient_kernel");
    const size_t dfn_bytes = DfnTile<H>::kBytes;
    allow_shared_memory(hc_dfn_kernel<H>, dfn_bytes, "hc_dfn_kernel: hc_mult ", H);
    launch_kernel(hc_dfn_kernel<H>, dfn_grid, kThreads, dfn_bytes, stream, streams, workspace, dfn, s.tokens,
                  flat, dfn_vec);
    SPINDLE_LAUNCHED("hc_dfn_kernel");
  })
}

#undef SPINDLE_HC_DISPATCH

}  // namespace spindle::cuda
