// The pairs' lists of the sparse MLA kernels; see sparse_mla_pairs.h.
#include "backend/cuda/check.h"
#include "kernels/cuda/launch.cuh"
#include "kernels/cuda/shared_memory_limit.h"
#include "kernels/cuda/sparse_mla_pairs.h"

namespace spindle::cuda {

namespace {

constexpr int kThreads = 256;
constexpr int64_t kMaxWidth = 16384;  // the pass's three lists fit shared memory

int64_t list_stride(int64_t width) { return 2 * width; }

// Index of the first of list[0, n) (ascending) not less than x.
__device__ __forceinline__ int lower_bound(const int32_t* list, int n, int32_t x) {
  int lo = 0, hi = n;
  while (lo < hi) {
    const int mid = (lo + hi) / 2;
    if (list[mid] < x)
      lo = mid + 1;
    else
      hi = mid;
  }
  return lo;
}

// One CTA per pair (queries 2p, 2p + 1): whether the pair walks its list together and, where it
// does, the list (sparse_mla_pairs.h) and its length.
__global__ void __launch_bounds__(kThreads)
    pair_union_kernel(const int32_t* selected, int64_t width, int64_t tokens, int64_t stride,
                      float share_limit, int32_t* unions, int32_t* lengths, int32_t* shares) {
  wait_for_earlier_kernels();
  extern __shared__ int32_t lists[];  // first [width], second [width], before [width + 1]
  __shared__ int counts[2];
  __shared__ int scan[kThreads];
  const int W = static_cast<int>(width);
  int32_t *first = lists, *second = lists + W, *before = lists + 2 * W;
  const int64_t pair = blockIdx.x, t0 = 2 * pair, t1 = t0 + 1;
  if (threadIdx.x < 2) counts[threadIdx.x] = 0;
  for (int i = threadIdx.x; i < W; i += kThreads) {
    first[i] = selected[t0 * width + i];
    second[i] = t1 < tokens ? selected[t1 * width + i] : -1;
  }
  __syncthreads();
  bool ordered = true;
  int n0 = 0, n1 = 0;
  for (int i = threadIdx.x; i < W; i += kThreads) {
    const int32_t x = first[i], y = second[i];
    n0 += x >= 0;
    n1 += y >= 0;
    if (x >= 0) ordered &= x <= kRowMask && (i == 0 || (first[i - 1] >= 0 && first[i - 1] < x));
    if (y >= 0) ordered &= y <= kRowMask && (i == 0 || (second[i - 1] >= 0 && second[i - 1] < y));
  }
  atomicAdd(&counts[0], n0);
  atomicAdd(&counts[1], n1);
  if (!__syncthreads_and(ordered)) {  // apart: the kernels read the selections themselves
    if (threadIdx.x == 0) {
      lengths[pair] = 0;
      shares[pair] = 0;
    }
    return;
  }
  const int na = counts[0], nb = counts[1];
  // before[j]: how many of second[0, j) the first selection holds; first the flags, then their scan.
  for (int j = threadIdx.x; j <= W; j += kThreads) {
    int in = 0;
    if (j < nb) {
      const int i = lower_bound(first, na, second[j]);
      in = i < na && first[i] == second[j];
    }
    before[j] = in;
  }
  __syncthreads();
  const int per = (nb + 1 + kThreads - 1) / kThreads, begin = threadIdx.x * per,
            end = min(begin + per, nb + 1);
  int sum = 0;
  for (int j = begin; j < end; ++j) sum += before[j];
  scan[threadIdx.x] = sum;
  __syncthreads();
  for (int offset = 1; offset < kThreads; offset *= 2) {
    const int add = threadIdx.x >= offset ? scan[threadIdx.x - offset] : 0;
    __syncthreads();
    scan[threadIdx.x] += add;
    __syncthreads();
  }
  int running = scan[threadIdx.x] - sum;
  for (int j = begin; j < end; ++j) {
    const int in = before[j];
    before[j] = running;
    running += in;
  }
  __syncthreads();
  const int n = na + nb - before[nb];
  const bool together = static_cast<float>(n) <= share_limit * static_cast<float>(max(na, nb));
  if (threadIdx.x == 0) {
    lengths[pair] = together ? n : 0;
    shares[pair] = together;
  }
  if (!together) return;  // the kernels read the selections themselves
  int32_t* out = unions + pair * stride;
  for (int i = threadIdx.x; i < na; i += kThreads) {
    const int32_t x = first[i];
    const int j = lower_bound(second, nb, x);
    out[i + j - before[j]] = x | kInFirst | (j < nb && second[j] == x ? kInSecond : 0);
  }
  for (int j = threadIdx.x; j < nb; j += kThreads) {
    if (before[j + 1] != before[j]) continue;  // the first selection's slot has it
    const int32_t y = second[j];
    out[lower_bound(first, na, y) + j - before[j]] = y | kInSecond;
  }
}

}  // namespace

int64_t pair_list_bytes(int64_t tokens, int64_t width) {
  return (tokens + 1) / 2 * (list_stride(width) + 2) * static_cast<int64_t>(sizeof(int32_t));
}

PairLists pair_lists(const int32_t* selected, int64_t width, int64_t tokens, double share_limit,
                     cudaStream_t stream) {
  PairLists p;
  const int64_t pairs = (tokens + 1) / 2, stride = list_stride(width);
  p.workspace = DeviceBuffer<int32_t>(static_cast<size_t>(pairs * (stride + 2)), MemoryCategory::Workspace);
  int32_t *lengths = p.workspace.data() + pairs * stride, *together = lengths + pairs;
  p.view = {p.workspace.data(), lengths, together, stride};
  if (pairs == 0) return p;
  if (width > kMaxWidth || tokens > int64_t{kRowMask} + 1) {  // every pair apart: lengths and flags 0
    SPINDLE_CUDA(cudaMemsetAsync(lengths, 0, static_cast<size_t>(2 * pairs) * sizeof(int32_t), stream));
    return p;
  }
  const size_t bytes = static_cast<size_t>(3 * width + 1) * sizeof(int32_t);
  allow_shared_memory(pair_union_kernel, bytes, "sparse MLA pairs' lists: width ", width);
  launch_kernel(pair_union_kernel, static_cast<unsigned>(pairs), kThreads, bytes, stream, selected, width,
                tokens, stride, static_cast<float>(share_limit), p.workspace.data(), lengths, together);
  SPINDLE_LAUNCHED("pair_union_kernel");
  return p;
}

}  // namespace spindle::cuda
