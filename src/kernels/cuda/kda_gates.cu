// KDA gates. The decay: each thread takes V adjacent channels (V = 4 where the row length and the
// pointers allow 16-byte fp32 accesses, else 2 or 1) and walks a tile of tokens (a warp's loads are
// one contiguous run per token) with its channels' biases and rates in registers: one fp32 a thread
// a token left the loads' latency exposed (ncu: most of the backward's cycles waited on them), so
// each thread has 8 / V tokens' loads in flight (read-only loads, which the stores do not hold back).
// Backward, the tile's parameter gradients are summed in registers, then added with one atomic per
// channel (d_dt_bias) and per head (d_A_log, combined across the block in shared memory) per block.
// The tile is as long as keeps the grid at about one resident wave. The sigmoid is an elementwise
// map.
#include <algorithm>

#include "backend/cuda/check.h"
#include "core/error.h"
#include "kernels/cuda/kda_gates.h"
#include "kernels/cuda/memory_bound.cuh"

namespace spindle::cuda {

namespace {

constexpr int kThreads = 128;  // threads per block
constexpr int64_t kMinTile = 16;

__device__ __forceinline__ float sigmoid(float a) { return 1.0f / (1.0f + expf(-a)); }

__device__ __forceinline__ float softplus_thresholded(float a) { return a > 20.0f ? a : log1pf(expf(a)); }

// The thread's first channel c (of `channels`; V of them from c) and its block's tokens [t0, t1).
struct DecayTile {
  int64_t channels, c, t0, t1;
};

template <int V>
__device__ DecayTile decay_tile(const KdaDecayShape& s, int64_t tile) {
  const int64_t t0 = static_cast<int64_t>(blockIdx.x) * tile;
  return {s.heads * s.head_dim, (static_cast<int64_t>(blockIdx.y) * kThreads + threadIdx.x) * V, t0,
          min(t0 + tile, s.tokens)};
}

// The V channels' biases and rates (rate = exp(A_log) of each channel's head).
template <int V>
__device__ __forceinline__ void load_parameters(const KdaDecayShape& s, const float* dt_bias,
                                                const float* A_log, int64_t c, float (&bias)[V],
                                                float (&rate)[V]) {
#pragma unroll
  for (int v = 0; v < V; ++v) {
    bias[v] = dt_bias[c + v];
    rate[v] = expf(A_log[(c + v) / s.head_dim]);
  }
}

template <int V, bool kBounded>
__global__ void __launch_bounds__(kThreads)
    kda_decay_forward_kernel(KdaDecayShape s, const float* __restrict__ f, const float* __restrict__ dt_bias,
                             const float* __restrict__ A_log, float* __restrict__ g, int64_t tile) {
  const DecayTile b = decay_tile<V>(s, tile);
  if (b.c >= b.channels) return;  // V divides channels: the thread's V channels are all there
  float bias[V], rate[V];
  load_parameters<V>(s, dt_bias, A_log, b.c, bias, rate);
#pragma unroll(8 / V)
  for (int64_t t = b.t0; t < b.t1; ++t) {
    float pre[V], out[V];
    load<V>(f + t * b.channels + b.c, pre);
#pragma unroll
    for (int v = 0; v < V; ++v) {
      pre[v] += bias[v];
      out[v] = kBounded ? s.lower_bound * sigmoid(rate[v] * pre[v]) : -rate[v] * softplus_thresholded(pre[v]);
    }
    store_global<V>(g + t * b.channels + b.c, out);
  }
}

// As kda_backward: bounded, with u = rate pre and sg = sigmoid(u): du = dg lb sg (1 - sg),
// dpre = du rate, drate = du pre; else dpre = -rate sigmoid(pre) dg (slope 1 above 20),
// drate = -softplus(pre) dg. d_A_log = sum drate rate (rate = exp(A_log)).
template <int V, bool kBounded>
__global__ void __launch_bounds__(kThreads)
    kda_decay_backward_kernel(KdaDecayShape s, const float* __restrict__ f, const float* __restrict__ dt_bias,
                              const float* __restrict__ A_log, const float* __restrict__ dg,
                              __nv_bfloat16* __restrict__ df, float* __restrict__ d_dt_bias,
                              float* __restrict__ d_A_log, int64_t tile) {
  __shared__ float head_sums[kThreads * V];  // the block's heads, from first_head
  const DecayTile b = decay_tile<V>(s, tile);
  for (int h = threadIdx.x; h < kThreads * V; h += kThreads) head_sums[h] = 0.0f;
  __syncthreads();
  const int64_t block_c = static_cast<int64_t>(blockIdx.y) * kThreads * V, first_head = block_c / s.head_dim;
  if (b.c < b.channels) {
    float bias[V], rate[V], dbias[V] = {}, drate[V] = {};
    load_parameters<V>(s, dt_bias, A_log, b.c, bias, rate);
#pragma unroll(8 / V)
    for (int64_t t = b.t0; t < b.t1; ++t) {
      const int64_t at = t * b.channels + b.c;
      float pre[V], grad[V], dpre[V];
      load<V>(f + at, pre);
      load<V>(dg + at, grad);
#pragma unroll
      for (int v = 0; v < V; ++v) {
        pre[v] += bias[v];
        if constexpr (kBounded) {
          const float sg = sigmoid(rate[v] * pre[v]);
          const float du = grad[v] * s.lower_bound * sg * (1.0f - sg);
          dpre[v] = du * rate[v];
          drate[v] += du * pre[v];
        } else {
          dpre[v] = -rate[v] * (pre[v] > 20.0f ? 1.0f : sigmoid(pre[v])) * grad[v];
          drate[v] -= softplus_thresholded(pre[v]) * grad[v];
        }
        dbias[v] += dpre[v];
      }
      store_global<V>(df + at, dpre);
    }
#pragma unroll
    for (int v = 0; v < V; ++v) {
      atomicAdd(d_dt_bias + b.c + v, dbias[v]);
      atomicAdd(head_sums + ((b.c + v) / s.head_dim - first_head), drate[v] * rate[v]);
    }
  }
  __syncthreads();
  const int64_t last_c = min(block_c + kThreads * V, b.channels) - 1;
  for (int64_t h = threadIdx.x; h <= last_c / s.head_dim - first_head; h += kThreads)
    atomicAdd(d_A_log + first_head + h, head_sums[h]);
}

// Channel blocks on grid.y, token tiles on grid.x: tiles of at least kMinTile tokens, few enough
// that the grid is about one resident wave (so the backward's atomics stay few per channel).
struct DecayGrid {
  dim3 grid;
  int64_t tile;
};

DecayGrid decay_grid(const KdaDecayShape& s, int values, const char* name) {
  check(s.tokens >= 0 && s.heads >= 1 && s.head_dim >= 1, name, ": shape ", s.tokens, " tokens x ", s.heads,
        " heads x ", s.head_dim);
  const int64_t per_block = int64_t{kThreads} * values;
  const int64_t channel_blocks = (s.heads * s.head_dim + per_block - 1) / per_block;
  check(channel_blocks <= 65535, name, ": ", s.heads * s.head_dim, " channels is too many for one launch");
  const int64_t tiles = std::max<int64_t>(
      1, std::min((s.tokens + kMinTile - 1) / kMinTile, resident_blocks(kThreads) / channel_blocks));
  const int64_t tile = std::max<int64_t>(1, (s.tokens + tiles - 1) / tiles);
  return {dim3(static_cast<unsigned>((s.tokens + tile - 1) / tile), static_cast<unsigned>(channel_blocks)),
          tile};
}

// Channels a thread: the widest of 4, 2, 1 that divides the row and keeps every access aligned.
int decay_values(const KdaDecayShape& s, std::initializer_list<Access> accesses) {
  return std::min(4, vector_width(accesses, s.heads * s.head_dim));
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
  const DecayGrid d = decay_grid(s, values, "kda_decay_forward");
  if (s.tokens == 0) return;
  with_form(s, values, [&](auto V, auto bounded) {
    kda_decay_forward_kernel<decltype(V)::value, decltype(bounded)::value>
        <<<d.grid, kThreads, 0, stream>>>(s, f, dt_bias, A_log, g, d.tile);
  });
  SPINDLE_LAUNCHED("kda_decay_forward_kernel");
}

void kda_decay_backward(const KdaDecayShape& s, const float* f, const float* dt_bias, const float* A_log,
                        const float* dg, __nv_bfloat16* df, float* d_dt_bias, float* d_A_log,
                        cudaStream_t stream) {
  const int values = decay_values(s, {{f, 4}, {dg, 4}, {df, 2}});
  const DecayGrid d = decay_grid(s, values, "kda_decay_backward");
  if (s.tokens == 0) return;
  with_form(s, values, [&](auto V, auto bounded) {
    kda_decay_backward_kernel<decltype(V)::value, decltype(bounded)::value>
        <<<d.grid, kThreads, 0, stream>>>(s, f, dt_bias, A_log, dg, df, d_dt_bias, d_A_log, d.tile);
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
