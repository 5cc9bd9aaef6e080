// KDA gates. The decay: each thread takes V adjacent channels of one head (V = 4 where the head's
// length and the pointers allow 16-byte fp32 accesses, else 2 or 1) and walks a tile of tokens (a
// warp's loads are one contiguous run per token) with its channels' biases and its head's rate in
// registers. The loads' latency bounds it (ncu: most of the backward's cycles waited on them), so a
// thread issues kTokens tokens' loads (64 bytes of each fp32 input) before any of their arithmetic
// (an unrolled loop had left the next token's loads behind this token's branches and store, in the
// PTX). The thresholds at 20 select between both sides (the same values as a branch), so that a
// thread's elements interleave. Backward, the tile's parameter gradients are summed in registers,
// then added once per block: d_dt_bias by one atomic per thread (4 channels in one where aligned),
// d_A_log per head, combined across the block in shared memory first. The grid is one wave of what
// the GPU holds of the kernel at once (its registers decide), each block a tile of tokens. The
// sigmoid is an elementwise map.
#include <algorithm>

#include "backend/cuda/check.h"
#include "core/error.h"
#include "kernels/cuda/kda_gates.h"
#include "kernels/cuda/launch.cuh"
#include "kernels/cuda/memory_bound.cuh"

namespace spindle::cuda {

namespace {

constexpr int kThreads = 128;  // threads per block
constexpr int64_t kMinTile = 16;

// Tokens a thread loads at once: 64 bytes of each fp32 input in flight.
template <int V>
constexpr int kTokens = 16 / V;

__device__ __forceinline__ float sigmoid(float a) { return 1.0f / (1.0f + expf(-a)); }

// softplus, passing a through above 20.
__device__ __forceinline__ float softplus_thresholded(float a) {
  const float smooth = log1pf(expf(a));
  return a > 20.0f ? a : smooth;
}

// The thread's first channel c (of `channels`; V of them from c, all in one head) and its block's
// tokens [t0, t1).
struct DecayTile {
  int64_t channels, c, t0, t1;
};

template <int V>
__device__ DecayTile decay_tile(const KdaDecayShape& s, int64_t tile) {
  const int64_t t0 = static_cast<int64_t>(blockIdx.x) * tile;
  return {s.heads * s.head_dim, (static_cast<int64_t>(blockIdx.y) * kThreads + threadIdx.x) * V, t0,
          min(t0 + tile, s.tokens)};
}

// The V channels' biases; returns their head's rate exp(A_log).
template <int V>
__device__ __forceinline__ float load_parameters(const KdaDecayShape& s, const float* dt_bias,
                                                 const float* A_log, int64_t c, float (&bias)[V]) {
#pragma unroll
  for (int v = 0; v < V; ++v) bias[v] = dt_bias[c + v];
  return expf(A_log[c / s.head_dim]);
}

// The V channels at `at` (token t's, of a [tokens, channels] input) and at the next kTokens - 1
// tokens', all loads issued before any value is used. Tokens past the tile's last (`last` tokens on)
// load that one again (in cache; the caller skips them), so that no load waits on a branch.
template <int V>
__device__ __forceinline__ void load_tokens(const float* at, int64_t channels, int last,
                                            float (&out)[kTokens<V>][V]) {
#pragma unroll
  for (int u = 0; u < kTokens<V>; ++u) load<V>(at + min(u, last) * channels, out[u]);
}

// grad[0, V) += sums: by one float4 atomic where V = 4 and grad is 16-byte aligned.
template <int V>
__device__ __forceinline__ void add_sums(float* grad, const float (&sums)[V]) {
  if constexpr (V == 4) {
    if (reinterpret_cast<uintptr_t>(grad) % 16 == 0) {
      atomicAdd(reinterpret_cast<float4*>(grad), make_float4(sums[0], sums[1], sums[2], sums[3]));
      return;
    }
  }
#pragma unroll
  for (int v = 0; v < V; ++v) atomicAdd(grad + v, sums[v]);
}

template <int V, bool kBounded>
__global__ void __launch_bounds__(kThreads)
    kda_decay_forward_kernel(KdaDecayShape s, const float* __restrict__ f, const float* __restrict__ dt_bias,
                             const float* __restrict__ A_log, float* __restrict__ g, int64_t tile) {
  wait_for_earlier_kernels();
  constexpr int U = kTokens<V>;
  const DecayTile b = decay_tile<V>(s, tile);
  if (b.c >= b.channels) return;  // V divides channels: the thread's V channels are all there
  float bias[V];
  const float rate = load_parameters<V>(s, dt_bias, A_log, b.c, bias);
  for (int64_t t = b.t0; t < b.t1; t += U) {
    const int64_t at = t * b.channels + b.c;
    const int last = static_cast<int>(min(b.t1 - t, int64_t{U})) - 1;
    float pre[U][V];
    load_tokens<V>(f + at, b.channels, last, pre);
#pragma unroll
    for (int u = 0; u < U; ++u) {
      if (u > last) break;
      float out[V];
#pragma unroll
      for (int v = 0; v < V; ++v) {
        const float p = pre[u][v] + bias[v];
        out[v] = kBounded ? s.lower_bound * sigmoid(rate * p) : -rate * softplus_thresholded(p);
      }
      store_global<V>(g + at + u * b.channels, out);
    }
  }
}

// As kda_backward: bounded, with u = rate pre and sg = sigmoid(u): du = dg lb sg (1 - sg),
// dpre = du rate, drate = du pre; else dpre = -rate sigmoid(pre) dg (slope 1 above 20),
// drate = -softplus(pre) dg. d_A_log = sum drate rate (rate = exp(A_log), one per head).
template <int V, bool kBounded>
__global__ void __launch_bounds__(kThreads)
    kda_decay_backward_kernel(KdaDecayShape s, const float* __restrict__ f, const float* __restrict__ dt_bias,
                              const float* __restrict__ A_log, const float* __restrict__ dg,
                              __nv_bfloat16* __restrict__ df, float* __restrict__ d_dt_bias,
                              float* __restrict__ d_A_log, int64_t tile) {
  wait_for_earlier_kernels();
  constexpr int U = kTokens<V>;
  // The block's heads from first_head: a thread's channels are in one head, so at most kThreads.
  __shared__ float head_sums[kThreads];
  const DecayTile b = decay_tile<V>(s, tile);
  head_sums[threadIdx.x] = 0.0f;
  __syncthreads();
  const int64_t block_c = static_cast<int64_t>(blockIdx.y) * kThreads * V, first_head = block_c / s.head_dim;
  if (b.c < b.channels) {
    float bias[V], dbias[V] = {}, drate = 0.0f;  // drate: summed over the V channels too (one head)
    const float rate = load_parameters<V>(s, dt_bias, A_log, b.c, bias);
    for (int64_t t = b.t0; t < b.t1; t += U) {
      const int64_t at = t * b.channels + b.c;
      const int last = static_cast<int>(min(b.t1 - t, int64_t{U})) - 1;
      float pre[U][V], grad[U][V];
      load_tokens<V>(f + at, b.channels, last, pre);
      load_tokens<V>(dg + at, b.channels, last, grad);
#pragma unroll
      for (int u = 0; u < U; ++u) {
        if (u > last) break;
        float dpre[V];
#pragma unroll
        for (int v = 0; v < V; ++v) {
          const float p = pre[u][v] + bias[v];
          if constexpr (kBounded) {
            const float sg = sigmoid(rate * p);
            const float du = grad[u][v] * s.lower_bound * sg * (1.0f - sg);
            dpre[v] = du * rate;
            drate += du * p;
          } else {
            const float slope = sigmoid(p);
            dpre[v] = -rate * (p > 20.0f ? 1.0f : slope) * grad[u][v];
            drate -= softplus_thresholded(p) * grad[u][v];
          }
          dbias[v] += dpre[v];
        }
        store_global<V>(df + at + u * b.channels, dpre);
      }
    }
    add_sums<V>(d_dt_bias + b.c, dbias);
    atomicAdd(head_sums + (b.c / s.head_dim - first_head), drate * rate);
  }
  __syncthreads();
  const int64_t last_c = min(block_c + kThreads * V, b.channels) - 1;
  const int64_t h = threadIdx.x;
  if (h <= last_c / s.head_dim - first_head) atomicAdd(d_A_log + first_head + h, head_sums[h]);
}

// The shape's checks, before any launch (and before a call of no tokens returns).
void check_decay(const KdaDecayShape& s, int values, const char* name) {
  check(s.tokens >= 0 && s.heads >= 1 && s.head_dim >= 1, name, ": shape ", s.tokens, " tokens x ", s.heads,
        " heads x ", s.head_dim);
  const int64_t per_block = int64_t{kThreads} * values;
  check((s.heads * s.head_dim + per_block - 1) / per_block <= 65535, name, ": ", s.heads * s.head_dim,
        " channels is too many for one launch");
}

// Channel blocks on grid.y, token tiles on grid.x: tiles of at least kMinTile tokens (whole steps of
// kTokens), few enough that the grid is one wave of `kernel`'s blocks (so the backward's atomics stay
// few per channel, and no block waits for a second wave).
struct DecayGrid {
  dim3 grid;
  int64_t tile;
};

template <int V, class Kernel>
DecayGrid decay_grid(const KdaDecayShape& s, Kernel kernel) {
  const int64_t per_block = int64_t{kThreads} * V;
  const int64_t channel_blocks = (s.heads * s.head_dim + per_block - 1) / per_block;
  const int64_t tiles = std::max<int64_t>(1, std::min((s.tokens + kMinTile - 1) / kMinTile,
                                                      resident_blocks_of(kernel, kThreads) / channel_blocks));
  const int64_t tile = ((s.tokens + tiles - 1) / tiles + kTokens<V> - 1) / kTokens<V> * kTokens<V>;
  return {dim3(static_cast<unsigned>((s.tokens + tile - 1) / tile), static_cast<unsigned>(channel_blocks)),
          tile};
}

// Channels a thread: the widest of 4, 2, 1 that divides the head (its channels share one rate) and
// keeps every access aligned.
int decay_values(const KdaDecayShape& s, std::initializer_list<Access> accesses) {
  return std::min(4, vector_width(accesses, s.head_dim));
}

// Calls launch(std::integral_constant<int, V>{}, std::bool_constant<s.bounded>{}) for the runtime
// `values` (4, 2 or 1): the decay's form fixed at compile time, no branch on it in the loops.
template <class Launch>
void with_form(const KdaDecayShape& s, int values, Launch&& launch) {
  const auto by_values = [&](auto bounded) {
    if (values == 4)
      launch(std::integral_constant<int, 4>{}, bounded);
    else if (values == 2)
      launch(std::integral_constant<int, 2>{}, bounded);
    else
      launch(std::integral_constant<int, 1>{}, bounded);
  };
  if (s.bounded)
    by_values(std::true_type{});
  else
    by_values(std::false_type{});
}

struct Sigmoid {
  __device__ float operator()(float x) const { return sigmoid(x); }
};

struct SigmoidGrad {
  __device__ float operator()(float y, float dy) const { return dy * y * (1.0f - y); }
};

}  // namespace

void kda_decay_forward(const KdaDecayShape& s, const float* f, const float* dt_bias, const float* A_log,
                       float* g, cudaStream_t stream) {
  const int values = decay_values(s, {{f, 4}, {g, 4}});
  check_decay(s, values, "kda_decay_forward");
  if (s.tokens == 0) return;
  with_form(s, values, [&](auto V, auto bounded) {
    const auto kernel = kda_decay_forward_kernel<decltype(V)::value, decltype(bounded)::value>;
    const DecayGrid d = decay_grid<decltype(V)::value>(s, kernel);
    launch_kernel(kernel, d.grid, kThreads, 0, stream, s, f, dt_bias, A_log, g, d.tile);
  });
  SPINDLE_LAUNCHED("kda_decay_forward_kernel");
}

void kda_decay_backward(const KdaDecayShape& s, const float* f, const float* dt_bias, const float* A_log,
                        const float* dg, __nv_bfloat16* df, float* d_dt_bias, float* d_A_log,
                        cudaStream_t stream) {
  const int values = decay_values(s, {{f, 4}, {dg, 4}, {df, 2}});
  check_decay(s, values, "kda_decay_backward");
  if (s.tokens == 0) return;
  with_form(s, values, [&](auto V, auto bounded) {
    const auto kernel = kda_decay_backward_kernel<decltype(V)::value, decltype(bounded)::value>;
    const DecayGrid d = decay_grid<decltype(V)::value>(s, kernel);
    launch_kernel(kernel, d.grid, kThreads, 0, stream, s, f, dt_bias, A_log, dg, df, d_dt_bias, d_A_log,
                  d.tile);
  });
  SPINDLE_LAUNCHED("kda_decay_backward_kernel");
}

void sigmoid_forward(const float* x, float* y, int64_t n, cudaStream_t stream) {
  launch_map("sigmoid_forward", Sigmoid{}, y, n, stream, x);
}

void sigmoid_backward(const float* y, const float* dy, __nv_bfloat16* dx, int64_t n, cudaStream_t stream) {
  launch_map("sigmoid_backward", SigmoidGrad{}, dx, n, stream, y, dy);
}

}  // namespace spindle::cuda
