// Depthwise causal conv + SiLU. One thread per V adjacent channels (V = 2, bf16x2 accesses, when
// channels is even and the pointers 4-byte aligned; else 1) walks a tile of kStagedTile tokens, keeping
// the last K inputs (and, backward, the last K pre-activation gradients) in registers: each input
// is read once per tile plus a K - 1 halo. Consecutive threads take consecutive channels, so a
// warp's accesses are one contiguous run per token. A thread's token loop would otherwise be a
// chain of dependent global loads: both directions stage the thread's column of the tile by
// cp.async first (with unaligned rows, loads of kBatch tokens are issued before their arithmetic).
#include <algorithm>
#include <cstdint>
#include <initializer_list>

#include "backend/cuda/check.h"
#include "core/error.h"
#include "kernels/cuda/conv.h"
#include "kernels/cuda/memory_bound.cuh"
#include "kernels/cuda/mma.cuh"

namespace spindle::cuda {

namespace {

constexpr int kThreads = 128;  // threads per block
constexpr int kBatch = 8;      // tokens whose loads are in flight together
constexpr int kMaxKernel = 8;

// By the SFU's exponential and reciprocal (two instructions each, a few ulp): expf and the IEEE
// division were most of the kernels' instructions, and the results are rounded to bf16.
__device__ __forceinline__ float sigmoid(float a) { return __fdividef(1.0f, 1.0f + __expf(-a)); }

template <int V>
__device__ __forceinline__ void load_values(const __nv_bfloat16* __restrict__ p, float (&out)[V]) {
  if constexpr (V == 2) {
    const float2 f = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(p));
    out[0] = f.x;
    out[1] = f.y;
  } else {
    out[0] = __bfloat162float(*p);
  }
}

template <int V>
__device__ __forceinline__ void store_values(__nv_bfloat16* __restrict__ p, const float (&v)[V]) {
  if constexpr (V == 2)
    *reinterpret_cast<__nv_bfloat162*>(p) = __floats2bfloat162_rn(v[0], v[1]);
  else
    *p = __float2bfloat16(v[0]);
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
// shift: win[v][j] = x[t0 - K + j, c + v] for j >= 1.
template <int K, int V>
__device__ __forceinline__ void load_halo(const __nv_bfloat16* __restrict__ x, int64_t c, int64_t t0,
                                          int64_t channels, float (&win)[V][K]) {
#pragma unroll
  for (int j = 0; j < K; ++j) {
    const int64_t src = t0 - K + j;
    float halo[V] = {};
    if (j > 0 && src >= 0) load_values<V>(x + src * channels + c, halo);
#pragma unroll
    for (int v = 0; v < V; ++v) win[v][j] = halo[v];
  }
}

// Tokens per tile: few enough that the staged rows (below) leave room for several blocks per SM.
constexpr int kStagedTile = 32;
static_assert(kStagedTile / 2 % kBatch == 0, "the second half of the staged rows starts a batch");

// With two channels a thread (V = 2) the forward, like the backward below, first copies its column
// of the tile's x rows (and the K - 1 before them) into shared memory by cp.async, in two groups;
// each thread reads back only what it copied. With one it reads them from global memory in batches.
template <int K, int V>
__global__ void __launch_bounds__(kThreads)
    causal_conv_silu_kernel(const __nv_bfloat16* __restrict__ x, const float* __restrict__ w,
                            __nv_bfloat16* __restrict__ y, int64_t tokens, int64_t channels) {
  extern __shared__ __nv_bfloat162 staged_x[];  // [kStagedTile + K - 1][kThreads]
  const int64_t c = (static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x) * V;
  if (c >= channels) return;
  const int64_t t0 = static_cast<int64_t>(blockIdx.y) * kStagedTile;
  const int64_t t1 = min(t0 + kStagedTile, tokens);
  const int64_t x0 = t0 - (K - 1);  // the first staged row: the halo before the tile
  __nv_bfloat162* column = staged_x + threadIdx.x;
  if constexpr (V == 2) {
    const int64_t middle = min(t0 + kStagedTile / 2, t1);
    for (int64_t u = x0; u < middle; ++u)
      copy4(column + (u - x0) * kThreads, x + max(u, int64_t{0}) * channels + c, u >= 0);
    copy_commit();
    for (int64_t u = middle; u < t1; ++u) copy4(column + (u - x0) * kThreads, x + u * channels + c, true);
    copy_commit();
  }
  float wr[V][K], win[V][K];  // after the shift at token t: win[v][j] = x[t - (K - 1) + j, c + v]
  load_taps<K, V>(w, c, wr);
  if constexpr (V == 2) {
    copy_wait_all_but_newest();
#pragma unroll
    for (int j = 1; j < K; ++j) {  // zeros before the sequence were staged as zeros
      const float2 f = __bfloat1622float2(column[(j - 1) * kThreads]);
      win[0][j] = f.x;
      win[1][j] = f.y;
    }
  } else {
    load_halo<K, V>(x, c, t0, channels, win);
  }
  for (int64_t tb = t0; tb < t1; tb += kBatch) {
    if (V == 2 && tb == t0 + kStagedTile / 2) copy_wait_all();
    float in[kBatch][V];
#pragma unroll
    for (int b = 0; b < kBatch; ++b) {
      if (tb + b < t1) {
        if constexpr (V == 2) {
          const float2 f = __bfloat1622float2(column[(tb + b - x0) * kThreads]);
          in[b][0] = f.x;
          in[b][1] = f.y;
        } else {
          load_values<V>(x + (tb + b) * channels + c, in[b]);
        }
      }
    }
#pragma unroll
    for (int b = 0; b < kBatch; ++b) {
      if (tb + b >= t1) break;
      float out[V];
#pragma unroll
      for (int v = 0; v < V; ++v) {
#pragma unroll
        for (int j = 0; j + 1 < K; ++j) win[v][j] = win[v][j + 1];
        win[v][K - 1] = in[b][v];
        float a = 0.0f;
#pragma unroll
        for (int j = 0; j < K; ++j) a = fmaf(wr[v][j], win[v][j], a);
        out[v] = a * sigmoid(a);
      }
      store_values<V>(y + (tb + b) * channels + c, out);
    }
  }
}

// Dynamic shared memory of the forward: its staged x rows (the tile and its halo) at V = 2, else none.
template <int K, int V>
constexpr size_t kForwardShared = V == 2 ? size_t{kStagedTile + K - 1} * kThreads * sizeof(__nv_bfloat162)
                                         : 0;

template <int K>
constexpr int kStagedRows = 2 * kStagedTile + 3 * (K - 1);  // x's rows then dy's, per thread column

// Dynamic shared memory of the backward: its staged rows at V = 2, else none.
template <int K, int V>
constexpr size_t kBackwardShared = V == 2 ? size_t{kStagedRows<K>} * kThreads * sizeof(__nv_bfloat162) : 0;

// Walks u over [t0, t1 + K - 1): da[u] = dy[u] silu'(a[u]) (zero past the end), dw from the
// tile's own da, and dx[t] = sum_j da[t + K - 1 - j] w[j] once da[t .. t + K - 1] are known. With two
// channels a thread (V = 2) it first copies its column of the tile's x and dy rows into shared
// memory by cp.async, all in flight at once without holding registers, in two groups so that the
// first half's arithmetic overlaps the second half's loads; each thread reads back only what it
// copied, so no barrier. With one (odd channels or unaligned rows) it reads them from global memory.
// A block takes `tiles` consecutive tiles and adds its dw sums once: every block's atomics land on
// the same channels K addresses, and one set per 32-token tile cost about an eighth of its time.
template <int K, int V>
__global__ void __launch_bounds__(kThreads)
    causal_conv_silu_backward_kernel(const __nv_bfloat16* __restrict__ x, const float* __restrict__ w,
                                     const __nv_bfloat16* __restrict__ dy, __nv_bfloat16* __restrict__ dx,
                                     int64_t dx_ld, float* __restrict__ dw, int64_t tokens, int64_t channels,
                                     int tiles) {
  extern __shared__ __nv_bfloat162 staged[];  // [kStagedRows<K>][kThreads]: x rows, then dy rows
  const int64_t c = (static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x) * V;
  if (c >= channels) return;
  __nv_bfloat162* column = staged + threadIdx.x;
  float wr[V][K], dwacc[V][K] = {};
  load_taps<K, V>(w, c, wr);
  const int64_t tile_count = (tokens + kStagedTile - 1) / kStagedTile;
  const int64_t first = static_cast<int64_t>(blockIdx.y) * tiles, last = min(first + tiles, tile_count);
#pragma unroll 1
  for (int64_t tile = first; tile < last; ++tile) {
    const int64_t t0 = tile * kStagedTile;
    const int64_t t1 = min(t0 + kStagedTile, tokens), u1 = min(t1 + K - 1, tokens);
    const int64_t x0 = t0 - (K - 1);  // x's first staged row: the halo before the tile
    const int x_rows = static_cast<int>(u1 - x0);
    if constexpr (V == 2) {
      const auto stage = [&](int64_t from, int64_t to) {  // rows [from, to) of both, clipped to each's own
        for (int64_t u = max(from, x0); u < min(to, u1); ++u)
          copy4(column + (u - x0) * kThreads, x + max(u, int64_t{0}) * channels + c, u >= 0);
        for (int64_t u = max(from, t0); u < min(to, u1); ++u)
          copy4(column + (x_rows + u - t0) * kThreads, dy + u * channels + c, true);
        copy_commit();
      };
      const int64_t middle = t0 + kStagedTile / 2;
      stage(x0, middle);
      stage(middle, u1);
    }
    const auto read = [&](const __nv_bfloat16* global, int staged_row, int64_t u, float(&out)[V]) {
      if constexpr (V == 2) {
        const float2 f = __bfloat1622float2(column[staged_row * kThreads]);
        out[0] = f.x;
        out[1] = f.y;
      } else {
        load_values<V>(global + u * channels + c, out);
      }
    };
    if constexpr (V == 2) copy_wait_all_but_newest();
    // The window before the tile's first shift: win[v][j] = x[t0 - K + j, c + v] for j >= 1.
    float win[V][K], dh[V][K] = {};  // dh[v][j] = da[u - (K - 1) + j, c + v]
#pragma unroll
    for (int j = 1; j < K; ++j) {
      const int64_t u = t0 - K + j;
      float halo[V] = {};
      if (u >= 0) read(x, static_cast<int>(u - x0), u, halo);
#pragma unroll
      for (int v = 0; v < V; ++v) win[v][j] = halo[v];
    }
    // In unrolled batches of kBatch tokens: the windows' shifts become renamed registers, not moves.
    for (int64_t ub = t0; ub < t1 + K - 1; ub += kBatch) {
      if (V == 2 && ub == t0 + kStagedTile / 2) copy_wait_all();
#pragma unroll
      for (int b = 0; b < kBatch; ++b) {
        const int64_t u = ub + b;
        if (u >= t1 + K - 1) break;
        float xin[V] = {}, dyin[V] = {};  // zero past the end of the sequence
        if (u < u1) {
          read(x, static_cast<int>(u - x0), u, xin);
          read(dy, x_rows + static_cast<int>(u - t0), u, dyin);
        }
        float g[V];
#pragma unroll
        for (int v = 0; v < V; ++v) {
#pragma unroll
          for (int j = 0; j + 1 < K; ++j) {
            win[v][j] = win[v][j + 1];
            dh[v][j] = dh[v][j + 1];
          }
          win[v][K - 1] = xin[v];
          float a = 0.0f;
#pragma unroll
          for (int j = 0; j < K; ++j) a = fmaf(wr[v][j], win[v][j], a);
          const float sg = sigmoid(a);
          const float da = dyin[v] * sg * (1.0f + a * (1.0f - sg));
          dh[v][K - 1] = da;
          if (u < t1) {
#pragma unroll
            for (int j = 0; j < K; ++j) dwacc[v][j] = fmaf(da, win[v][j], dwacc[v][j]);
          }
          g[v] = 0.0f;
#pragma unroll
          for (int j = 0; j < K; ++j) g[v] = fmaf(dh[v][K - 1 - j], wr[v][j], g[v]);
        }
        if (u >= t0 + K - 1) store_values<V>(dx + (u - (K - 1)) * dx_ld + c, g);
      }
    }
  }
  // One atomic per tap for the block's tiles (their sum is already in registers).
#pragma unroll
  for (int v = 0; v < V; ++v)
#pragma unroll
    for (int j = 0; j < K; ++j) atomicAdd(dw + (c + v) * K + j, dwacc[v][j]);
}

// Two channels per thread when every row of every tensor starts 4-byte aligned.
int values_per_thread(int64_t channels, std::initializer_list<const void*> tensors) {
  if (channels % 2 != 0) return 1;
  for (const void* p : tensors)
    if (reinterpret_cast<uintptr_t>(p) % 4 != 0) return 1;
  return 2;
}

dim3 conv_grid(int64_t tokens, int64_t channels, int64_t kernel, int values, int64_t tile) {
  check(kernel >= 1 && kernel <= kMaxKernel, "causal_conv_silu: kernel size ", kernel, " (expected 1 to ",
        kMaxKernel, ")");
  const int64_t per_block = int64_t{kThreads} * values;
  const int64_t tiles = (tokens + tile - 1) / tile, blocks = (channels + per_block - 1) / per_block;
  check(tiles <= 65535 && blocks <= 0x7fffffff, "causal_conv_silu: ", tokens, " tokens x ", channels,
        " channels is too large for one launch");
  return dim3(static_cast<unsigned>(blocks), static_cast<unsigned>(tiles));
}

}  // namespace

namespace {

template <int K, int V>
void launch_forward(const __nv_bfloat16* x, const float* w, __nv_bfloat16* y, int64_t tokens,
                    int64_t channels, cudaStream_t stream) {
  causal_conv_silu_kernel<K, V>
      <<<conv_grid(tokens, channels, K, V, kStagedTile), kThreads, kForwardShared<K, V>, stream>>>(
          x, w, y, tokens, channels);
}

// The backward's grid: its tiles in runs, about one wave of blocks in all.
template <int K, int V>
void launch_backward(const __nv_bfloat16* x, const float* w, const __nv_bfloat16* dy, __nv_bfloat16* dx,
                     int64_t dx_ld, float* dw, int64_t tokens, int64_t channels, cudaStream_t stream) {
  const auto kernel = causal_conv_silu_backward_kernel<K, V>;
  const dim3 all = conv_grid(tokens, channels, K, V, kStagedTile);
  const int64_t resident = resident_blocks_of(kernel, kThreads, kBackwardShared<K, V>);
  const int64_t runs = std::max<int64_t>(1, resident / all.x);
  const int64_t tiles = (all.y + runs - 1) / runs;
  const dim3 grid(all.x, static_cast<unsigned>((all.y + tiles - 1) / tiles));
  kernel<<<grid, kThreads, kBackwardShared<K, V>, stream>>>(x, w, dy, dx, dx_ld, dw, tokens, channels,
                                                            static_cast<int>(tiles));
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

}  // namespace

void causal_conv_silu(const __nv_bfloat16* x, const float* w, __nv_bfloat16* y, int64_t tokens,
                      int64_t channels, int64_t kernel, cudaStream_t stream) {
  const int values = values_per_thread(channels, {x, y});
  conv_grid(tokens, channels, kernel, values, kStagedTile);  // checks the shape
  if (tokens == 0 || channels == 0) return;
  if (values == 2) {
    SPINDLE_CONV_DISPATCH(launch_forward, 2, x, w, y, tokens, channels, stream)
  } else {
    SPINDLE_CONV_DISPATCH(launch_forward, 1, x, w, y, tokens, channels, stream)
  }
  SPINDLE_LAUNCHED("causal_conv_silu_kernel");
}

void causal_conv_silu_backward(const __nv_bfloat16* x, const float* w, const __nv_bfloat16* dy,
                               __nv_bfloat16* dx, int64_t dx_ld, float* dw, int64_t tokens, int64_t channels,
                               int64_t kernel, cudaStream_t stream) {
  check(dx_ld >= channels, "causal_conv_silu_backward: dx's rows ", dx_ld, " apart for ", channels,
        " channels");
  const int values = dx_ld % 2 == 0 ? values_per_thread(channels, {x, dy, dx}) : 1;
  conv_grid(tokens, channels, kernel, values, kStagedTile);  // checks the shape
  if (tokens == 0 || channels == 0) return;
  if (values == 2) {
    SPINDLE_CONV_DISPATCH(launch_backward, 2, x, w, dy, dx, dx_ld, dw, tokens, channels, stream)
  } else {
    SPINDLE_CONV_DISPATCH(launch_backward, 1, x, w, dy, dx, dx_ld, dw, tokens, channels, stream)
  }
  SPINDLE_LAUNCHED("causal_conv_silu_backward_kernel");
}

#undef SPINDLE_CONV_DISPATCH

}  // namespace spindle::cuda
