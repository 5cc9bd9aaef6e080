// Depthwise causal conv + SiLU. One thread per V adjacent channels (V = 4, 2 or 1: 8-, 4- or 2-byte
// accesses, the widest that the channels, the row strides and the pointers allow) walks a run of
// consecutive tokens, keeping the last K inputs (and, backward, the last K pre-activation gradients)
// in registers: each input is read once per run plus a K - 1 halo. Consecutive threads take
// consecutive channels, so a warp's accesses are one contiguous run per token. The runs are long
// (about one wave of blocks in all), so that the halo and the backward's dw atomics (one set per
// run) are few. A thread's token loop would otherwise be a chain of dependent loads: each token's
// loads are issued kBatch tokens ahead of its arithmetic, into registers (no shared memory, so
// registers alone bound the blocks per SM). The l2 forms (the KDA's q and k) normalise each head
// of the conv's output in the same pass, and take its gradient back through the norm in the
// backward's pass: a head is a run of lanes of one warp, which sum over it by shuffles.
#include <algorithm>
#include <climits>
#include <cstdint>
#include <initializer_list>
#include <type_traits>

#include "backend/cuda/check.h"
#include "backend/cuda/device_memory.h"
#include "core/error.h"
#include "kernels/cuda/conv.h"
#include "kernels/cuda/launch.cuh"
#include "kernels/cuda/memory_bound.cuh"
#include "kernels/cuda/norms.h"

namespace spindle::cuda {

namespace {

constexpr int kThreads = 128;  // threads per block
constexpr int kBatch = 8;      // tokens whose loads are in flight ahead of the arithmetic
constexpr int kMaxKernel = 8;
static_assert(kMaxKernel - 1 < kBatch, "a run's K - 1 tokens past its end fit in one batch");

// V channels' bf16 values as raw bits, read in one access.
template <int V>
using Bf16s = std::conditional_t<V == 4, uint2, std::conditional_t<V == 2, uint32_t, uint16_t>>;

template <int V>
__device__ __forceinline__ Bf16s<V> load_row(const __nv_bfloat16* __restrict__ p) {
  return *reinterpret_cast<const Bf16s<V>*>(p);
}

// A bf16 is the top half of its fp32: one shift or mask per value.
template <int V>
__device__ __forceinline__ void unpack(const Bf16s<V>& in, float (&out)[V]) {
  const auto low = [](uint32_t bits) { return __uint_as_float(bits << 16); };
  const auto high = [](uint32_t bits) { return __uint_as_float(bits & 0xffff0000u); };
  if constexpr (V == 4) {
    out[0] = low(in.x);
    out[1] = high(in.x);
    out[2] = low(in.y);
    out[3] = high(in.y);
  } else if constexpr (V == 2) {
    out[0] = low(in);
    out[1] = high(in);
  } else {
    out[0] = low(in);
  }
}

// 1 / (1 + e^-a) by the SFU's exponential and reciprocal (a few ulp): expf and the IEEE division were
// most of the kernels' instructions, and the results are rounded to bf16. The values of __expf and
// __fdividef(1, .), in their .ftz forms: without .ftz ptxas wraps each in a denormal fix-up (a compare
// and two multiplies), and here none can matter (1 + e^-a rounds to 1 long before e^-a is denormal,
// and 1 + e^-a >= 1 has no denormal reciprocal).
__device__ __forceinline__ float sigmoid(float a) {
  float e, r;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(e) : "f"(a * -1.44269504f));
  asm("rcp.approx.ftz.f32 %0, %1;" : "=f"(r) : "f"(1.0f + e));
  return r;
}

// The V channels' taps, wr[v][j] = w[c + v, j].
template <int K, int V>
__device__ __forceinline__ void load_taps(const float* __restrict__ w, int64_t c, float (&wr)[V][K]) {
#pragma unroll
  for (int j = 0; j < K; ++j) {
#pragma unroll
    for (int v = 0; v < V; ++v) wr[v][j] = w[(c + v) * K + j];
  }
}

// The K - 1 inputs before token t0 (zero before the sequence) as the window before its first
// shift: win[v][j] = x[t0 - K + j, c + v] for j >= 1 (x's rows x_ld values apart).
template <int K, int V>
__device__ __forceinline__ void load_halo(const __nv_bfloat16* __restrict__ x, int64_t x_ld, int64_t c,
                                          int t0, float (&win)[V][K]) {
#pragma unroll
  for (int j = 0; j < K; ++j) {
    const int row = t0 - K + j;
    float halo[V] = {};
    if (j > 0 && row >= 0) unpack<V>(load_row<V>(x + row * x_ld + c), halo);
#pragma unroll
    for (int v = 0; v < V; ++v) win[v][j] = halo[v];
  }
}

// Shifts the window of V channels by one token: win[v][K - 1] = in[v].
template <int K, int V>
__device__ __forceinline__ void shift_in(float (&win)[V][K], const float (&in)[V]) {
#pragma unroll
  for (int v = 0; v < V; ++v) {
#pragma unroll
    for (int j = 0; j + 1 < K; ++j) win[v][j] = win[v][j + 1];
    win[v][K - 1] = in[v];
  }
}

// a = sum_j w[j] win[j], the pre-activation of the window's last token.
template <int K>
__device__ __forceinline__ float preactivation(const float (&wr)[K], const float (&win)[K]) {
  float a = 0.0f;
#pragma unroll
  for (int j = 0; j < K; ++j) a = fmaf(wr[j], win[j], a);
  return a;
}

// Both sums over a head of the l2 forms, `lanes` consecutive lanes (a power of two, at most 32) of V
// channels each, so that a warp holds whole heads; every lane of the head gets them. Every lane of
// the warp takes every shuffle (those past the channels too: the kernels keep them), and keeps a
// partner's value only where the partner is of its head.
__device__ __forceinline__ void sum_over_head(float (&sums)[2], int lanes) {
#pragma unroll
  for (int lane_bit = 16; lane_bit > 0; lane_bit /= 2) {
    const float a = __shfl_xor_sync(0xffffffffu, sums[0], lane_bit);
    const float b = __shfl_xor_sync(0xffffffffu, sums[1], lane_bit);
    if (lane_bit < lanes) {
      sums[0] += a;
      sums[1] += b;
    }
  }
}

// The l2-normalised copy of the conv's output (causal_conv_silu_l2); unused by the plain conv.
struct L2Output {
  __nv_bfloat16* z;
  int skip;
  float eps, scale;
  int lanes;
};

// v (a token's V channels of y, as y's bf16 holds them) times scale / sqrt(sum of squares + eps),
// the sum over the head's lanes.
template <int V>
__device__ __forceinline__ void l2_normalize_head(float (&v)[V], float eps, float scale, int lanes) {
  float sums[2] = {0.0f, 0.0f};
#pragma unroll
  for (int i = 0; i < V; ++i) {
    v[i] = __bfloat162float(__float2bfloat16(v[i]));
    sums[0] = fmaf(v[i], v[i], sums[0]);
  }
  sum_over_head(sums, lanes);
  const float factor = scale * rsqrtf(sums[0] + eps);
#pragma unroll
  for (int i = 0; i < V; ++i) v[i] *= factor;
}

// The gradient through the norm of causal_conv_silu_l2 (causal_conv_silu_l2_backward): dz [tokens -
// skip, channels], the gradient of z.
struct L2Gradient {
  const __nv_bfloat16* dz;
  int skip;
  float eps, scale;
  int lanes;
};

// g: a token's V channels of dz on entry, of dy (the conv output's gradient) on return, for y = the
// conv's output as the forward rounded it (l2_normalize_backward in fp32: scale / n (g - y (y.g) /
// n^2), n^2 = y.y + eps over the head).
template <int V>
__device__ __forceinline__ void l2_backward_head(float (&g)[V], const float (&y)[V], float eps, float scale,
                                                 int lanes) {
  float sums[2] = {0.0f, 0.0f};
#pragma unroll
  for (int i = 0; i < V; ++i) {
    sums[0] = fmaf(y[i], y[i], sums[0]);
    sums[1] = fmaf(y[i], g[i], sums[1]);
  }
  sum_over_head(sums, lanes);
  const float inv = rsqrtf(sums[0] + eps), coef = inv * inv * sums[1];
#pragma unroll
  for (int i = 0; i < V; ++i) g[i] = scale * inv * fmaf(-y[i], coef, g[i]);
}

// Each thread walks tokens [t0, t1) of its run, t0 = blockIdx.y * run. The loop is in batches of
// kBatch tokens; batch(u, checked) takes tokens [u, u + kBatch), reading each token's x row from the
// buffer and refilling it with the row kBatch tokens later. Unchecked batches (all but the last one or
// two) know that every row they refill exists. kNormalize: y's rows t >= l2.skip go to z's row
// t - l2.skip, l2-normalised per head (the whole warp takes the same tokens, so that every lane joins
// each row's sum), and y itself is not stored.
template <int K, int V, bool kNormalize>
__global__ void __launch_bounds__(kThreads)
    causal_conv_silu_kernel(const __nv_bfloat16* __restrict__ x, int64_t x_ld, const float* __restrict__ w,
                            __nv_bfloat16* __restrict__ y, const L2Output l2, int tokens, int64_t channels,
                            int run) {
  wait_for_earlier_kernels();
  // The l2 forms keep a warp's lanes past the channels (whole heads of them) for its shuffles: they
  // walk channel 0 and store nothing.
  const int64_t first = (static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x) * V;
  const bool active = first < channels;
  if (!kNormalize && !active) return;
  const int64_t c = active ? first : 0;
  const int t0 = static_cast<int>(blockIdx.y) * run, t1 = min(t0 + run, tokens);
  __nv_bfloat16* normalized = nullptr;  // the next z row to write
  if constexpr (kNormalize) normalized = l2.z + static_cast<int64_t>(max(t0 - l2.skip, 0)) * channels + c;
  float wr[V][K], win[V][K];  // after the shift at token t: win[v][j] = x[t - (K - 1) + j, c + v]
  load_taps<K, V>(w, c, wr);
  load_halo<K, V>(x, x_ld, c, t0, win);
  // Stepped pointers: 64-bit index arithmetic per token would be a good part of the instructions.
  const __nv_bfloat16* next = x + static_cast<int64_t>(t0) * x_ld + c;  // the next x row to read
  __nv_bfloat16* out = kNormalize ? nullptr : y + static_cast<int64_t>(t0) * channels + c;  // next y row
  Bf16s<V> xb[kBatch] = {};  // x rows u + b of the batch at u
#pragma unroll
  for (int b = 0; b < kBatch; ++b) {
    if (t0 + b < t1) {
      xb[b] = load_row<V>(next);
      next += x_ld;
    }
  }
  const auto batch = [&](int u, auto checked) {
    constexpr bool kChecked = decltype(checked)::value;
#pragma unroll
    for (int b = 0; b < kBatch; ++b) {
      float in[V];
      unpack<V>(xb[b], in);
      if (!kChecked || u + b + kBatch < t1) {
        xb[b] = load_row<V>(next);
        next += x_ld;
      }
      shift_in<K, V>(win, in);
      float out_values[V];
#pragma unroll
      for (int v = 0; v < V; ++v) {
        const float a = preactivation<K>(wr[v], win[v]);
        out_values[v] = a * sigmoid(a);
      }
      if (!kChecked || u + b < t1) {
        if constexpr (!kNormalize) {
          store_global<V>(out, out_values);
          out += channels;
        } else {
          if (u + b >= l2.skip) {
            l2_normalize_head<V>(out_values, l2.eps, l2.scale, l2.lanes);
            if (active) store_global<V>(normalized, out_values);
            normalized += channels;
          }
        }
      }
    }
  };
  int u = t0;
#pragma unroll 1
  for (; u + 2 * kBatch <= t1; u += kBatch) batch(u, std::false_type{});
#pragma unroll 1
  for (; u < t1; u += kBatch) batch(u, std::true_type{});
}

// Walks u over [t0, t1 + K - 1): da[u] = dy[u] silu'(a[u]) (zero past the sequence), dw from the
// run's own da (u < t1), and dx[u - (K - 1)] = sum_j da[u - j] w[K - 1 - j] once da[u] is known (for
// u - (K - 1) >= t0: the rows before belong to the run before). Batches as the forward's, refilling
// both x and dy; unchecked batches (all but the first and the last one or two) also store every dx
// row and add every da to dw. The run's dw sums go out once, by atomics: every run adds into the same
// channels K values. kNormalize: dy is not read but formed at each step, from dz's row u - l2.skip
// (zero before l2.skip) and y[u] = silu(a[u]) as the forward rounded it, through the head's norm (the
// whole warp takes the same steps, so that every lane joins each row's sums).
template <int K, int V, bool kNormalize>
__global__ void __launch_bounds__(kThreads)
    causal_conv_silu_backward_kernel(const __nv_bfloat16* __restrict__ x, int64_t x_ld,
                                     const float* __restrict__ w, const __nv_bfloat16* __restrict__ dy,
                                     const L2Gradient l2, __nv_bfloat16* __restrict__ dx, int64_t dx_ld,
                                     float* __restrict__ dw, int tokens, int64_t channels, int run) {
  wait_for_earlier_kernels();
  // The l2 forms keep a warp's lanes past the channels (whole heads of them) for its shuffles: they
  // walk channel 0 and store nothing.
  const int64_t first = (static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x) * V;
  const bool active = first < channels;
  if (!kNormalize && !active) return;
  const int64_t c = active ? first : 0;
  const int t0 = static_cast<int>(blockIdx.y) * run, t1 = min(t0 + run, tokens);
  const int end = t1 + K - 1;         // steps u in [t0, end)
  const int rows = min(end, tokens);  // the x and dy rows that the steps read
  float wr[V][K], dwacc[V][K] = {};
  load_taps<K, V>(w, c, wr);
  float win[V][K], dh[V][K] = {};  // after the shift at step u: dh[v][j] = da[u - (K - 1) + j, c + v]
  load_halo<K, V>(x, x_ld, c, t0, win);
  // Stepped pointers: 64-bit index arithmetic per token would be a good part of the instructions.
  const __nv_bfloat16* x_next = x + static_cast<int64_t>(t0) * x_ld + c;  // the next rows to read
  // dy's (or dz's) next row to read: with kNormalize, dz's first row at or after the next step's.
  const __nv_bfloat16* dy_next = kNormalize
                                     ? l2.dz + static_cast<int64_t>(max(t0 - l2.skip, 0)) * channels + c
                                     : dy + static_cast<int64_t>(t0) * channels + c;
  __nv_bfloat16* dx_out = dx + static_cast<int64_t>(t0) * dx_ld + c;  // the next dx row to write
  // The gradient's row for step `row`, in order (zero before l2.skip: z has no row there).
  const auto load_gradient = [&](int row) {
    Bf16s<V> g{};
    if (!kNormalize || row >= l2.skip) {
      g = load_row<V>(dy_next);
      dy_next += channels;
    }
    return g;
  };
  Bf16s<V> xb[kBatch] = {},
           db[kBatch] = {};  // x and gradient rows u + b of the batch at u (zero past `rows`)
#pragma unroll
  for (int b = 0; b < kBatch; ++b) {
    if (t0 + b < rows) {
      xb[b] = load_row<V>(x_next);
      db[b] = load_gradient(t0 + b);
      x_next += x_ld;
    }
  }
  const auto batch = [&](int u, auto checked) {
    constexpr bool kChecked = decltype(checked)::value;
#pragma unroll
    for (int b = 0; b < kBatch; ++b) {
      const int step = u + b;
      float xin[V], dyin[V];
      unpack<V>(xb[b], xin);
      unpack<V>(db[b], dyin);
      if (!kChecked || step + kBatch < rows) {
        xb[b] = load_row<V>(x_next);
        db[b] = load_gradient(step + kBatch);
        x_next += x_ld;
      } else {
        xb[b] = Bf16s<V>{};
        db[b] = Bf16s<V>{};
      }
      shift_in<K, V>(win, xin);
      const bool own = !kChecked || step < t1;  // da[step] is this run's: it adds to dw
      float a[V], sg[V];
#pragma unroll
      for (int v = 0; v < V; ++v) {
        a[v] = preactivation<K>(wr[v], win[v]);
        sg[v] = sigmoid(a[v]);
      }
      if constexpr (kNormalize) {
        float y[V];
#pragma unroll
        for (int v = 0; v < V; ++v) y[v] = __bfloat162float(__float2bfloat16(a[v] * sg[v]));
        l2_backward_head<V>(dyin, y, l2.eps, l2.scale, l2.lanes);
      }
      float g[V];
#pragma unroll
      for (int v = 0; v < V; ++v) {
        // da = dy silu'(a) = dy sg (1 + a (1 - sg)), as p + p a (1 - sg) with p = dy sg.
        const float p = dyin[v] * sg[v];
        const float da = fmaf(p, fmaf(-a[v], sg[v], a[v]), p);
#pragma unroll
        for (int j = 0; j + 1 < K; ++j) dh[v][j] = dh[v][j + 1];
        dh[v][K - 1] = da;
        if (own) {
#pragma unroll
          for (int j = 0; j < K; ++j) dwacc[v][j] = fmaf(da, win[v][j], dwacc[v][j]);
        }
        g[v] = 0.0f;
#pragma unroll
        for (int j = 0; j < K; ++j) g[v] = fmaf(dh[v][K - 1 - j], wr[v][j], g[v]);
      }
      if (!kChecked || (step >= t0 + K - 1 && step < end)) {  // dx[step - (K - 1)]
        if (active) store_global<V>(dx_out, g);
        dx_out += dx_ld;
      }
    }
  };
  int u = t0;
  batch(u, std::true_type{});  // its first K - 1 steps have no dx row of this run
#pragma unroll 1
  for (u += kBatch; u + 2 * kBatch <= rows; u += kBatch) batch(u, std::false_type{});
#pragma unroll 1
  for (; u < end; u += kBatch) batch(u, std::true_type{});
  // One atomic per tap for the run (its sums are already in registers); four taps in one where aligned.
  if (!active) return;
  float* sums = dw + c * K;
  const float* acc = &dwacc[0][0];
  if constexpr (V * K % 4 == 0) {
    if (reinterpret_cast<uintptr_t>(sums) % 16 == 0) {
#pragma unroll
      for (int i = 0; i < V * K; i += 4)
        atomicAdd(reinterpret_cast<float4*>(sums + i),
                  make_float4(acc[i], acc[i + 1], acc[i + 2], acc[i + 3]));
      return;
    }
  }
#pragma unroll
  for (int i = 0; i < V * K; ++i) atomicAdd(sums + i, acc[i]);
}

// The widest V in {4, 2, 1} that divides every row stride and to whose accesses (2 V bytes) every
// tensor is aligned.
int values_per_thread(std::initializer_list<int64_t> strides, std::initializer_list<const void*> tensors) {
  for (int v = 4; v > 1; v /= 2) {
    bool fits = true;
    for (const int64_t s : strides) fits = fits && s % v == 0;
    for (const void* p : tensors) fits = fits && reinterpret_cast<uintptr_t>(p) % (2 * v) == 0;
    if (fits) return v;
  }
  return 1;
}

void check_shape(const char* name, int64_t tokens, int64_t kernel) {
  check(kernel >= 1 && kernel <= kMaxKernel, name, ": kernel size ", kernel, " (expected 1 to ", kMaxKernel,
        ")");
  check(tokens <= INT_MAX - 4 * kBatch, name, ": ", tokens, " tokens is too many for one launch");
}

// Blocks of kThreads threads across the channels, by runs of tokens (a multiple of kBatch each): about
// one wave of blocks in all, so that the runs are as long as the GPU allows while it is full.
struct ConvGrid {
  dim3 blocks;
  int run;
};

ConvGrid conv_grid(const void* kernel, int64_t tokens, int64_t channels, int values) {
  const int64_t per_block = int64_t{kThreads} * values, across = (channels + per_block - 1) / per_block;
  const int64_t runs = std::max<int64_t>(1, resident_blocks_of(kernel, kThreads, 0) / across);
  const int64_t run = ((tokens + runs - 1) / runs + kBatch - 1) / kBatch * kBatch;
  const int64_t along = (tokens + run - 1) / run;
  check(across <= 0x7fffffff && along <= 65535, "causal_conv_silu: ", tokens, " tokens x ", channels,
        " channels is too large for one launch");
  return {dim3(static_cast<unsigned>(across), static_cast<unsigned>(along)), static_cast<int>(run)};
}

template <int K, int V, bool kNormalize>
void launch_conv(const __nv_bfloat16* x, int64_t x_ld, const float* w, __nv_bfloat16* y, const L2Output& l2,
                 int64_t tokens, int64_t channels, cudaStream_t stream) {
  const auto kernel = causal_conv_silu_kernel<K, V, kNormalize>;
  const ConvGrid grid = conv_grid(reinterpret_cast<const void*>(kernel), tokens, channels, V);
  launch_kernel(kernel, grid.blocks, kThreads, 0, stream, x, x_ld, w, y, l2, static_cast<int>(tokens),
                channels, grid.run);
}

template <int K, int V>
void launch_forward(const __nv_bfloat16* x, int64_t x_ld, const float* w, __nv_bfloat16* y, int64_t tokens,
                    int64_t channels, cudaStream_t stream) {
  launch_conv<K, V, false>(x, x_ld, w, y, L2Output{}, tokens, channels, stream);
}

template <int K, int V>
void launch_forward_l2(const __nv_bfloat16* x, int64_t x_ld, const float* w, const L2Output& l2,
                       int64_t tokens, int64_t channels, cudaStream_t stream) {
  launch_conv<K, V, true>(x, x_ld, w, nullptr, l2, tokens, channels, stream);
}

template <int K, int V, bool kNormalize>
void launch_backward(const __nv_bfloat16* x, int64_t x_ld, const float* w, const __nv_bfloat16* dy,
                     const L2Gradient& l2, __nv_bfloat16* dx, int64_t dx_ld, float* dw, int64_t tokens,
                     int64_t channels, cudaStream_t stream) {
  const auto kernel = causal_conv_silu_backward_kernel<K, V, kNormalize>;
  const ConvGrid grid = conv_grid(reinterpret_cast<const void*>(kernel), tokens, channels, V);
  launch_kernel(kernel, grid.blocks, kThreads, 0, stream, x, x_ld, w, dy, l2, dx, dx_ld, dw,
                static_cast<int>(tokens), channels, grid.run);
}

template <int K, int V>
void launch_plain_backward(const __nv_bfloat16* x, int64_t x_ld, const float* w, const __nv_bfloat16* dy,
                           __nv_bfloat16* dx, int64_t dx_ld, float* dw, int64_t tokens, int64_t channels,
                           cudaStream_t stream) {
  launch_backward<K, V, false>(x, x_ld, w, dy, L2Gradient{}, dx, dx_ld, dw, tokens, channels, stream);
}

template <int K, int V>
void launch_l2_backward(const __nv_bfloat16* x, int64_t x_ld, const float* w, const L2Gradient& l2,
                        __nv_bfloat16* dx, int64_t dx_ld, float* dw, int64_t tokens, int64_t channels,
                        cudaStream_t stream) {
  launch_backward<K, V, true>(x, x_ld, w, nullptr, l2, dx, dx_ld, dw, tokens, channels, stream);
}

// The values a thread of the l2 forms takes: the widest V in {4, 2, 1}, at most `allowed` (what the
// alignment allows), for which a head is a power of two of lanes within a warp; 0 if none is.
int head_values(int64_t head_dim, int allowed) {
  for (int v = allowed; v >= 1; v /= 2) {
    const int64_t lanes = head_dim / v;
    if (head_dim % v == 0 && lanes <= 32 && 32 % lanes == 0) return v;
  }
  return 0;
}

// Calls LAUNCH<K, V>(args...) for the runtime kernel size (1 to kMaxKernel).
#define SPINDLE_CONV_DISPATCH(LAUNCH, V, ...) \
  switch (kernel) {                           \
    case 1:                                   \
      LAUNCH<1, V>(__VA_ARGS__);              \
      break;                                  \
    case 2:                                   \
      LAUNCH<2, V>(__VA_ARGS__);              \
      break;                                  \
    case 3:                                   \
      LAUNCH<3, V>(__VA_ARGS__);              \
      break;                                  \
    case 4:                                   \
      LAUNCH<4, V>(__VA_ARGS__);              \
      break;                                  \
    case 5:                                   \
      LAUNCH<5, V>(__VA_ARGS__);              \
      break;                                  \
    case 6:                                   \
      LAUNCH<6, V>(__VA_ARGS__);              \
      break;                                  \
    case 7:                                   \
      LAUNCH<7, V>(__VA_ARGS__);              \
      break;                                  \
    default:                                  \
      LAUNCH<8, V>(__VA_ARGS__);              \
      break;                                  \
  }

// Calls LAUNCH<K, V>(args...) for the runtime kernel size and `values` (4, 2 or 1).
#define SPINDLE_CONV_DISPATCH_VALUES(LAUNCH, ...) \
  if (values == 4) {                              \
    SPINDLE_CONV_DISPATCH(LAUNCH, 4, __VA_ARGS__) \
  } else if (values == 2) {                       \
    SPINDLE_CONV_DISPATCH(LAUNCH, 2, __VA_ARGS__) \
  } else {                                        \
    SPINDLE_CONV_DISPATCH(LAUNCH, 1, __VA_ARGS__) \
  }

}  // namespace

void causal_conv_silu(const __nv_bfloat16* x, int64_t x_ld, const float* w, __nv_bfloat16* y, int64_t tokens,
                      int64_t channels, int64_t kernel, cudaStream_t stream) {
  check(x_ld >= channels, "causal_conv_silu: x's rows ", x_ld, " apart for ", channels, " channels");
  check_shape("causal_conv_silu", tokens, kernel);
  if (tokens == 0 || channels == 0) return;
  const int values = values_per_thread({channels, x_ld}, {x, y});
  SPINDLE_CONV_DISPATCH_VALUES(launch_forward, x, x_ld, w, y, tokens, channels, stream)
  SPINDLE_LAUNCHED("causal_conv_silu_kernel");
}

bool causal_conv_silu_l2(const __nv_bfloat16* x, int64_t x_ld, const float* w, __nv_bfloat16* z, int64_t skip,
                         int64_t tokens, int64_t channels, int64_t kernel, int64_t head_dim, float eps,
                         float scale, cudaStream_t stream) {
  check(x_ld >= channels, "causal_conv_silu_l2: x's rows ", x_ld, " apart for ", channels, " channels");
  check(head_dim > 0 && channels % head_dim == 0 && skip >= 0 && skip <= tokens,
        "causal_conv_silu_l2: ", channels, " channels in heads of ", head_dim, ", ", skip, " of ", tokens,
        " rows skipped");
  check_shape("causal_conv_silu_l2", tokens, kernel);
  if (tokens == 0 || channels == 0) return true;
  const int values = head_values(head_dim, values_per_thread({channels, x_ld}, {x, z}));
  if (values == 0) {  // the conv, then the norm's own pass
    DeviceBuffer<__nv_bfloat16> y(static_cast<size_t>(tokens * channels), MemoryCategory::Workspace);
    causal_conv_silu(x, x_ld, w, y.data(), tokens, channels, kernel, stream);
    l2_normalize_forward(y.data() + skip * channels, z, (tokens - skip) * channels / head_dim, head_dim, eps,
                         scale, stream);
    return false;
  }
  const L2Output l2{z, static_cast<int>(skip), eps, scale, static_cast<int>(head_dim / values)};
  SPINDLE_CONV_DISPATCH_VALUES(launch_forward_l2, x, x_ld, w, l2, tokens, channels, stream)
  SPINDLE_LAUNCHED("causal_conv_silu_kernel (l2)");
  return true;
}

void causal_conv_silu_backward(const __nv_bfloat16* x, int64_t x_ld, const float* w, const __nv_bfloat16* dy,
                               __nv_bfloat16* dx, int64_t dx_ld, float* dw, int64_t tokens, int64_t channels,
                               int64_t kernel, cudaStream_t stream) {
  check(x_ld >= channels && dx_ld >= channels, "causal_conv_silu_backward: x's rows ", x_ld, " and dx's ",
        dx_ld, " apart for ", channels, " channels");
  check_shape("causal_conv_silu_backward", tokens, kernel);
  if (tokens == 0 || channels == 0) return;
  const int values = values_per_thread({channels, x_ld, dx_ld}, {x, dy, dx});
  SPINDLE_CONV_DISPATCH_VALUES(launch_plain_backward, x, x_ld, w, dy, dx, dx_ld, dw, tokens, channels, stream)
  SPINDLE_LAUNCHED("causal_conv_silu_backward_kernel");
}

bool causal_conv_silu_l2_backward(const __nv_bfloat16* x, int64_t x_ld, const float* w,
                                  const __nv_bfloat16* dz, int64_t skip, __nv_bfloat16* dx, int64_t dx_ld,
                                  float* dw, int64_t tokens, int64_t channels, int64_t kernel,
                                  int64_t head_dim, float eps, float scale, cudaStream_t stream) {
  check(x_ld >= channels && dx_ld >= channels, "causal_conv_silu_l2_backward: x's rows ", x_ld, " and dx's ",
        dx_ld, " apart for ", channels, " channels");
  check(head_dim > 0 && channels % head_dim == 0 && skip >= 0 && skip <= tokens,
        "causal_conv_silu_l2_backward: ", channels, " channels in heads of ", head_dim, ", ", skip, " of ",
        tokens, " rows skipped");
  check_shape("causal_conv_silu_l2_backward", tokens, kernel);
  if (tokens == 0 || channels == 0) return true;
  const int values = head_values(head_dim, values_per_thread({channels, x_ld, dx_ld}, {x, dz, dx}));
  if (values == 0) {  // the conv's output made again, the norm's backward, then the conv's
    DeviceBuffer<__nv_bfloat16> y(static_cast<size_t>(tokens * channels), MemoryCategory::Workspace);
    DeviceBuffer<__nv_bfloat16> dy(static_cast<size_t>(tokens * channels), MemoryCategory::Workspace);
    causal_conv_silu(x, x_ld, w, y.data(), tokens, channels, kernel, stream);
    SPINDLE_CUDA(cudaMemsetAsync(dy.data(), 0, skip * channels * sizeof(__nv_bfloat16), stream));
    l2_normalize_backward(y.data() + skip * channels, dz, dy.data() + skip * channels,
                          (tokens - skip) * channels / head_dim, head_dim, eps, scale, stream);
    causal_conv_silu_backward(x, x_ld, w, dy.data(), dx, dx_ld, dw, tokens, channels, kernel, stream);
    return false;
  }
  const L2Gradient l2{dz, static_cast<int>(skip), eps, scale, static_cast<int>(head_dim / values)};
  SPINDLE_CONV_DISPATCH_VALUES(launch_l2_backward, x, x_ld, w, l2, dx, dx_ld, dw, tokens, channels, stream)
  SPINDLE_LAUNCHED("causal_conv_silu_backward_kernel (l2)");
  return true;
}

#undef SPINDLE_CONV_DISPATCH_VALUES
#undef SPINDLE_CONV_DISPATCH

}  // namespace spindle::cuda
