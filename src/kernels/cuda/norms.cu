// Row normalisations. A row goes to one warp when 32 threads can hold it (D <= 512 elements; the
// gated norm's rows of at most 16 vectors to half a warp), else to a block of up to 512 threads
// with 16 elements each; each thread keeps its elements of the row in registers, so x is read once,
// with vector accesses where D and the pointers allow. The grid holds as many blocks of the kernel
// as the GPU runs at once (its occupancy) and strides over the rows; weight gradients are summed in
// registers over a thread's rows and added once per block, four elements an atomic where aligned (a
// block of warp rows combines its warps in shared memory first): every block adds to the same D
// addresses, and those atomics bounded the backward.
#include <algorithm>

#include "backend/cuda/check.h"
#include "core/error.h"
#include "kernels/cuda/launch.cuh"
#include "kernels/cuda/memory_bound.cuh"
#include "kernels/cuda/norms.h"

namespace spindle::cuda {

namespace {

using bf16 = __nv_bfloat16;

constexpr int kPerThread = 16;                     // row elements a thread holds
constexpr int kMaxBlock = kMaxNormD / kPerThread;  // threads on a row, at most
constexpr int kWarpRowsBlock = 256;                // a block of 8 warps, each on its own rows
constexpr int kMaxWarpD = 32 * kPerThread;

// A thread's place: its index among the `group` threads of its row, its first row and the step
// to its next one; the row's threads in its warp (`width` of them, `lanes` their mask) sum by
// shuffles. kGroup: 16 (half a warp per row, two rows a warp), 32 (a warp per row), kMaxBlock, or
// 0 for a block of blockDim.x; a compile-time group keeps the offsets of a thread's C vectors
// immediate, out of registers.
struct RowSlot {
  int lane, group, width;
  unsigned lanes;
  int64_t row, stride;
};

template <int kGroup>
__device__ RowSlot row_slot() {
  constexpr int width = kGroup == 0 || kGroup >= 32 ? 32 : kGroup;
  const int group = kGroup != 0 ? kGroup : static_cast<int>(blockDim.x);
  const int rows_per_block = static_cast<int>(blockDim.x) / group;
  const unsigned lanes =
      width == 32 ? 0xffffffffu : ((1u << width) - 1) << (threadIdx.x % 32 / width * width);
  return {static_cast<int>(threadIdx.x) % group,
          group,
          width,
          lanes,
          static_cast<int64_t>(blockIdx.x) * rows_per_block + threadIdx.x / group,
          static_cast<int64_t>(gridDim.x) * rows_per_block};
}

// First element of the thread's c-th vector of V; vectors at or past D are not the thread's.
__device__ __forceinline__ int element(const RowSlot& s, int c, int V) { return (c * s.group + s.lane) * V; }

// The thread's elements of a row (or of the weight) into registers; zeros past D, so that sums
// over the registers need no check.
template <int V, int C, class T>
__device__ void load_row(const T* row, const RowSlot& s, int D, float* out) {
#pragma unroll
  for (int c = 0; c < C; ++c) {
    const int e = element(s, c, V);
    if (e < D) {
      load<V>(row + e, out + c * V);
    } else {
#pragma unroll
      for (int j = 0; j < V; ++j) out[c * V + j] = 0.0f;
    }
  }
}

template <int V, int C>
__device__ void store_row(bf16* row, const RowSlot& s, int D, const float* in) {
#pragma unroll
  for (int c = 0; c < C; ++c) {
    const int e = element(s, c, V);
    if (e < D) store<V>(row + e, in + c * V);
  }
}

// The rows a thread reads, one after another. Where a thread holds few elements of a row (C = 1:
// one vector), it fetches its next row before it waits on this row's sums, so that the row sums'
// barriers do not leave the memory idle; with more (or unaligned rows, a register per element) a
// second row would spill, and it reads each row when it needs it.
template <class T, int V, int C>
struct RowReader {
  static constexpr bool kEarly = C == 1 && V > 1;
  const T* data;
  int64_t ld;  // elements from one row to the next
  Packed<T, V> next[C];

  __device__ void start(const RowSlot& s, int64_t count, int D) {
    if (kEarly && s.row < count) fetch(s.row, s, D);
  }

  // Row r (the thread's current one) as fp32, zeros past D; then the thread's next row is fetched.
  __device__ void read(int64_t r, const RowSlot& s, int64_t count, int D, float* out) {
    if constexpr (kEarly) {
#pragma unroll
      for (int c = 0; c < C; ++c) {
        const bool inside = element(s, c, V) < D;
#pragma unroll
        for (int j = 0; j < V; ++j) out[c * V + j] = inside ? to_float(next[c].v[j]) : 0.0f;
      }
      if (r + s.stride < count) fetch(r + s.stride, s, D);
    } else {
      load_row<V, C>(data + r * ld, s, D, out);
    }
  }

 private:
  __device__ void fetch(int64_t r, const RowSlot& s, int D) {
#pragma unroll
    for (int c = 0; c < C; ++c) {
      const int e = element(s, c, V);
      if (e < D) next[c] = *reinterpret_cast<const Packed<T, V>*>(data + r * ld + e);
    }
  }
};

// v -= m on the thread's elements of the row; the zeros past D stay zero.
template <int V, int C>
__device__ void center_row(float* v, float m, const RowSlot& s, int D) {
#pragma unroll
  for (int c = 0; c < C; ++c)
    if (element(s, c, V) < D)
#pragma unroll
      for (int j = 0; j < V; ++j) v[c * V + j] -= m;
}

template <int E>
__device__ __forceinline__ float register_sum(const float (&v)[E]) {
  float sum = 0.0f;
#pragma unroll
  for (int i = 0; i < E; ++i) sum += v[i];
  return sum;
}

// Sums N values over the row's threads; every thread gets the totals (in the same order, so the
// same values). A block row reduces its warps through `shared` (32 N floats). The shuffles name
// only the row's lanes: of two half-warp rows, one may have ended while the other goes on.
template <int N>
__device__ void row_sum(float (&v)[N], const RowSlot& s, float* shared) {
#pragma unroll
  for (int n = 0; n < N; ++n)
    for (int offset = s.width / 2; offset > 0; offset /= 2) v[n] += __shfl_xor_sync(s.lanes, v[n], offset);
  const int group = s.group;
  if (group <= 32) return;
  const int warp = threadIdx.x / 32;
  if (threadIdx.x % 32 == 0)
#pragma unroll
    for (int n = 0; n < N; ++n) shared[n * 32 + warp] = v[n];
  __syncthreads();
#pragma unroll
  for (int n = 0; n < N; ++n) {
    v[n] = 0.0f;
    for (int w = 0; w < group / 32; ++w) v[n] += shared[n * 32 + w];
  }
  __syncthreads();  // the next sum reuses `shared`
}

// Layer norm's statistics of a loaded row: centres v in place and returns 1 / sqrt(var + eps).
// Two passes over the registers (mean, then the centred squares): no cancellation.
template <int V, int C>
__device__ float center_and_inv_std(float (&v)[C * V], const RowSlot& s, int D, float eps, float* shared) {
  float sum[1] = {register_sum(v)};
  row_sum(sum, s, shared);
  center_row<V, C>(v, sum[0] / static_cast<float>(D), s, D);
  sum[0] = 0.0f;
#pragma unroll
  for (int i = 0; i < C * V; ++i) sum[0] += v[i] * v[i];
  row_sum(sum, s, shared);
  return rsqrtf(sum[0] / static_cast<float>(D) + eps);
}

// grad[i, i + 4) += v by one vector atomic where grad is 16-byte aligned (the atomics of every block on
// the same D addresses take most of a backward's time when they go one float at a time).
__device__ __forceinline__ bool vector_atomics(const float* grad) {
  return reinterpret_cast<uintptr_t>(grad) % 16 == 0;
}

// grad (fp32, global) += the thread's per-element sums. Every thread of the block calls it.
template <int V, int C>
__device__ void add_gradient(const float* sums, float* grad, const RowSlot& s, int D, float* combine) {
  const bool vec = vector_atomics(grad);
  if (s.group > 32) {  // the block is one row's threads: each element has one owner
#pragma unroll
    for (int c = 0; c < C; ++c) {
      const int e = element(s, c, V);
      if (e >= D) continue;
      if (V % 4 == 0 && vec) {
#pragma unroll
        for (int j = 0; j < V; j += 4)
          atomicAdd(
              reinterpret_cast<float4*>(grad + e + j),
              make_float4(sums[c * V + j], sums[c * V + j + 1], sums[c * V + j + 2], sums[c * V + j + 3]));
      } else {
#pragma unroll
        for (int j = 0; j < V; ++j) atomicAdd(grad + e + j, sums[c * V + j]);
      }
    }
    return;
  }
  for (int i = threadIdx.x; i < D; i += blockDim.x) combine[i] = 0.0f;
  __syncthreads();
#pragma unroll
  for (int c = 0; c < C; ++c) {
    const int e = element(s, c, V);
    if (e < D)
#pragma unroll
      for (int j = 0; j < V; ++j) atomicAdd(combine + e + j, sums[c * V + j]);
  }
  __syncthreads();
  if (D % 4 == 0 && vec) {
    for (int i = threadIdx.x * 4; i < D; i += blockDim.x * 4)
      atomicAdd(reinterpret_cast<float4*>(grad + i), *reinterpret_cast<const float4*>(combine + i));
  } else {
    for (int i = threadIdx.x; i < D; i += blockDim.x) atomicAdd(grad + i, combine[i]);
  }
  __syncthreads();  // the next call reuses `combine`
}

// The gate's sigmoid. By the SFU's exponential and reciprocal (two instructions each, a few ulp; as
// conv.cu) where rows are read in vectors: expf and the IEEE division were most of the gated norm's
// instructions, and its results are rounded to bf16. Misaligned rows (V = 1) keep the IEEE form:
// their backward holds 16 single elements a thread at the 128 registers of 512-thread blocks, and
// the SFU form's schedule spills there.
template <int V>
__device__ __forceinline__ float sigmoid(float a) {
  if constexpr (V > 1)
    return __fdividef(1.0f, 1.0f + __expf(-a));
  else
    return 1.0f / (1.0f + expf(-a));
}

// The kernels take V-wide vectors, C of them per thread and row (E = C V elements); weights are
// read again for every row, from L1: registers hold only the row and the gradient sums.

// RMSNorm, gated by sigmoid(gate) when kGated.
template <int V, int C, int kGroup, bool kGated>
__global__ void __launch_bounds__(kMaxBlock)
    rms_norm_forward_kernel(const bf16* x, int64_t x_ld, const bf16* weight, const bf16* gate, bf16* y,
                            int64_t y_ld, int64_t rows, int D, float eps) {
  wait_for_earlier_kernels();
  constexpr int E = C * V;
  __shared__ float shared[32];
  const RowSlot s = row_slot<kGroup>();
  if constexpr (kGated) x_ld = y_ld = D;  // as in the backward
  RowReader<bf16, V, C> x_rows{x, x_ld}, gate_rows{gate, D};
  x_rows.start(s, rows, D);
  if constexpr (kGated) gate_rows.start(s, rows, D);
  for (int64_t r = s.row; r < rows; r += s.stride) {
    float v[E], w[E], sg[E];
    x_rows.read(r, s, rows, D, v);
    if constexpr (kGated) gate_rows.read(r, s, rows, D, sg);
    float sum[1] = {0.0f};
#pragma unroll
    for (int i = 0; i < E; ++i) sum[0] += v[i] * v[i];
    row_sum(sum, s, shared);
    const float inv = rsqrtf(sum[0] / static_cast<float>(D) + eps);
    load_row<V, C>(weight, s, D, w);
#pragma unroll
    for (int i = 0; i < E; ++i) v[i] = w[i] * (v[i] * inv);
    if constexpr (kGated) {
#pragma unroll
      for (int i = 0; i < E; ++i) v[i] *= sigmoid<V>(sg[i]);
    }
    store_row<V, C>(y + r * y_ld, s, D, v);
  }
}

// With dn = dy * sigmoid(gate), the gradient of the normed row: dx = inv w dn - x inv^3
// sum(w dn x) / D, dweight += dn x inv, dgate = dn (1 - sigmoid(gate)) w x inv. dy bf16 or fp32 (DY).
template <int V, int C, int kGroup, bool kGated, class DY>
__global__ void __launch_bounds__(kMaxBlock)
    rms_norm_backward_kernel(const bf16* x, int64_t x_ld, const bf16* weight, const bf16* gate, const DY* dy,
                             bf16* dx, int64_t dx_ld, bf16* dgate, float* dweight, int64_t rows, int D,
                             float eps) {
  wait_for_earlier_kernels();
  constexpr int E = C * V;
  __shared__ float shared[64];
  __shared__ __align__(16) float combine[kMaxWarpD];
  const RowSlot s = row_slot<kGroup>();
  // The gated norm's rows are whole (its misaligned form is at the register limit): no strides there.
  if constexpr (kGated) x_ld = dx_ld = D;
  RowReader<bf16, V, C> x_rows{x, x_ld}, gate_rows{gate, D};
  RowReader<DY, V, C> dy_rows{dy, D};
  x_rows.start(s, rows, D);
  dy_rows.start(s, rows, D);
  if constexpr (kGated) gate_rows.start(s, rows, D);
  float dw[E] = {};
  for (int64_t r = s.row; r < rows; r += s.stride) {
    float v[E], w[E], dn[E], sg[E];
    x_rows.read(r, s, rows, D, v);
    dy_rows.read(r, s, rows, D, dn);
    if constexpr (kGated) gate_rows.read(r, s, rows, D, sg);
    load_row<V, C>(weight, s, D, w);
    if constexpr (kGated) {
#pragma unroll
      for (int i = 0; i < E; ++i) {
        sg[i] = sigmoid<V>(sg[i]);
        dn[i] *= sg[i];
      }
    }
    float sums[2] = {0.0f, 0.0f};
#pragma unroll
    for (int i = 0; i < E; ++i) {
      sums[0] += v[i] * v[i];
      sums[1] += w[i] * dn[i] * v[i];
    }
    row_sum(sums, s, shared);
    const float inv = rsqrtf(sums[0] / static_cast<float>(D) + eps);
    const float coef = inv * inv * inv * sums[1] / static_cast<float>(D);
    if constexpr (kGated) {
#pragma unroll
      for (int i = 0; i < E; ++i) sg[i] = dn[i] * (1.0f - sg[i]) * w[i] * v[i] * inv;
      store_row<V, C>(dgate + r * D, s, D, sg);
    }
#pragma unroll
    for (int i = 0; i < E; ++i) {
      dw[i] += dn[i] * v[i] * inv;
      v[i] = inv * w[i] * dn[i] - v[i] * coef;
    }
    store_row<V, C>(dx + r * dx_ld, s, D, v);
  }
  add_gradient<V, C>(dw, dweight, s, D, combine);
}

template <int V, int C, int kGroup>
__global__ void __launch_bounds__(kMaxBlock)
    layer_norm_forward_kernel(const bf16* x, int64_t x_ld, const bf16* weight, const bf16* bias, bf16* y,
                              int64_t rows, int D, float eps) {
  wait_for_earlier_kernels();
  constexpr int E = C * V;
  __shared__ float shared[32];
  const RowSlot s = row_slot<kGroup>();
  for (int64_t r = s.row; r < rows; r += s.stride) {
    float v[E], w[E];
    load_row<V, C>(x + r * x_ld, s, D, v);
    const float inv = center_and_inv_std<V, C>(v, s, D, eps, shared);
    load_row<V, C>(weight, s, D, w);
#pragma unroll
    for (int i = 0; i < E; ++i) v[i] *= inv * w[i];
    load_row<V, C>(bias, s, D, w);
#pragma unroll
    for (int i = 0; i < E; ++i) v[i] += w[i];
    store_row<V, C>(y + r * D, s, D, v);
  }
}

// With xhat = (x - mean) inv and g = w dy: dx = inv (g - mean(g) - xhat mean(g xhat)),
// dweight += dy xhat, dbias += dy.
template <int V, int C, int kGroup>
__global__ void __launch_bounds__(kMaxBlock)
    layer_norm_backward_kernel(const bf16* x, const bf16* weight, const bf16* dy, bf16* dx, float* dweight,
                               float* dbias, int64_t rows, int D, float eps) {
  wait_for_earlier_kernels();
  constexpr int E = C * V;
  __shared__ float shared[64];
  __shared__ __align__(16) float combine[kMaxWarpD];
  const RowSlot s = row_slot<kGroup>();
  float dw[E] = {}, db[E] = {};
  for (int64_t r = s.row; r < rows; r += s.stride) {
    float v[E], g[E], w[E];
    load_row<V, C>(x + r * D, s, D, v);
    const float inv = center_and_inv_std<V, C>(v, s, D, eps, shared);
    load_row<V, C>(dy + r * D, s, D, g);
    load_row<V, C>(weight, s, D, w);
    float sums[2] = {0.0f, 0.0f};
#pragma unroll
    for (int i = 0; i < E; ++i) {
      v[i] *= inv;  // xhat
      dw[i] += g[i] * v[i];
      db[i] += g[i];
      g[i] *= w[i];
      sums[0] += g[i];
      sums[1] += g[i] * v[i];
    }
    row_sum(sums, s, shared);
    const float g_mean = sums[0] / static_cast<float>(D), gx_mean = sums[1] / static_cast<float>(D);
#pragma unroll
    for (int i = 0; i < E; ++i) v[i] = inv * (g[i] - g_mean - v[i] * gx_mean);
    store_row<V, C>(dx + r * D, s, D, v);
  }
  add_gradient<V, C>(dw, dweight, s, D, combine);
  add_gradient<V, C>(db, dbias, s, D, combine);
}

template <int V, int C, int kGroup>
__global__ void __launch_bounds__(kMaxBlock)
    l2_normalize_forward_kernel(const bf16* x, bf16* y, int64_t rows, int D, float eps, float scale) {
  wait_for_earlier_kernels();
  constexpr int E = C * V;
  __shared__ float shared[32];
  const RowSlot s = row_slot<kGroup>();
  for (int64_t r = s.row; r < rows; r += s.stride) {
    float v[E];
    load_row<V, C>(x + r * D, s, D, v);
    float sum[1] = {0.0f};
#pragma unroll
    for (int i = 0; i < E; ++i) sum[0] += v[i] * v[i];
    row_sum(sum, s, shared);
    const float factor = scale * rsqrtf(sum[0] + eps);
#pragma unroll
    for (int i = 0; i < E; ++i) v[i] *= factor;
    store_row<V, C>(y + r * D, s, D, v);
  }
}

// With inv = 1 / sqrt(sum x^2 + eps): dx = scale inv (dy - x inv^2 sum(x dy)).
template <int V, int C, int kGroup>
__global__ void __launch_bounds__(kMaxBlock)
    l2_normalize_backward_kernel(const bf16* x, const bf16* dy, bf16* dx, int64_t rows, int D, float eps,
                                 float scale) {
  wait_for_earlier_kernels();
  constexpr int E = C * V;
  __shared__ float shared[64];
  const RowSlot s = row_slot<kGroup>();
  for (int64_t r = s.row; r < rows; r += s.stride) {
    float v[E], g[E];
    load_row<V, C>(x + r * D, s, D, v);
    load_row<V, C>(dy + r * D, s, D, g);
    float sums[2] = {0.0f, 0.0f};
#pragma unroll
    for (int i = 0; i < E; ++i) {
      sums[0] += v[i] * v[i];
      sums[1] += v[i] * g[i];
    }
    row_sum(sums, s, shared);
    const float inv = rsqrtf(sums[0] + eps);
    const float coef = inv * inv * sums[1];
#pragma unroll
    for (int i = 0; i < E; ++i) v[i] = scale * inv * (g[i] - v[i] * coef);
    store_row<V, C>(dx + r * D, s, D, v);
  }
}

// How a call covers its rows: vector width V, vectors per thread C (1 or kPerThread / V),
// threads per row (`group`), block size and grid.
struct RowPlan {
  int vec, chunks, group, threads;
  unsigned blocks;
};

// half_warps: rows of at most 16 vectors take half a warp each (the gated norm's rows of one head,
// 128 elements: 8 a thread instead of 4, so half the row sums, index arithmetic and load and store
// instructions per element, and twice the bytes in flight per fetched row). lds: the strides of
// rows that are columns of wider buffers (a vector must not straddle two rows' starts).
RowPlan plan_rows(const char* name, int64_t rows, int64_t D, std::initializer_list<Access> accesses,
                  bool half_warps = false, std::initializer_list<int64_t> lds = {}) {
  check(D >= 1 && D <= kMaxNormD, name, ": row length ", D, " (expected 1 to ", kMaxNormD, ")");
  for (const int64_t ld : lds) check(ld >= D, name, ": rows ", ld, " apart hold ", D, " values");
  RowPlan p{};
  p.vec = vector_width(accesses, D, half_warps ? 16 : 32);
  for (const int64_t ld : lds)
    while (ld % p.vec != 0) p.vec /= 2;
  const int64_t vectors = D / p.vec, most = kPerThread / p.vec;
  if (half_warps && vectors <= 16) {
    // Half a warp per row, 8 rows per block: blocks of 4 warps, as the gated backward's registers
    // leave room for 5 of them an SM (but for 2 of 8 warps).
    p.chunks = 1;
    p.group = 16;
    p.threads = kWarpRowsBlock / 2;
  } else if (vectors <= 32 * most) {  // a warp per row, 8 rows per block
    p.chunks = vectors <= 32 ? 1 : static_cast<int>(most);
    p.group = 32;
    p.threads = kWarpRowsBlock;
  } else {  // a block per row, 16 elements a thread: a thread's share of a row's sums and barriers
    // costs more instructions than its elements do, so the fewer threads to a row the better.
    // Unaligned rows (one element a vector) take the widest block, whose offsets are constants:
    // with 16 single elements a thread, offsets in registers would spill.
    p.chunks = static_cast<int>(most);
    p.group = p.threads =
        p.vec == 1 ? kMaxBlock : static_cast<int>(((vectors + most - 1) / most + 31) / 32 * 32);
  }
  const int64_t rows_per_block = p.threads / p.group;
  p.blocks = static_cast<unsigned>(std::max<int64_t>(1, (rows + rows_per_block - 1) / rows_per_block));
  return p;
}

// The plan's grid for `kernel`: no more blocks than the GPU holds at once (each adds its weight
// gradient sums by atomics once, and a block strides over its rows).
template <class Kernel>
unsigned grid(const RowPlan& p, Kernel kernel) {
  return static_cast<unsigned>(std::min<int64_t>(p.blocks, resident_blocks_of(kernel, p.threads)));
}

template <int V>
using Width = std::integral_constant<int, V>;

// Calls launch(V, C, kGroup), each a std::integral_constant, for the plan (kGroup 0: the block);
// kHalfWarps for a plan_rows(..., half_warps = true).
template <bool kHalfWarps = false, class Launch>
void with_plan(const RowPlan& p, Launch&& launch) {
  with_width(p.vec, [&](auto width) {
    constexpr int most = kPerThread / decltype(width)::value;
    if constexpr (kHalfWarps) {
      if (p.group == 16) return launch(width, Width<1>{}, Width<16>{});
    }
    if (p.group == 32 && p.chunks == 1)
      launch(width, Width<1>{}, Width<32>{});
    else if (p.group == 32)
      launch(width, Width<most>{}, Width<32>{});
    else if constexpr (decltype(width)::value == 1)
      launch(width, Width<most>{}, Width<kMaxBlock>{});
    else
      launch(width, Width<most>{}, Width<0>{});
  });
}

constexpr size_t kB = sizeof(bf16);

template <bool kGated>
void launch_rms_norm_forward(const char* name, const bf16* x, int64_t x_ld, const bf16* weight,
                             const bf16* gate, bf16* y, int64_t y_ld, int64_t rows, int64_t D, float eps,
                             cudaStream_t stream) {
  const RowPlan p =
      plan_rows(name, rows, D, {{x, kB}, {weight, kB}, {gate, kB}, {y, kB}}, kGated, {x_ld, y_ld});
  if (rows == 0) return;
  with_plan<kGated>(p, [&](auto V, auto C, auto G) {
    const auto kernel =
        rms_norm_forward_kernel<decltype(V)::value, decltype(C)::value, decltype(G)::value, kGated>;
    launch_kernel(kernel, grid(p, kernel), p.threads, 0, stream, x, x_ld, weight, gate, y, y_ld, rows,
                  static_cast<int>(D), eps);
  });
  SPINDLE_LAUNCHED(name);
}

template <bool kGated, class DY>
void launch_rms_norm_backward(const char* name, const bf16* x, int64_t x_ld, const bf16* weight,
                              const bf16* gate, const DY* dy, bf16* dx, int64_t dx_ld, bf16* dgate,
                              float* dweight, int64_t rows, int64_t D, float eps, cudaStream_t stream) {
  const RowPlan p =
      plan_rows(name, rows, D, {{x, kB}, {weight, kB}, {gate, kB}, {dy, sizeof(DY)}, {dx, kB}, {dgate, kB}},
                kGated, {x_ld, dx_ld});
  if (rows == 0) return;
  with_plan<kGated>(p, [&](auto V, auto C, auto G) {
    const auto kernel =
        rms_norm_backward_kernel<decltype(V)::value, decltype(C)::value, decltype(G)::value, kGated, DY>;
    launch_kernel(kernel, grid(p, kernel), p.threads, 0, stream, x, x_ld, weight, gate, dy, dx, dx_ld, dgate,
                  dweight, rows, static_cast<int>(D), eps);
  });
  SPINDLE_LAUNCHED(name);
}

}  // namespace

void rms_norm_forward(const bf16* x, const bf16* weight, bf16* y, int64_t rows, int64_t D, float eps,
                      cudaStream_t stream) {
  rms_norm_forward(x, D, weight, y, D, rows, D, eps, stream);
}

void rms_norm_forward(const bf16* x, int64_t x_ld, const bf16* weight, bf16* y, int64_t y_ld, int64_t rows,
                      int64_t D, float eps, cudaStream_t stream) {
  launch_rms_norm_forward<false>("rms_norm_forward", x, x_ld, weight, nullptr, y, y_ld, rows, D, eps, stream);
}

void rms_norm_backward(const bf16* x, const bf16* weight, const bf16* dy, bf16* dx, float* dweight,
                       int64_t rows, int64_t D, float eps, cudaStream_t stream) {
  rms_norm_backward(x, D, weight, dy, dx, D, dweight, rows, D, eps, stream);
}

void rms_norm_backward(const bf16* x, int64_t x_ld, const bf16* weight, const bf16* dy, bf16* dx,
                       int64_t dx_ld, float* dweight, int64_t rows, int64_t D, float eps,
                       cudaStream_t stream) {
  launch_rms_norm_backward<false>("rms_norm_backward", x, x_ld, weight, nullptr, dy, dx, dx_ld, nullptr,
                                  dweight, rows, D, eps, stream);
}

void rms_norm_backward(const bf16* x, const bf16* weight, const float* dy, bf16* dx, float* dweight,
                       int64_t rows, int64_t D, float eps, cudaStream_t stream) {
  launch_rms_norm_backward<false>("rms_norm_backward", x, D, weight, nullptr, dy, dx, D, nullptr, dweight,
                                  rows, D, eps, stream);
}

void gated_rms_norm_forward(const bf16* x, const bf16* weight, const bf16* gate, bf16* y, int64_t rows,
                            int64_t D, float eps, cudaStream_t stream) {
  launch_rms_norm_forward<true>("gated_rms_norm_forward", x, D, weight, gate, y, D, rows, D, eps, stream);
}

void gated_rms_norm_backward(const bf16* x, const bf16* weight, const bf16* gate, const bf16* dy, bf16* dx,
                             bf16* dgate, float* dweight, int64_t rows, int64_t D, float eps,
                             cudaStream_t stream) {
  launch_rms_norm_backward<true>("gated_rms_norm_backward", x, D, weight, gate, dy, dx, D, dgate, dweight,
                                 rows, D, eps, stream);
}

void layer_norm_forward(const bf16* x, const bf16* weight, const bf16* bias, bf16* y, int64_t rows, int64_t D,
                        float eps, cudaStream_t stream) {
  layer_norm_forward(x, D, weight, bias, y, rows, D, eps, stream);
}

void layer_norm_forward(const bf16* x, int64_t x_ld, const bf16* weight, const bf16* bias, bf16* y,
                        int64_t rows, int64_t D, float eps, cudaStream_t stream) {
  const RowPlan p =
      plan_rows("layer_norm_forward", rows, D, {{x, kB}, {weight, kB}, {bias, kB}, {y, kB}}, false, {x_ld});
  if (rows == 0) return;
  with_plan(p, [&](auto V, auto C, auto G) {
    const auto kernel = layer_norm_forward_kernel<decltype(V)::value, decltype(C)::value, decltype(G)::value>;
    launch_kernel(kernel, grid(p, kernel), p.threads, 0, stream, x, x_ld, weight, bias, y, rows,
                  static_cast<int>(D), eps);
  });
  SPINDLE_LAUNCHED("layer_norm_forward");
}

void layer_norm_backward(const bf16* x, const bf16* weight, const bf16* dy, bf16* dx, float* dweight,
                         float* dbias, int64_t rows, int64_t D, float eps, cudaStream_t stream) {
  const RowPlan p = plan_rows("layer_norm_backward", rows, D, {{x, kB}, {weight, kB}, {dy, kB}, {dx, kB}});
  if (rows == 0) return;
  with_plan(p, [&](auto V, auto C, auto G) {
    const auto kernel =
        layer_norm_backward_kernel<decltype(V)::value, decltype(C)::value, decltype(G)::value>;
    launch_kernel(kernel, grid(p, kernel), p.threads, 0, stream, x, weight, dy, dx, dweight, dbias, rows,
                  static_cast<int>(D), eps);
  });
  SPINDLE_LAUNCHED("layer_norm_backward");
}

void l2_normalize_forward(const bf16* x, bf16* y, int64_t rows, int64_t D, float eps, float scale,
                          cudaStream_t stream) {
  const RowPlan p = plan_rows("l2_normalize_forward", rows, D, {{x, kB}, {y, kB}});
  if (rows == 0) return;
  with_plan(p, [&](auto V, auto C, auto G) {
    const auto kernel =
        l2_normalize_forward_kernel<decltype(V)::value, decltype(C)::value, decltype(G)::value>;
    launch_kernel(kernel, grid(p, kernel), p.threads, 0, stream, x, y, rows, static_cast<int>(D), eps, scale);
  });
  SPINDLE_LAUNCHED("l2_normalize_forward");
}

void l2_normalize_backward(const bf16* x, const bf16* dy, bf16* dx, int64_t rows, int64_t D, float eps,
                           float scale, cudaStream_t stream) {
  const RowPlan p = plan_rows("l2_normalize_backward", rows, D, {{x, kB}, {dy, kB}, {dx, kB}});
  if (rows == 0) return;
  with_plan(p, [&](auto V, auto C, auto G) {
    const auto kernel =
        l2_normalize_backward_kernel<decltype(V)::value, decltype(C)::value, decltype(G)::value>;
    launch_kernel(kernel, grid(p, kernel), p.threads, 0, stream, x, dy, dx, rows, static_cast<int>(D), eps,
                  scale);
  });
  SPINDLE_LAUNCHED("l2_normalize_backward");
}

}  // namespace spindle::cuda
