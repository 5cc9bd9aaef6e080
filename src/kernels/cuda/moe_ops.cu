// MoE kernels: the clamped SwiGLU (elementwise, memory-bound), the router (one warp per token,
// the token's scores in shared memory, group and expert choice by repeated warp arg-max with
// ties to the lower index), its weight backward (one warp per token) and the expert-sorted
// permutation (CUB's stable radix sort of the expert ids, with the assignment index as value).
#include <algorithm>
#include <climits>
#include <cmath>
#include <cub/device/device_radix_sort.cuh>

#include "backend/cuda/check.h"
#include "kernels/cuda/moe_ops.h"
#include "kernels/cuda/shared_memory_limit.h"

namespace spindle::cuda {

namespace {

constexpr int kThreads = 256;
constexpr int kRouterWarps = 4;
constexpr int64_t kMaxExperts = 2048;

__device__ float sigmoidf(float x) { return 1.0f / (1.0f + expf(-x)); }

unsigned elementwise_blocks(int64_t n) {
  return static_cast<unsigned>(std::min<int64_t>((n + kThreads - 1) / kThreads, 65536));
}

// One element of the clamped SwiGLU: out = silu(min(gate, limit)) * clamp(up, -limit, limit).
__device__ void swiglu_element(const __nv_bfloat16& gate, const __nv_bfloat16& up, __nv_bfloat16& out,
                               float limit) {
  const float g = fminf(__bfloat162float(gate), limit);
  const float u = fminf(fmaxf(__bfloat162float(up), -limit), limit);
  out = __float2bfloat16(g * sigmoidf(g) * u);
}

// Its gradients; dgate and dup may be gate and up (everything is read before they are written).
__device__ void swiglu_gradient_element(const __nv_bfloat16& gate, const __nv_bfloat16& up,
                                        const __nv_bfloat16& dout, __nv_bfloat16& dgate, __nv_bfloat16& dup,
                                        float limit) {
  const float graw = __bfloat162float(gate), uraw = __bfloat162float(up), d = __bfloat162float(dout);
  const float g = fminf(graw, limit), u = fminf(fmaxf(uraw, -limit), limit);
  const float sg = sigmoidf(g);
  dgate = __float2bfloat16(graw <= limit ? d * u * sg * (1.0f + g * (1.0f - sg)) : 0.0f);
  dup = __float2bfloat16(uraw >= -limit && uraw <= limit ? d * g * sg : 0.0f);
}

__global__ void swiglu_forward_kernel(const __nv_bfloat16* gate, const __nv_bfloat16* up, __nv_bfloat16* out,
                                      int64_t n, float limit) {
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x)
    swiglu_element(gate[i], up[i], out[i], limit);
}

__global__ void swiglu_backward_kernel(const __nv_bfloat16* gate, const __nv_bfloat16* up,
                                       const __nv_bfloat16* dout, __nv_bfloat16* dgate, __nv_bfloat16* dup,
                                       int64_t n, float limit) {
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x)
    swiglu_gradient_element(gate[i], up[i], dout[i], dgate[i], dup[i], limit);
}

// The same over rows of [gate | up] ([rows, 2 cols]) into out [rows, cols]: a block per row at a
// time, its threads over the columns.
__global__ void swiglu_halves_forward_kernel(const __nv_bfloat16* gate_up, __nv_bfloat16* out, int64_t rows,
                                             int cols, float limit) {
  for (int64_t r = blockIdx.x; r < rows; r += gridDim.x) {
    const __nv_bfloat16* gate = gate_up + r * 2 * cols;
    for (int c = threadIdx.x; c < cols; c += blockDim.x)
      swiglu_element(gate[c], gate[cols + c], out[r * cols + c], limit);
  }
}

// dgate, dup in place of gate, up.
__global__ void swiglu_halves_backward_kernel(__nv_bfloat16* gate_up, const __nv_bfloat16* dout, int64_t rows,
                                              int cols, float limit) {
  for (int64_t r = blockIdx.x; r < rows; r += gridDim.x) {
    __nv_bfloat16* gate = gate_up + r * 2 * cols;
    for (int c = threadIdx.x; c < cols; c += blockDim.x)
      swiglu_gradient_element(gate[c], gate[cols + c], dout[r * cols + c], gate[c], gate[cols + c], limit);
  }
}

// Blocks for the row kernels, after checking their sizes.
unsigned row_blocks(int64_t rows, int64_t cols, const char* what) {
  check(cols > 0 && cols <= INT_MAX && rows >= 0, what, ": ", rows, " rows of ", cols);
  return static_cast<unsigned>(std::min<int64_t>(rows, 65536));
}

// Warp arg-max over (value, index) pairs: larger value wins, ties to the lower index.
__device__ void warp_argmax(float& value, int& index) {
  for (int offset = 16; offset > 0; offset /= 2) {
    const float v = __shfl_xor_sync(0xffffffffu, value, offset);
    const int i = __shfl_xor_sync(0xffffffffu, index, offset);
    if (v > value || (v == value && i < index)) {
      value = v;
      index = i;
    }
  }
}

// Shared memory per warp: score[E], choice[E], group_score[G], taken flags[max(E, G)] (ints).
__global__ void route_kernel(cpu::RouterShape s, const float* logits, const float* bias, int32_t* expert,
                             float* weight) {
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
  if (s.topk_groups < G) {
    // Keep the topk_groups best groups (ties to the lower index); mask the others' choices.
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

// Counts in shared memory first, then one global add per block and expert: every assignment's
// global atomic on the same few counters took 13 us at 65,536 assignments.
__global__ void count_kernel(const int32_t* expert, int64_t n, int experts, int32_t* counts) {
  extern __shared__ int32_t local[];
  for (int e = threadIdx.x; e < experts; e += blockDim.x) local[e] = 0;
  __syncthreads();
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x)
    atomicAdd(local + expert[i], 1);
  __syncthreads();
  for (int e = threadIdx.x; e < experts; e += blockDim.x)
    if (local[e] != 0) atomicAdd(counts + e, local[e]);
}

__global__ void offsets_kernel(const int32_t* counts, int64_t experts, int32_t* offsets) {
  int32_t total = 0;
  for (int64_t e = 0; e < experts; ++e) {
    offsets[e] = total;
    total += counts[e];
  }
  offsets[experts] = total;
}

__global__ void iota_kernel(int32_t* out, int64_t n) {
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x)
    out[i] = static_cast<int32_t>(i);
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

void clamped_swiglu_forward(const __nv_bfloat16* gate, const __nv_bfloat16* up, __nv_bfloat16* out, int64_t n,
                            float limit, cudaStream_t stream) {
  if (n == 0) return;
  swiglu_forward_kernel<<<elementwise_blocks(n), kThreads, 0, stream>>>(gate, up, out, n, limit);
  SPINDLE_LAUNCHED("swiglu_forward_kernel");
}

void clamped_swiglu_backward(const __nv_bfloat16* gate, const __nv_bfloat16* up, const __nv_bfloat16* dout,
                             __nv_bfloat16* dgate, __nv_bfloat16* dup, int64_t n, float limit,
                             cudaStream_t stream) {
  if (n == 0) return;
  swiglu_backward_kernel<<<elementwise_blocks(n), kThreads, 0, stream>>>(gate, up, dout, dgate, dup, n,
                                                                         limit);
  SPINDLE_LAUNCHED("swiglu_backward_kernel");
}

void clamped_swiglu_halves_forward(const __nv_bfloat16* gate_up, __nv_bfloat16* out, int64_t rows,
                                   int64_t cols, float limit, cudaStream_t stream) {
  const unsigned blocks = row_blocks(rows, cols, "clamped_swiglu_halves_forward");
  if (rows == 0) return;
  swiglu_halves_forward_kernel<<<blocks, kThreads, 0, stream>>>(gate_up, out, rows, static_cast<int>(cols),
                                                                limit);
  SPINDLE_LAUNCHED("swiglu_halves_forward_kernel");
}

void clamped_swiglu_halves_backward(__nv_bfloat16* gate_up, const __nv_bfloat16* dout, int64_t rows,
                                    int64_t cols, float limit, cudaStream_t stream) {
  const unsigned blocks = row_blocks(rows, cols, "clamped_swiglu_halves_backward");
  if (rows == 0) return;
  swiglu_halves_backward_kernel<<<blocks, kThreads, 0, stream>>>(gate_up, dout, rows, static_cast<int>(cols),
                                                                 limit);
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
  route_kernel<<<blocks, kRouterWarps * 32, shared_bytes, stream>>>(s, logits, bias, expert, weight);
  SPINDLE_LAUNCHED("route_kernel");
}

void route_weights_backward(const cpu::RouterShape& s, const float* logits, const int32_t* expert,
                            const float* dweight, float* dlogits, cudaStream_t stream) {
  check_router(s);
  if (s.tokens == 0) return;
  const auto blocks = static_cast<unsigned>((s.tokens + kRouterWarps - 1) / kRouterWarps);
  route_backward_kernel<<<blocks, kRouterWarps * 32, 0, stream>>>(s, logits, expert, dweight, dlogits);
  SPINDLE_LAUNCHED("route_backward_kernel");
}

void ExpertPermutation::download_offsets(const int32_t* offsets, int64_t experts, cudaStream_t stream) {
  if (pinned_count_ < experts + 1) {
    pinned_ = allocate_pinned(static_cast<size_t>(experts + 1) * sizeof(int32_t), "the experts' row offsets");
    pinned_count_ = experts + 1;
  }
  SPINDLE_CUDA(cudaMemcpyAsync(pinned_.get(), offsets, static_cast<size_t>(experts + 1) * sizeof(int32_t),
                               cudaMemcpyDeviceToHost, stream));
  downloaded_event_.record(stream);
  downloaded_ = experts + 1;
}

std::vector<int32_t> ExpertPermutation::host_offsets() const {
  check(downloaded_ > 0, "ExpertPermutation: host_offsets() before download_offsets()");
  downloaded_event_.synchronize();
  const auto* values = static_cast<const int32_t*>(pinned_.get());
  return std::vector<int32_t>(values, values + downloaded_);
}

void ExpertPermutation::build(const int32_t* expert, int64_t assignments, int64_t experts, int32_t* counts,
                              int32_t* offsets, int32_t* permutation, cudaStream_t stream) {
  check(assignments >= 0 && assignments < INT_MAX, "ExpertPermutation: ", assignments,
        " assignments (int32 limit)");
  check(experts > 0 && experts <= kMaxExperts, "ExpertPermutation: experts must be in 1..", kMaxExperts,
        ", got ", experts);
  SPINDLE_CUDA(cudaMemsetAsync(counts, 0, static_cast<size_t>(experts) * sizeof(int32_t), stream));
  if (assignments > 0) {
    count_kernel<<<elementwise_blocks(assignments), kThreads, static_cast<size_t>(experts) * sizeof(int32_t),
                   stream>>>(expert, assignments, static_cast<int>(experts), counts);
    SPINDLE_LAUNCHED("count_kernel");
  }
  offsets_kernel<<<1, 1, 0, stream>>>(counts, experts, offsets);
  SPINDLE_LAUNCHED("offsets_kernel");
  if (assignments == 0) return;
  const int n = static_cast<int>(assignments);
  int end_bit = 1;
  while ((int64_t{1} << end_bit) < experts) ++end_bit;
  size_t temp_bytes = 0;
  SPINDLE_CUDA(cub::DeviceRadixSort::SortPairs(nullptr, temp_bytes, expert, static_cast<int32_t*>(nullptr),
                                               static_cast<const int32_t*>(nullptr), permutation, n, 0,
                                               end_bit, stream));
  const size_t words = 2 * static_cast<size_t>(n) + 64 + (temp_bytes + sizeof(int32_t) - 1) / sizeof(int32_t);
  if (workspace_.size() < words) {
    workspace_ = DeviceBuffer<int32_t>();
    workspace_ = DeviceBuffer<int32_t>(words, MemoryCategory::Workspace);
  }
  int32_t* keys_out = workspace_.data();
  int32_t* values_in = keys_out + n;
  // CUB's temporary storage, 256-byte aligned.
  auto temp_address = reinterpret_cast<uintptr_t>(values_in + n);
  temp_address = (temp_address + 255) / 256 * 256;
  iota_kernel<<<elementwise_blocks(n), kThreads, 0, stream>>>(values_in, n);
  SPINDLE_LAUNCHED("iota_kernel");
  SPINDLE_CUDA(cub::DeviceRadixSort::SortPairs(reinterpret_cast<void*>(temp_address), temp_bytes, expert,
                                               keys_out, values_in, permutation, n, 0, end_bit, stream));
}

}  // namespace spindle::cuda
