// Depthwise causal conv + SiLU. One thread per channel walks a tile of kTile tokens, keeping the
// last K inputs (and, backward, the last K pre-activation gradients) in registers: each input
// is read once per tile plus a K - 1 halo. Consecutive threads take consecutive channels, so
// every load and store of a warp is one contiguous 64-byte run per token.
// Later: two channels per thread (bf16x2) for 4-byte accesses when channels is even.
#include "backend/cuda/check.h"
#include "core/error.h"
#include "kernels/cuda/conv.h"

namespace spindle::cuda {

namespace {

constexpr int kThreads = 128;  // channels per block
constexpr int kTile = 64;      // tokens per thread
constexpr int kMaxKernel = 8;

__device__ __forceinline__ float sigmoid(float a) { return 1.0f / (1.0f + expf(-a)); }

template <int K>
__global__ void __launch_bounds__(kThreads)
    causal_conv_silu_kernel(const __nv_bfloat16* x, const float* w, __nv_bfloat16* y, int64_t tokens,
                            int64_t channels) {
  const int64_t c = static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x;
  if (c >= channels) return;
  const int64_t t0 = static_cast<int64_t>(blockIdx.y) * kTile;
  const int64_t t1 = min(t0 + kTile, tokens);
  float wr[K], win[K];  // after the shift at token t: win[j] = x[t - (K - 1) + j]
#pragma unroll
  for (int j = 0; j < K; ++j) {
    wr[j] = w[c * K + j];
    const int64_t src = t0 - K + j;
    win[j] = (j > 0 && src >= 0) ? __bfloat162float(x[src * channels + c]) : 0.0f;
  }
  for (int64_t t = t0; t < t1; ++t) {
#pragma unroll
    for (int j = 0; j + 1 < K; ++j) win[j] = win[j + 1];
    win[K - 1] = __bfloat162float(x[t * channels + c]);
    float a = 0.0f;
#pragma unroll
    for (int j = 0; j < K; ++j) a = fmaf(wr[j], win[j], a);
    y[t * channels + c] = __float2bfloat16(a * sigmoid(a));
  }
}

// Walks u over [t0, t1 + K - 1): da[u] = dy[u] silu'(a[u]) (zero past the end), dw from the
// tile's own da, and dx[t] = sum_j da[t + K - 1 - j] w[j] once da[t .. t + K - 1] are known.
template <int K>
__global__ void __launch_bounds__(kThreads)
    causal_conv_silu_backward_kernel(const __nv_bfloat16* x, const float* w, const __nv_bfloat16* dy,
                                     __nv_bfloat16* dx, float* dw, int64_t tokens, int64_t channels) {
  const int64_t c = static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x;
  if (c >= channels) return;
  const int64_t t0 = static_cast<int64_t>(blockIdx.y) * kTile;
  const int64_t t1 = min(t0 + kTile, tokens);
  float wr[K], win[K], dh[K], dwacc[K];  // dh[j] = da[u - (K - 1) + j]
#pragma unroll
  for (int j = 0; j < K; ++j) {
    wr[j] = w[c * K + j];
    const int64_t src = t0 - K + j;
    win[j] = (j > 0 && src >= 0) ? __bfloat162float(x[src * channels + c]) : 0.0f;
    dh[j] = 0.0f;
    dwacc[j] = 0.0f;
  }
  for (int64_t u = t0; u < t1 + K - 1; ++u) {
#pragma unroll
    for (int j = 0; j + 1 < K; ++j) {
      win[j] = win[j + 1];
      dh[j] = dh[j + 1];
    }
    float da = 0.0f;
    if (u < tokens) {
      win[K - 1] = __bfloat162float(x[u * channels + c]);
      float a = 0.0f;
#pragma unroll
      for (int j = 0; j < K; ++j) a = fmaf(wr[j], win[j], a);
      const float sg = sigmoid(a);
      da = __bfloat162float(dy[u * channels + c]) * sg * (1.0f + a * (1.0f - sg));
    } else {
      win[K - 1] = 0.0f;
    }
    dh[K - 1] = da;
    if (u < t1) {
#pragma unroll
      for (int j = 0; j < K; ++j) dwacc[j] = fmaf(da, win[j], dwacc[j]);
    }
    if (u >= t0 + K - 1) {
      float g = 0.0f;
#pragma unroll
      for (int j = 0; j < K; ++j) g = fmaf(dh[K - 1 - j], wr[j], g);
      dx[(u - (K - 1)) * channels + c] = __float2bfloat16(g);
    }
  }
  // One atomic per tap per tile of tokens (the tile's sum is already in registers).
#pragma unroll
  for (int j = 0; j < K; ++j) atomicAdd(dw + c * K + j, dwacc[j]);
}

dim3 conv_grid(int64_t tokens, int64_t channels, int64_t kernel) {
  check(kernel >= 1 && kernel <= kMaxKernel, "causal_conv_silu: kernel size ", kernel, " (expected 1 to ",
        kMaxKernel, ")");
  const int64_t tiles = (tokens + kTile - 1) / kTile, blocks = (channels + kThreads - 1) / kThreads;
  check(tiles <= 65535 && blocks <= 0x7fffffff, "causal_conv_silu: ", tokens, " tokens x ", channels,
        " channels is too large for one launch");
  return dim3(static_cast<unsigned>(blocks), static_cast<unsigned>(tiles));
}

}  // namespace

#define SPINDLE_CONV_DISPATCH(KERNEL, ...)                   \
  switch (kernel) {                                          \
    case 1:                                                  \
      KERNEL<1><<<grid, kThreads, 0, stream>>>(__VA_ARGS__); \
      break;                                                 \
    case 2:                                                  \
      KERNEL<2><<<grid, kThreads, 0, stream>>>(__VA_ARGS__); \
      break;                                                 \
    case 3:                                                  \
      KERNEL<3><<<grid, kThreads, 0, stream>>>(__VA_ARGS__); \
      break;                                                 \
    case 4:                                                  \
      KERNEL<4><<<grid, kThreads, 0, stream>>>(__VA_ARGS__); \
      break;                                                 \
    case 5:                                                  \
      KERNEL<5><<<grid, kThreads, 0, stream>>>(__VA_ARGS__); \
      break;                                                 \
    case 6:                                                  \
      KERNEL<6><<<grid, kThreads, 0, stream>>>(__VA_ARGS__); \
      break;                                                 \
    case 7:                                                  \
      KERNEL<7><<<grid, kThreads, 0, stream>>>(__VA_ARGS__); \
      break;                                                 \
    default:                                                 \
      KERNEL<8><<<grid, kThreads, 0, stream>>>(__VA_ARGS__); \
      break;                                                 \
  }

void causal_conv_silu(const __nv_bfloat16* x, const float* w, __nv_bfloat16* y, int64_t tokens,
                      int64_t channels, int64_t kernel, cudaStream_t stream) {
  const dim3 grid = conv_grid(tokens, channels, kernel);
  if (tokens == 0 || channels == 0) return;
  SPINDLE_CONV_DISPATCH(causal_conv_silu_kernel, x, w, y, tokens, channels)
  SPINDLE_LAUNCHED("causal_conv_silu_kernel");
}

void causal_conv_silu_backward(const __nv_bfloat16* x, const float* w, const __nv_bfloat16* dy,
                               __nv_bfloat16* dx, float* dw, int64_t tokens, int64_t channels, int64_t kernel,
                               cudaStream_t stream) {
  const dim3 grid = conv_grid(tokens, channels, kernel);
  if (tokens == 0 || channels == 0) return;
  SPINDLE_CONV_DISPATCH(causal_conv_silu_backward_kernel, x, w, dy, dx, dw, tokens, channels)
  SPINDLE_LAUNCHED("causal_conv_silu_backward_kernel");
}

#undef SPINDLE_CONV_DISPATCH

}  // namespace spindle::cuda
