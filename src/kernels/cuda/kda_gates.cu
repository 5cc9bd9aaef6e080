// KDA gates. The decay: one thread per channel walks a tile of tokens (a warp's loads are one
// contiguous run per token) with its channel's bias and rate in registers; backward, the tile's
// parameter gradients are summed in registers, then added with one atomic per channel (d_dt_bias)
// and per head (d_A_log, combined across the block in shared memory) per block. The tile is as
// long as keeps the grid at about one resident wave. The sigmoid is an elementwise map.
#include <algorithm>

#include "backend/cuda/check.h"
#include "core/error.h"
#include "kernels/cuda/kda_gates.h"
#include "kernels/cuda/memory_bound.cuh"

namespace spindle::cuda {

namespace {

constexpr int kThreads = 128;  // channels per block
constexpr int64_t kMinTile = 16;

__device__ __forceinline__ float sigmoid(float a) { return 1.0f / (1.0f + expf(-a)); }

__device__ __forceinline__ float softplus_thresholded(float a) { return a > 20.0f ? a : log1pf(expf(a)); }

// The thread's channel c (of `channels`) and its block's tokens [t0, t1).
struct DecayTile {
  int64_t channels, c, t0, t1;
};

__device__ DecayTile decay_tile(const KdaDecayShape& s, int64_t tile) {
  const int64_t t0 = static_cast<int64_t>(blockIdx.x) * tile;
  return {s.heads * s.head_dim, static_cast<int64_t>(blockIdx.y) * kThreads + threadIdx.x, t0,
          min(t0 + tile, s.tokens)};
}

__global__ void __launch_bounds__(kThreads)
    kda_decay_forward_kernel(KdaDecayShape s, const float* f, const float* dt_bias, const float* A_log,
                             float* g, int64_t tile) {
  const DecayTile b = decay_tile(s, tile);
  if (b.c >= b.channels) return;
  const float bias = dt_bias[b.c], rate = expf(A_log[b.c / s.head_dim]);
#pragma unroll 4
  for (int64_t t = b.t0; t < b.t1; ++t) {
    const float pre = f[t * b.channels + b.c] + bias;
    g[t * b.channels + b.c] =
        s.bounded ? s.lower_bound * sigmoid(rate * pre) : -rate * softplus_thresholded(pre);
  }
}

// As kda_backward: bounded, with u = rate pre and sg = sigmoid(u): du = dg lb sg (1 - sg),
// dpre = du rate, drate = du pre; else dpre = -rate sigmoid(pre) dg (slope 1 above 20),
// drate = -softplus(pre) dg. d_A_log = sum drate rate (rate = exp(A_log)).
__global__ void __launch_bounds__(kThreads)
    kda_decay_backward_kernel(KdaDecayShape s, const float* f, const float* dt_bias, const float* A_log,
                              const float* dg, __nv_bfloat16* df, float* d_dt_bias, float* d_A_log,
                              int64_t tile) {
  __shared__ float head_sums[kThreads];
  const DecayTile b = decay_tile(s, tile);
  head_sums[threadIdx.x] = 0.0f;
  __syncthreads();
  const int64_t first_head = static_cast<int64_t>(blockIdx.y) * kThreads / s.head_dim;
  if (b.c < b.channels) {
    const float bias = dt_bias[b.c], rate = expf(A_log[b.c / s.head_dim]);
    float dbias = 0.0f, drate = 0.0f;
#pragma unroll 4
    for (int64_t t = b.t0; t < b.t1; ++t) {
      const int64_t at = t * b.channels + b.c;
      const float pre = f[at] + bias, grad = dg[at];
      float dpre;
      if (s.bounded) {
        const float sg = sigmoid(rate * pre);
        const float du = grad * s.lower_bound * sg * (1.0f - sg);
        dpre = du * rate;
        drate += du * pre;
      } else {
        dpre = -rate * (pre > 20.0f ? 1.0f : sigmoid(pre)) * grad;
        drate -= softplus_thresholded(pre) * grad;
      }
      df[at] = __float2bfloat16(dpre);
      dbias += dpre;
    }
    atomicAdd(d_dt_bias + b.c, dbias);
    atomicAdd(head_sums + (b.c / s.head_dim - first_head), drate * rate);
  }
  __syncthreads();
  const int64_t last_c = min(static_cast<int64_t>(blockIdx.y + 1) * kThreads, b.channels) - 1;
  if (threadIdx.x <= last_c / s.head_dim - first_head)
    atomicAdd(d_A_log + first_head + threadIdx.x, head_sums[threadIdx.x]);
}

// Channel blocks on grid.y, token tiles on grid.x: tiles of at least kMinTile tokens, few enough
// that the grid is about one resident wave (so the backward's atomics stay few per channel).
struct DecayGrid {
  dim3 grid;
  int64_t tile;
};

DecayGrid decay_grid(const KdaDecayShape& s, const char* name) {
  check(s.tokens >= 0 && s.heads >= 1 && s.head_dim >= 1, name, ": shape ", s.tokens, " tokens x ", s.heads,
        " heads x ", s.head_dim);
  const int64_t channel_blocks = (s.heads * s.head_dim + kThreads - 1) / kThreads;
  check(channel_blocks <= 65535, name, ": ", s.heads * s.head_dim, " channels is too many for one launch");
  const int64_t tiles = std::max<int64_t>(
      1, std::min((s.tokens + kMinTile - 1) / kMinTile, resident_blocks(kThreads) / channel_blocks));
  const int64_t tile = std::max<int64_t>(1, (s.tokens + tiles - 1) / tiles);
  return {dim3(static_cast<unsigned>((s.tokens + tile - 1) / tile), static_cast<unsigned>(channel_blocks)),
          tile};
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
  const DecayGrid d = decay_grid(s, "kda_decay_forward");
  if (s.tokens == 0) return;
  kda_decay_forward_kernel<<<d.grid, kThreads, 0, stream>>>(s, f, dt_bias, A_log, g, d.tile);
  SPINDLE_LAUNCHED("kda_decay_forward_kernel");
}

void kda_decay_backward(const KdaDecayShape& s, const float* f, const float* dt_bias, const float* A_log,
                        const float* dg, __nv_bfloat16* df, float* d_dt_bias, float* d_A_log,
                        cudaStream_t stream) {
  const DecayGrid d = decay_grid(s, "kda_decay_backward");
  if (s.tokens == 0) return;
  kda_decay_backward_kernel<<<d.grid, kThreads, 0, stream>>>(s, f, dt_bias, A_log, dg, df, d_dt_bias, d_A_log,
                                                             d.tile);
  SPINDLE_LAUNCHED("kda_decay_backward_kernel");
}

void sigmoid_forward(const float* x, float* y, int64_t n, cudaStream_t stream) {
  launch_map("sigmoid_forward", Sigmoid{}, y, n, stream, x);
}

void sigmoid_backward(const float* y, const float* dy, __nv_bfloat16* dx, int64_t n, cudaStream_t stream) {
  launch_map("sigmoid_backward", SigmoidGrad{}, dx, n, stream, y, dy);
}

}  // namespace spindle::cuda
