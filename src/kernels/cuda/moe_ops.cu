// MoE kernels: the clamped SwiGLU (elementwise, memory-bound), the router (one warp per token,
// the token's scores in shared memory, group and expert choice by repeated warp arg-max with
// ties to the lower index), its weight backward (one warp per token) and the expert-sorted
// permutation (a stable counting sort over tiles of assignments, with its inverse).
#include <algorithm>
#include <climits>
#include <cmath>
#include <cub/block/block_scan.cuh>

#include "backend/cuda/check.h"
#include "kernels/cuda/launch.cuh"
#include "kernels/cuda/memory_bound.cuh"
#include "kernels/cuda/moe_ops.h"
#include "kernels/cuda/shared_memory_limit.h"
#include "kernels/cuda/warp_reduce.cuh"

namespace spindle::cuda {

namespace {

constexpr int kThreads = 256;
constexpr int kRouterWarps = 4;
constexpr int64_t kMaxExperts = 2048;

__device__ float sigmoidf(float x) { return 1.0f / (1.0f + expf(-x)); }

// One element of the clamped SwiGLU: out = silu(min(gate, limit)) * clamp(up, -limit, limit).
__device__ float swiglu_value(float gate, float up, float limit) {
  const float g = fminf(gate, limit), u = fminf(fmaxf(up, -limit), limit);
  return g * sigmoidf(g) * u;
}

// Its gradients, into dgate and dup.
__device__ void swiglu_gradient(float gate, float up, float dout, float& dgate, float& dup, float limit) {
  const float g = fminf(gate, limit), u = fminf(fmaxf(up, -limit), limit);
  const float sg = sigmoidf(g);
  dgate = gate <= limit ? dout * u * sg * (1.0f + g * (1.0f - sg)) : 0.0f;
  dup = up >= -limit && up <= limit ? dout * g * sg : 0.0f;
}

// visit(r, c) for every vector of V consecutive columns c .. c + V - 1 of rows [0, rows) (V divides
// cols), a thread's at a time over the rows' vectors flat, so that a row narrower than a block (an
// expert's 576) leaves no thread idle.
template <int V, class Visit>
__device__ void for_each_row_vector(int64_t rows, int64_t cols, const Visit& visit) {
  const int64_t per_row = cols / V, stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < rows * per_row;
       i += stride) {
    const int64_t r = i / per_row;
    visit(r, (i - r * per_row) * V);
  }
}

// The clamped SwiGLU over rows of [gate | up] ([rows, 2 cols]) into out [rows, cols], in vectors of V.
template <int V>
__global__ void swiglu_halves_forward_kernel(const __nv_bfloat16* gate_up, __nv_bfloat16* out, int64_t rows,
                                             int64_t cols, float limit) {
  wait_for_earlier_kernels();
  for_each_row_vector<V>(rows, cols, [&](int64_t r, int64_t c) {
    float gate[V], up[V], y[V];
    load<V>(gate_up + r * 2 * cols + c, gate);
    load<V>(gate_up + r * 2 * cols + cols + c, up);
#pragma unroll
    for (int j = 0; j < V; ++j) y[j] = swiglu_value(gate[j], up[j], limit);
    store<V>(out + r * cols + c, y);
  });
}

// dgate, dup in place of gate, up; the vectors as the forward's.
template <int V>
__global__ void swiglu_halves_backward_kernel(__nv_bfloat16* gate_up, const __nv_bfloat16* dout, int64_t rows,
                                              int64_t cols, float limit) {
  wait_for_earlier_kernels();
  for_each_row_vector<V>(rows, cols, [&](int64_t r, int64_t c) {
    __nv_bfloat16* gate_at = gate_up + r * 2 * cols + c;
    float gate[V], up[V], d[V], dgate[V], dup[V];
    load<V>(gate_at, gate);
    load<V>(gate_at + cols, up);
    load<V>(dout + r * cols + c, d);
#pragma unroll
    for (int j = 0; j < V; ++j) swiglu_gradient(gate[j], up[j], d[j], dgate[j], dup[j], limit);
    store<V>(gate_at, dgate);
    store<V>(gate_at + cols, dup);
  });
}

// The widest vectors that the SwiGLU kernels' pointers and columns allow.
int swiglu_width(const void* gate_up, const void* other, int64_t cols) {
  return vector_width({Access{gate_up, sizeof(__nv_bfloat16)}, Access{other, sizeof(__nv_bfloat16)}}, cols);
}

// Shared memory per warp: score[E], choice[E], group_score[G], taken flags[max(E, G)] (ints).
__global__ void route_kernel(cpu::RouterShape s, const float* logits, const float* bias, int32_t* expert,
                             float* weight) {
  wait_for_earlier_kernels();
  extern __shared__ float shared[];
  const int E = static_cast<int>(s.experts), G = static_cast<int>(s.groups), K = static_cast<int>(s.topk);
  const int per_group = E / G;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int64_t t = blockIdx.x * static_cast<int64_t>(kRouterWarps) + warp;
  if (t >= s.tokens) return;  // whole warps leave together
  float* score = shared + warp * (2 * E + G + max(E, G));
  float* choice = score + E;
  float* group_score = choice + E;
  int* taken = reinterpret_cast<int*>(group_score + G);
  const float* l = logits + t * E;
  for (int e = lane; e < E; e += 32) {
    score[e] = sigmoidf(l[e]);
    choice[e] = score[e] + bias[e];
    taken[e] = 0;
  }
  __syncwarp();
  if (s.topk_groups < G) {
    // Keep the topk_groups best groups by the sum of their two best choices (ties to the lower
    // index); mask the others' choices. With every group kept, the scores would go unread.
    for (int g = lane; g < G; g += 32) {
      float best = -INFINITY, second = -INFINITY;
      for (int e = g * per_group; e < (g + 1) * per_group; ++e) {
        const float c = choice[e];
        if (c > best) {
          second = best;
          best = c;
        } else if (c > second) {
          second = c;
        }
      }
      group_score[g] = best + second;
    }
    __syncwarp();
    for (int g = lane; g < G; g += 32) taken[g] = 0;
    __syncwarp();
    for (int64_t pick = 0; pick < s.topk_groups; ++pick) {
      float v = -INFINITY;
      int i = INT_MAX;
      for (int g = lane; g < G; g += 32)
        if (!taken[g] && (group_score[g] > v || (group_score[g] == v && g < i))) {
          v = group_score[g];
          i = g;
        }
      warp_argmax(v, i);
      if (lane == 0) taken[i] = 1;
      __syncwarp();
    }
    for (int e = lane; e < E; e += 32)
      if (!taken[e / per_group]) choice[e] = -INFINITY;
    __syncwarp();
    for (int e = lane; e < E; e += 32) taken[e] = 0;
    __syncwarp();
  }
  float picked_score = 0.0f, sum = 0.0f;  // lane k keeps pick k's score (K <= 32)
  for (int k = 0; k < K; ++k) {
    float v = -INFINITY;
    int i = INT_MAX;
    for (int e = lane; e < E; e += 32)
      if (!taken[e] && (choice[e] > v || (choice[e] == v && e < i))) {
        v = choice[e];
        i = e;
      }
    warp_argmax(v, i);
    if (lane == 0) {
      taken[i] = 1;
      expert[t * K + k] = i;
    }
    if (lane == k) picked_score = score[i];
    sum += score[i];
    __syncwarp();
  }
  const float denominator = s.normalize ? sum + 1e-20f : 1.0f;
  if (lane < K) weight[t * K + lane] = picked_score / denominator * static_cast<float>(s.scaling);
}

__global__ void route_backward_kernel(cpu::RouterShape s, const float* logits, const int32_t* expert,
                                      const float* dweight, float* dlogits) {
  wait_for_earlier_kernels();
  const int E = static_cast<int>(s.experts), K = static_cast<int>(s.topk);
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int64_t t = blockIdx.x * static_cast<int64_t>(kRouterWarps) + warp;
  if (t >= s.tokens) return;
  float* d = dlogits + t * E;
  for (int e = lane; e < E; e += 32) d[e] = 0.0f;
  int e = 0;
  float sc = 0.0f, dw = 0.0f;
  if (lane < K) {
    e = expert[t * K + lane];
    sc = sigmoidf(logits[t * E + e]);
    dw = dweight[t * K + lane];
  }
  float sum = sc, dot = dw * sc;
  for (int offset = 16; offset > 0; offset /= 2) {
    sum += __shfl_xor_sync(0xffffffffu, sum, offset);
    dot += __shfl_xor_sync(0xffffffffu, dot, offset);
  }
  __syncwarp();  // the zeros land before the chosen entries
  if (lane < K) {
    const float scaling = static_cast<float>(s.scaling), z = s.normalize ? sum + 1e-20f : 1.0f;
    float ds = scaling * dw / z;
    if (s.normalize) ds -= scaling * dot / (z * z);
    d[e] += ds * sc * (1.0f - sc);
  }
}

// The expert-sorted permutation, a stable counting sort over tiles of kTile assignments in two
// kernels (before: a count, a scan, CUB's radix sort in four kernels, the inverse, a copy to the
// host and a memset, each a launch about 1.2 us after the last).
constexpr int kPlaceThreads = 256;
constexpr int kPlaceWarps = kPlaceThreads / 32;
constexpr int kPlaceRounds = 8;
constexpr int kTile = kPlaceRounds * kPlaceThreads;

// tile_counts[tile, e] = the tile's assignments to e, every entry written (no memset first). Counts
// in shared memory first: a global atomic per assignment on the same few counters took 13 us at
// 65,536 assignments.
__global__ void __launch_bounds__(kPlaceThreads)
    tile_count_kernel(const int32_t* expert, int64_t n, int experts, int32_t* tile_counts) {
  wait_for_earlier_kernels();
  extern __shared__ int32_t local[];
  for (int e = threadIdx.x; e < experts; e += kPlaceThreads) local[e] = 0;
  const int64_t first = blockIdx.x * static_cast<int64_t>(kTile);
  int32_t round_expert[kPlaceRounds];  // -1 past the end; loaded together
#pragma unroll
  for (int r = 0; r < kPlaceRounds; ++r) {
    const int64_t a = first + r * kPlaceThreads + threadIdx.x;
    round_expert[r] = a < n ? expert[a] : -1;
  }
  __syncthreads();
#pragma unroll
  for (int r = 0; r < kPlaceRounds; ++r)
    if (round_expert[r] >= 0) atomicAdd(local + round_expert[r], 1);
  __syncthreads();
  for (int e = threadIdx.x; e < experts; e += kPlaceThreads)
    tile_counts[blockIdx.x * static_cast<int64_t>(experts) + e] = local[e];
}

// A block per tile: each assignment's row is its expert's offset, plus the rows its expert took in
// earlier tiles, in earlier rounds of this tile (kPlaceThreads assignments a round, in order), in
// earlier warps of this round and in lower lanes of this warp. Block 0 writes the offsets (to
// host memory). Shared memory: next[experts] (the expert's next row after the rounds so far) and
// in_warp[kPlaceWarps][experts] (a round's assignments by warp and expert, zero between rounds).
__global__ void __launch_bounds__(kPlaceThreads)
    place_kernel(const int32_t* expert, int64_t n, int experts, const int32_t* tile_counts, int tiles,
                 int32_t* host_offsets, int32_t* permutation, int32_t* inverse) {
  wait_for_earlier_kernels();
  extern __shared__ int32_t place_shared[];
  int32_t *next = place_shared, *in_warp = place_shared + experts;
  const int tile = static_cast<int>(blockIdx.x), warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int64_t first = tile * static_cast<int64_t>(kTile);
  int32_t round_expert[kPlaceRounds];  // -1 past the end; loaded together, early
#pragma unroll
  for (int r = 0; r < kPlaceRounds; ++r) {
    const int64_t a = first + r * kPlaceThreads + threadIdx.x;
    round_expert[r] = a < n ? expert[a] : -1;
  }
  // Each warp a share of the experts, its lanes over the tiles: the expert's total (kept in
  // in_warp's first row until the scan below) and its rows in earlier tiles.
  for (int e = warp; e < experts; e += kPlaceWarps) {
    int32_t total = 0, before = 0;
    for (int b = lane; b < tiles; b += 32) {
      const int32_t count = tile_counts[static_cast<int64_t>(b) * experts + e];
      total += count;
      if (b < tile) before += count;
    }
    total = __reduce_add_sync(0xffffffffu, total);
    before = __reduce_add_sync(0xffffffffu, before);
    if (lane == 0) {
      next[e] = before;
      in_warp[e] = total;
    }
  }
  __syncthreads();
  // Each thread a run of consecutive experts, its offset from a scan over the block.
  const int per_thread = (experts + kPlaceThreads - 1) / kPlaceThreads;
  const int begin = min(static_cast<int>(threadIdx.x) * per_thread, experts),
            end = min(begin + per_thread, experts);
  int32_t run_total = 0;
  for (int e = begin; e < end; ++e) run_total += in_warp[e];
  using Scan = cub::BlockScan<int32_t, kPlaceThreads>;
  __shared__ typename Scan::TempStorage scan;
  int32_t offset, all;
  Scan(scan).ExclusiveSum(run_total, offset, all);
  for (int e = begin; e < end; ++e) {
    if (tile == 0) host_offsets[e] = offset;
    next[e] += offset;
    offset += in_warp[e];
    in_warp[e] = 0;
  }
  if (tile == 0 && threadIdx.x == 0) host_offsets[experts] = all;
  for (int i = experts + threadIdx.x; i < kPlaceWarps * experts; i += kPlaceThreads) in_warp[i] = 0;

  __syncthreads();
  const unsigned lower_lanes = (1u << lane) - 1;
#pragma unroll
  for (int r = 0; r < kPlaceRounds; ++r) {
    if (first + r * kPlaceThreads >= n) break;  // the same for the whole block
    const int e = round_expert[r];
    const unsigned peers = __match_any_sync(0xffffffffu, e);
    const int rank = __popc(peers & lower_lanes), count = __popc(peers);
    const bool leader = e >= 0 && rank == 0;
    if (leader) in_warp[warp * experts + e] = count;
    __syncthreads();
    if (e >= 0) {
      int32_t row = next[e] + rank;
      for (int w = 0; w < warp; ++w) row += in_warp[w * experts + e];
      const int64_t a = first + r * kPlaceThreads + threadIdx.x;
      permutation[row] = static_cast<int32_t>(a);
      inverse[a] = row;
    }
    __syncthreads();
    if (leader) {
      atomicAdd(next + e, count);
      in_warp[warp * experts + e] = 0;
    }
    __syncthreads();
  }
}

void check_router(const cpu::RouterShape& s) {
  check(s.experts > 0 && s.experts <= kMaxExperts, "route_tokens: experts must be in 1..", kMaxExperts,
        ", got ", s.experts);
  check(s.groups > 0 && s.experts % s.groups == 0, "route_tokens: ", s.experts, " experts do not split into ",
        s.groups, " groups");
  check(s.topk_groups > 0 && s.topk_groups <= s.groups, "route_tokens: topk_group ", s.topk_groups,
        " must be in 1..", s.groups);
  check(s.topk > 0 && s.topk <= 32 && s.topk <= s.experts, "route_tokens: topk ", s.topk, " must be in 1..",
        std::min<int64_t>(32, s.experts));
}

}  // namespace

void clamped_swiglu_halves_forward(const __nv_bfloat16* gate_up, __nv_bfloat16* out, int64_t rows,
                                   int64_t cols, float limit, cudaStream_t stream) {
  check(cols > 0 && rows >= 0, "clamped_swiglu_halves_forward: ", rows, " rows of ", cols);
  if (rows == 0) return;
  with_width(swiglu_width(gate_up, out, cols), [&](auto width) {
    constexpr int V = decltype(width)::value;
    launch_kernel(swiglu_halves_forward_kernel<V>, grid_blocks(rows * (cols / V), kThreads), kThreads, 0,
                  stream, gate_up, out, rows, cols, limit);
  });
  SPINDLE_LAUNCHED("swiglu_halves_forward_kernel");
}

void clamped_swiglu_halves_backward(__nv_bfloat16* gate_up, const __nv_bfloat16* dout, int64_t rows,
                                    int64_t cols, float limit, cudaStream_t stream) {
  check(cols > 0 && rows >= 0, "clamped_swiglu_halves_backward: ", rows, " rows of ", cols);
  if (rows == 0) return;
  with_width(swiglu_width(gate_up, dout, cols), [&](auto width) {
    constexpr int V = decltype(width)::value;
    launch_kernel(swiglu_halves_backward_kernel<V>, grid_blocks(rows * (cols / V), kThreads), kThreads, 0,
                  stream, gate_up, dout, rows, cols, limit);
  });
  SPINDLE_LAUNCHED("swiglu_halves_backward_kernel");
}

void route_tokens(const cpu::RouterShape& s, const float* logits, const float* bias, int32_t* expert,
                  float* weight, cudaStream_t stream) {
  check_router(s);
  if (s.tokens == 0) return;
  const size_t shared_bytes = kRouterWarps *
                              static_cast<size_t>(2 * s.experts + s.groups + std::max(s.experts, s.groups)) *
                              sizeof(float);
  allow_shared_memory(route_kernel, shared_bytes, "route_kernel: ", s.experts, " experts in ", s.groups,
                      " groups");
  const auto blocks = static_cast<unsigned>((s.tokens + kRouterWarps - 1) / kRouterWarps);
  launch_kernel(route_kernel, blocks, kRouterWarps * 32, shared_bytes, stream, s, logits, bias, expert,
                weight);
  SPINDLE_LAUNCHED("route_kernel");
}

void route_weights_backward(const cpu::RouterShape& s, const float* logits, const int32_t* expert,
                            const float* dweight, float* dlogits, cudaStream_t stream) {
  check_router(s);
  if (s.tokens == 0) return;
  const auto blocks = static_cast<unsigned>((s.tokens + kRouterWarps - 1) / kRouterWarps);
  launch_kernel(route_backward_kernel, blocks, kRouterWarps * 32, 0, stream, s, logits, expert, dweight,
                dlogits);
  SPINDLE_LAUNCHED("route_backward_kernel");
}

void ExpertPermutation::build(const int32_t* expert, int64_t assignments, int64_t experts,
                              int32_t* permutation, int32_t* inverse, cudaStream_t stream) {
  check(assignments >= 0 && assignments < INT_MAX, "ExpertPermutation: ", assignments,
        " assignments (int32 limit)");
  check(experts > 0 && experts <= kMaxExperts, "ExpertPermutation: experts must be in 1..", kMaxExperts,
        ", got ", experts);
  // One tile at least, so that no assignments still give offsets of zero.
  const int64_t tiles = std::max<int64_t>(1, (assignments + kTile - 1) / kTile);
  if (tile_counts_.size() < static_cast<size_t>(tiles * experts)) {
    tile_counts_ = DeviceBuffer<int32_t>();
    tile_counts_ = DeviceBuffer<int32_t>(static_cast<size_t>(tiles * experts), MemoryCategory::Workspace);
  }
  if (pinned_count_ < experts + 1) {
    pinned_ = allocate_pinned(static_cast<size_t>(experts + 1) * sizeof(int32_t), "the experts' row offsets");
    pinned_count_ = experts + 1;
  }
  // Under unified addressing (every 64-bit process) a kernel reaches pinned memory from
  // cudaHostAlloc (not write-combined) through its host address.
  auto* host_offsets = static_cast<int32_t*>(pinned_.get());
  const auto E = static_cast<int>(experts);
  launch_kernel(tile_count_kernel, static_cast<unsigned>(tiles), kPlaceThreads,
                static_cast<size_t>(experts) * sizeof(int32_t), stream, expert, assignments, E,
                tile_counts_.data());
  SPINDLE_LAUNCHED("tile_count_kernel");
  const size_t shared_bytes = static_cast<size_t>(1 + kPlaceWarps) * experts * sizeof(int32_t);
  allow_shared_memory(place_kernel, shared_bytes, "place_kernel: ", experts, " experts");
  launch_kernel(place_kernel, static_cast<unsigned>(tiles), kPlaceThreads, shared_bytes, stream, expert,
                assignments, E, tile_counts_.data(), static_cast<int>(tiles), host_offsets, permutation,
                inverse);
  SPINDLE_LAUNCHED("place_kernel");
  built_event_.record(stream);
  built_ = experts + 1;
}

std::vector<int32_t> ExpertPermutation::host_offsets() const {
  check(built_ > 0, "ExpertPermutation: host_offsets() before build()");
  built_event_.synchronize();
  const auto* values = static_cast<const int32_t*>(pinned_.get());
  return std::vector<int32_t>(values, values + built_);
}

}  // namespace spindle::cuda
