// MoE dispatch kernels, all memory-bound: one warp per sorted row (the down projection's backward)
// or per token (gather, combine, the scatter backward), its lanes striding over the row in pieces of N bf16
// (N = 8, 2 or 1, a template argument). A token's topk row addresses and weights sit in registers
// (the slot loop is unrolled to 8), so its rows' loads are independent and issue together.
#include <algorithm>
#include <climits>
#include <cstring>
#include <initializer_list>
#include <type_traits>

#include "backend/cuda/check.h"
#include "kernels/cuda/launch.cuh"
#include "kernels/cuda/moe_dispatch.h"
#include "kernels/cuda/warp_reduce.cuh"

namespace spindle::cuda {

namespace {

using bf16 = __nv_bfloat16;

constexpr int kThreads = 256;
constexpr int kWarps = kThreads / 32;
constexpr int kMaxTopk = 8;
constexpr int64_t kMaxBlocks = 65536;

// The type that moves N bf16 in one access.
template <int N>
using Piece = std::conditional_t<N == 8, uint4, std::conditional_t<N == 2, uint32_t, uint16_t>>;

template <int N>
__device__ void load(const bf16* p, float (&out)[N]) {
  const Piece<N> raw = *reinterpret_cast<const Piece<N>*>(p);
  bf16 h[N];
  memcpy(h, &raw, sizeof(raw));
#pragma unroll
  for (int j = 0; j < N; ++j) out[j] = __bfloat162float(h[j]);
}

template <int N>
__device__ void store(bf16* p, const float (&in)[N]) {
  bf16 h[N];
#pragma unroll
  for (int j = 0; j < N; ++j) h[j] = __float2bfloat16(in[j]);
  Piece<N> raw;
  memcpy(&raw, h, sizeof(raw));
  *reinterpret_cast<Piece<N>*>(p) = raw;
}

// fp32 pieces of N: float, float2 or two float4.
template <int N>
using FloatPiece = std::conditional_t<N == 1, float, std::conditional_t<N == 2, float2, float4>>;

template <int N>
__device__ void load(const float* p, float (&out)[N]) {
#pragma unroll
  for (int j = 0; j < N; j += static_cast<int>(sizeof(FloatPiece<N>) / sizeof(float))) {
    const FloatPiece<N> raw = *reinterpret_cast<const FloatPiece<N>*>(p + j);
    memcpy(out + j, &raw, sizeof(raw));
  }
}

template <int N>
__device__ void store(float* p, const float (&in)[N]) {
#pragma unroll
  for (int j = 0; j < N; j += static_cast<int>(sizeof(FloatPiece<N>) / sizeof(float))) {
    FloatPiece<N> raw;
    memcpy(&raw, in + j, sizeof(raw));
    *reinterpret_cast<FloatPiece<N>*>(p + j) = raw;
  }
}

__device__ int64_t warp_index() { return (blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x) / 32; }

__device__ int64_t warp_count() { return static_cast<int64_t>(gridDim.x) * blockDim.x / 32; }

// A warp per token: its row read once (kUnroll pieces a lane in flight), then written to each of
// its topk sorted rows. By sorted row instead, a token's row was read topk times, scattered in time.
constexpr int kUnroll = 8;

template <int N>
__global__ void gather_kernel(const bf16* __restrict__ x, const int32_t* __restrict__ inverse, int64_t tokens,
                              int topk, int64_t D, bf16* __restrict__ rows) {
  wait_for_earlier_kernels();
  const int lane = threadIdx.x % 32;
  const int64_t pieces = D / N;
  for (int64_t t = warp_index(); t < tokens; t += warp_count()) {
    const auto* src = reinterpret_cast<const Piece<N>*>(x + t * D);
    Piece<N>* dst[kMaxTopk] = {};
#pragma unroll
    for (int k = 0; k < kMaxTopk; ++k)
      if (k < topk) dst[k] = reinterpret_cast<Piece<N>*>(rows + inverse[t * topk + k] * D);
    for (int64_t i0 = lane; i0 < pieces; i0 += 32 * kUnroll) {
      Piece<N> v[kUnroll];
#pragma unroll
      for (int u = 0; u < kUnroll; ++u)
        if (i0 + 32 * u < pieces) v[u] = src[i0 + 32 * u];
#pragma unroll
      for (int k = 0; k < kMaxTopk; ++k)
        if (k < topk) {
#pragma unroll
          for (int u = 0; u < kUnroll; ++u)
            if (i0 + 32 * u < pieces) dst[k][i0 + 32 * u] = v[u];
        }
    }
  }
}

// `shared` and `y` may be the same buffer: each lane reads its piece before writing it.
template <int N>
__global__ void combine_kernel(const bf16* __restrict__ rows, const int32_t* __restrict__ inverse,
                               const float* __restrict__ weight, const bf16* shared, int64_t tokens, int topk,
                               int64_t D, bf16* y) {
  wait_for_earlier_kernels();
  const int lane = threadIdx.x % 32;
  for (int64_t t = warp_index(); t < tokens; t += warp_count()) {
    const bf16* src[kMaxTopk] = {};
    float w[kMaxTopk] = {};
#pragma unroll
    for (int k = 0; k < kMaxTopk; ++k)
      if (k < topk) {
        src[k] = rows + inverse[t * topk + k] * D;
        w[k] = weight[t * topk + k];
      }
    for (int64_t i = lane * N; i < D; i += 32 * N) {
      float acc[N], r[N];
      load(shared + t * D + i, acc);
#pragma unroll
      for (int k = 0; k < kMaxTopk; ++k)
        if (k < topk) {
          load(src[k] + i, r);
#pragma unroll
          for (int j = 0; j < N; ++j) acc[j] += w[k] * r[j];
        }
      store(y + t * D + i, acc);
    }
  }
}

template <int N>
__global__ void down_backward_kernel(const int32_t* __restrict__ permutation,
                                     const float* __restrict__ weight, int64_t assignments, int64_t I,
                                     bf16* __restrict__ g, bf16* __restrict__ hidden,
                                     float* __restrict__ dweight) {
  wait_for_earlier_kernels();
  const int lane = threadIdx.x % 32;
  for (int64_t r = warp_index(); r < assignments; r += warp_count()) {
    const int32_t a = permutation[r];
    const float w = weight[a];
    float dot = 0.0f;
    for (int64_t i = lane * N; i < I; i += 32 * N) {
      float gv[N], hv[N];
      load(g + r * I + i, gv);
      load(hidden + r * I + i, hv);
#pragma unroll
      for (int j = 0; j < N; ++j) {
        dot += gv[j] * hv[j];
        gv[j] *= w;
        hv[j] *= w;
      }
      store(g + r * I + i, gv);
      store(hidden + r * I + i, hv);
    }
    const float total = warp_sum(dot);
    if (lane == 0) dweight[a] = total;
  }
}

template <int N>
__global__ void scatter_backward_kernel(const bf16* __restrict__ drows, const int32_t* __restrict__ inverse,
                                        int64_t tokens, int topk, int64_t D, float* __restrict__ dx) {
  wait_for_earlier_kernels();
  const int lane = threadIdx.x % 32;
  for (int64_t t = warp_index(); t < tokens; t += warp_count()) {
    const bf16* src[kMaxTopk] = {};
#pragma unroll
    for (int k = 0; k < kMaxTopk; ++k)
      if (k < topk) src[k] = drows + inverse[t * topk + k] * D;
    for (int64_t i = lane * N; i < D; i += 32 * N) {
      float sum[N] = {}, r[N], acc[N];
#pragma unroll
      for (int k = 0; k < kMaxTopk; ++k)
        if (k < topk) {
          load(src[k] + i, r);
#pragma unroll
          for (int j = 0; j < N; ++j) sum[j] += r[j];
        }
      load(dx + t * D + i, acc);
#pragma unroll
      for (int j = 0; j < N; ++j) acc[j] += sum[j];
      store(dx + t * D + i, acc);
    }
  }
}

// The widest piece (8, 2 or 1 elements) that D splits into and every pointer is aligned for.
int piece_width(int64_t D, std::initializer_list<const void*> pointers) {
  auto aligned = [&](uintptr_t bytes) {
    for (const void* p : pointers)
      if (reinterpret_cast<uintptr_t>(p) % bytes != 0) return false;
    return true;
  };
  if (D % 8 == 0 && aligned(16)) return 8;
  if (D % 2 == 0 && aligned(8)) return 2;
  return 1;
}

// Calls launch(std::integral_constant<int, N>) for the piece width N.
template <class Launch>
void with_piece_width(int width, Launch&& launch) {
  if (width == 8)
    launch(std::integral_constant<int, 8>{});
  else if (width == 2)
    launch(std::integral_constant<int, 2>{});
  else
    launch(std::integral_constant<int, 1>{});
}

unsigned warp_blocks(int64_t warps) {
  return static_cast<unsigned>(std::min<int64_t>((warps + kWarps - 1) / kWarps, kMaxBlocks));
}

void check_shape(const char* what, int64_t assignments, int64_t topk, int64_t D) {
  check(topk >= 1 && topk <= kMaxTopk, what, ": topk ", topk, " must be in 1..", kMaxTopk);
  check(assignments >= 0 && assignments < INT_MAX, what, ": ", assignments, " assignments (int32 limit)");
  check(D > 0, what, ": D must be positive, got ", D);
}

}  // namespace

void gather_expert_rows(const bf16* x, const int32_t* inverse, int64_t tokens, int64_t topk, int64_t D,
                        bf16* rows, cudaStream_t stream) {
  check_shape("gather_expert_rows", tokens * topk, topk, D);
  if (tokens == 0) return;
  with_piece_width(piece_width(D, {x, rows}), [&](auto n) {
    launch_kernel(gather_kernel<decltype(n)::value>, warp_blocks(tokens), kThreads, 0, stream, x, inverse,
                  tokens, static_cast<int>(topk), D, rows);
  });
  SPINDLE_LAUNCHED("gather_kernel");
}

void combine_expert_rows(const bf16* rows, const int32_t* inverse, const float* weight, const bf16* shared,
                         int64_t tokens, int64_t topk, int64_t D, bf16* y, cudaStream_t stream) {
  check_shape("combine_expert_rows", tokens * topk, topk, D);
  if (tokens == 0) return;
  with_piece_width(piece_width(D, {rows, shared, y}), [&](auto n) {
    launch_kernel(combine_kernel<decltype(n)::value>, warp_blocks(tokens), kThreads, 0, stream, rows, inverse,
                  weight, shared, tokens, static_cast<int>(topk), D, y);
  });
  SPINDLE_LAUNCHED("combine_kernel");
}

void expert_down_backward(const int32_t* permutation, const float* weight, int64_t assignments, int64_t I,
                          bf16* g, bf16* hidden, float* dweight, cudaStream_t stream) {
  check_shape("expert_down_backward", assignments, 1, I);
  if (assignments == 0) return;
  with_piece_width(piece_width(I, {g, hidden}), [&](auto n) {
    launch_kernel(down_backward_kernel<decltype(n)::value>, warp_blocks(assignments), kThreads, 0, stream,
                  permutation, weight, assignments, I, g, hidden, dweight);
  });
  SPINDLE_LAUNCHED("down_backward_kernel");
}

void scatter_expert_rows_backward(const bf16* drows, const int32_t* inverse, int64_t tokens, int64_t topk,
                                  int64_t D, float* dx, cudaStream_t stream) {
  check_shape("scatter_expert_rows_backward", tokens * topk, topk, D);
  if (tokens == 0) return;
  with_piece_width(piece_width(D, {drows, dx}), [&](auto n) {
    launch_kernel(scatter_backward_kernel<decltype(n)::value>, warp_blocks(tokens), kThreads, 0, stream,
                  drows, inverse, tokens, static_cast<int>(topk), D, dx);
  });
  SPINDLE_LAUNCHED("scatter_backward_kernel");
}

}  // namespace spindle::cuda
