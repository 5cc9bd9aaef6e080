// DSA k-pool indexer: pooling and the per-query top-k (the scores: indexer_scores.cu). See indexer.h
// for the contract and launch shapes.
#include <algorithm>
#include <cmath>

#include "backend/cuda/check.h"
#include "core/error.h"
#include "kernels/cuda/indexer.h"

namespace spindle::cuda {

namespace {

constexpr int kThreads = 256;
constexpr unsigned kFull = 0xffffffffu;

__global__ void indexer_pool_keys_kernel(const __nv_bfloat16* __restrict__ keys,
                                         const __nv_bfloat16* __restrict__ gate,
                                         const __nv_bfloat16* __restrict__ ape,
                                         __nv_bfloat16* __restrict__ pool_keys, int64_t pools, int64_t d,
                                         int64_t kp) {
  const int64_t i = static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x;
  if (i >= pools * d) return;
  const int64_t p = i / d, c = i % d;
  float mx = -INFINITY;
  for (int64_t j = 0; j < kp; ++j)
    mx = fmaxf(mx, __bfloat162float(gate[(p * kp + j) * d + c]) + __bfloat162float(ape[j * d + c]));
  float sum = 0.0f, acc = 0.0f;
  for (int64_t j = 0; j < kp; ++j) {
    const float e =
        expf(__bfloat162float(gate[(p * kp + j) * d + c]) + __bfloat162float(ape[j * d + c]) - mx);
    sum += e;
    acc += e * __bfloat162float(keys[(p * kp + j) * d + c]);
  }
  pool_keys[i] = __float2bfloat16(acc / sum);
}

// Order-preserving map of fp32 bits to unsigned: a > b as floats iff key(a) > key(b).
__device__ __forceinline__ unsigned ordered(float value) {
  const unsigned u = __float_as_uint(value);
  return (u & 0x80000000u) ? ~u : (u | 0x80000000u);
}

// Exclusive prefix sum over the CTA (kThreads threads); `total` gets the sum. Uses shared[0..8].
__device__ int block_exclusive_scan(int value, int* shared, int& total) {
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  int inclusive = value;
  for (int offset = 1; offset < 32; offset *= 2) {
    const int up = __shfl_up_sync(kFull, inclusive, offset);
    if (lane >= offset) inclusive += up;
  }
  if (lane == 31) shared[warp] = inclusive;
  __syncthreads();
  if (threadIdx.x == 0) {
    int running = 0;
    for (int w = 0; w < kThreads / 32; ++w) {
      const int v = shared[w];
      shared[w] = running;
      running += v;
    }
    shared[kThreads / 32] = running;
  }
  __syncthreads();
  const int result = shared[warp] + inclusive - value;
  total = shared[kThreads / 32];
  __syncthreads();
  return result;
}

// One CTA per query of the block: the exact top topk/kpool of its visible pools' scores (row
// blockIdx.x of the workspace), ties to the lower pool, in ascending pool order, expanded to
// tokens; then the tail; -1 elsewhere. Query t (absolute) writes row t - first_query.
__global__ void __launch_bounds__(kThreads)
    indexer_topk_kernel(const float* __restrict__ workspace, int32_t* __restrict__ selected, int64_t t0,
                        int64_t first_query, int64_t pools, int64_t kp, int64_t topk, int64_t width,
                        int select_tail) {
  __shared__ unsigned hist[256];
  __shared__ unsigned s_prefix, s_k;
  __shared__ int scan_shared[kThreads / 32 + 1];
  const int64_t t = t0 + blockIdx.x;
  const float* scores = workspace + static_cast<int64_t>(blockIdx.x) * pools;
  int32_t* out = selected + (t - first_query) * width;
  for (int64_t i = threadIdx.x; i < width; i += kThreads) out[i] = -1;
  __syncthreads();  // the -1 fill is visible to the whole CTA before the selection overwrites it

  const int64_t visible = min(pools, (t + 1) / kp);
  const int64_t chosen = min(topk / kp, visible);
  if (chosen > 0) {
    // Threshold: the chosen-th largest key, and how many of the keys equal to it to take.
    unsigned prefix = 0, mask = 0, k = static_cast<unsigned>(chosen);
    const bool all = chosen == visible;
    if (!all) {
      for (int shift = 24; shift >= 0; shift -= 8) {
        for (int b = threadIdx.x; b < 256; b += kThreads) hist[b] = 0;
        __syncthreads();
        for (int64_t p = threadIdx.x; p < visible; p += kThreads) {
          const unsigned u = ordered(scores[p]);
          if ((u & mask) == prefix) atomicAdd(&hist[(u >> shift) & 255u], 1u);
        }
        __syncthreads();
        if (threadIdx.x == 0) {
          unsigned above = 0;
          for (int b = 255; b >= 0; --b) {
            if (above + hist[b] >= k) {
              prefix |= static_cast<unsigned>(b) << shift;
              k -= above;
              break;
            }
            above += hist[b];
          }
          s_prefix = prefix;
          s_k = k;
        }
        __syncthreads();
        prefix = s_prefix;
        k = s_k;
        mask |= 255u << shift;
      }
    }
    // In pool order: take every key above the threshold and the first k equal to it.
    int eq_before = 0, taken_before = 0;
    for (int64_t base = 0; base < visible; base += kThreads) {
      const int64_t p = base + threadIdx.x;
      const unsigned u = p < visible ? ordered(scores[p]) : 0u;
      const bool valid = p < visible;
      int eq_total = 0, taken_total = 0;
      const int eq_rank =
          eq_before + block_exclusive_scan(valid && u == prefix ? 1 : 0, scan_shared, eq_total);
      const bool take = valid && (all || u > prefix || (u == prefix && eq_rank < static_cast<int>(k)));
      const int position = taken_before + block_exclusive_scan(take ? 1 : 0, scan_shared, taken_total);
      if (take)
        for (int64_t j = 0; j < kp; ++j) out[position * kp + j] = static_cast<int32_t>(p * kp + j);
      eq_before += eq_total;
      taken_before += taken_total;
    }
  }
  if (select_tail && kp > 1) {
    const int64_t tail = (t + 1) % kp;
    for (int64_t j = threadIdx.x; j < tail; j += kThreads)
      out[topk + j] = static_cast<int32_t>(t + 1 - tail + j);
  }
}

}  // namespace

void indexer_pool_keys(const cpu::IndexerShape& s, const __nv_bfloat16* keys, const __nv_bfloat16* gate,
                       const __nv_bfloat16* ape, __nv_bfloat16* pool_keys, cudaStream_t stream) {
  check(s.kpool > 0 && s.head_dim > 0, "indexer_pool_keys: expected kpool and head_dim > 0, got ", s.kpool,
        " and ", s.head_dim);
  const int64_t n = s.complete_pools() * s.head_dim;
  if (n == 0) return;
  const int64_t blocks = (n + kThreads - 1) / kThreads;
  check(blocks < (int64_t{1} << 31), "indexer_pool_keys: ", n, " values are too many for one launch");
  indexer_pool_keys_kernel<<<static_cast<unsigned>(blocks), kThreads, 0, stream>>>(
      keys, gate, ape, pool_keys, s.complete_pools(), s.head_dim, s.kpool);
  SPINDLE_LAUNCHED("indexer_pool_keys_kernel");
}

size_t indexer_select_workspace_bytes(const cpu::IndexerShape& s, int64_t query_block) {
  return static_cast<size_t>(query_block) * static_cast<size_t>(s.complete_pools()) * sizeof(float);
}

void indexer_select(const cpu::IndexerShape& s, const __nv_bfloat16* q, const __nv_bfloat16* pool_keys,
                    const __nv_bfloat16* head_weights, int32_t* selected, float* workspace,
                    size_t workspace_bytes, cudaStream_t stream) {
  check(s.kpool > 0 && s.head_dim > 0 && s.heads > 0 && s.topk >= 0 && s.first_query >= 0 &&
            s.first_query <= s.tokens,
        "indexer_select: expected kpool, head_dim, heads > 0, topk >= 0 and 0 <= first_query <= tokens, got "
        "kpool ",
        s.kpool, ", head_dim ", s.head_dim, ", heads ", s.heads, ", topk ", s.topk, ", first_query ",
        s.first_query, ", tokens ", s.tokens);
  if (s.queries() == 0) return;
  const int64_t pools = s.complete_pools();
  const size_t row_bytes = static_cast<size_t>(std::max<int64_t>(pools, 1)) * sizeof(float);
  const int64_t block = std::min<int64_t>(s.queries(), static_cast<int64_t>(workspace_bytes / row_bytes));
  check(block >= 1 || pools == 0, "indexer_select: the workspace (", workspace_bytes,
        " bytes) holds no query row of ", pools, " pooled scores (", row_bytes, " bytes)");
  const int64_t query_block = pools == 0 ? s.queries() : block;
  for (int64_t t0 = s.first_query; t0 < s.tokens; t0 += query_block) {
    const int64_t rows = std::min(query_block, s.tokens - t0);
    check(rows < (int64_t{1} << 31), "indexer_select: query block of ", rows,
          " rows is too large for one launch");
    indexer_scores(s, q, pool_keys, head_weights, t0, rows, workspace, stream);
    indexer_topk_kernel<<<static_cast<unsigned>(rows), kThreads, 0, stream>>>(
        workspace, selected, t0, s.first_query, pools, s.kpool, s.topk, s.width(), s.select_tail ? 1 : 0);
    SPINDLE_LAUNCHED("indexer_topk_kernel");
  }
}

}  // namespace spindle::cuda
