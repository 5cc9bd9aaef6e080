// DSA k-pool indexer: pooling and the per-query top-k (the scores: indexer_scores.cu). See indexer.h
// for the contract and launch shapes.
#include <algorithm>
#include <cmath>
#include <cstdint>

#include "backend/cuda/check.h"
#include "core/error.h"
#include "kernels/cuda/indexer.h"
#include "kernels/cuda/shared_memory_limit.h"

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

// Exclusive prefix sum over the CTA (T threads); `total` gets the sum. Uses shared[0 .. T / 32]: the
// warps' sums, scanned by warp 0.
template <int T>
__device__ int block_exclusive_scan(int value, int* shared, int& total) {
  constexpr int kWarps = T / 32;
  static_assert(kWarps <= 32, "warp 0 scans one sum a lane");
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  int inclusive = value;
  for (int offset = 1; offset < 32; offset *= 2) {
    const int up = __shfl_up_sync(kFull, inclusive, offset);
    if (lane >= offset) inclusive += up;
  }
  if (lane == 31) shared[warp] = inclusive;
  __syncthreads();
  if (warp == 0) {
    const int mine = lane < kWarps ? shared[lane] : 0;
    int running = mine;
    for (int offset = 1; offset < 32; offset *= 2) {
      const int up = __shfl_up_sync(kFull, running, offset);
      if (lane >= offset) running += up;
    }
    if (lane < kWarps) shared[lane] = running - mine;
    if (lane == 31) shared[kWarps] = running;
  }
  __syncthreads();
  const int result = shared[warp] + inclusive - value;
  total = shared[kWarps];
  __syncthreads();
  return result;
}

// The selection's radix passes: the first over the keys' top kHeadBits (sign, exponent and three
// mantissa bits), then two of kTailBits over the rest.
constexpr int kHeadBits = 12, kHeadBins = 1 << kHeadBits;
constexpr int kTailBits = 10, kTailBins = 1 << kTailBits;
static_assert(kHeadBits + 2 * kTailBits == 32, "the passes cover the 32-bit key");
// Keys of the threshold's first bin kept in shared memory for the later passes; a row with more
// in that bin (many equal scores) reads the row again instead.
constexpr int kCandidates = 4096;

// The two launch shapes, by the launch's longest row. Up to kShortRow pools: kShortThreads a CTA,
// kShortBlocks CTAs a multiprocessor (what the static shared memory allows; at most 40 registers),
// and every read of the row is from global memory (the rows in flight fit in L2). Longer rows:
// kLongThreads a CTA, one a multiprocessor (64 registers), which keeps the first kCachedKeys keys
// of its row in shared memory from the first pass on, so that only that pass reads them from
// DRAM, 64 KiB of loads in flight a multiprocessor. The rest of a row (from 49,408 pools on,
// 16,128 of a 1M row's 65,536) is read from global memory in each pass, 8 MB over the whole GPU,
// which L2 holds. One CTA a multiprocessor overlaps nothing with a row's fixed work (histograms,
// scans, barriers of 1024 threads), so it pays only on long rows. bench_indexer_topk (8,192 queries,
// H200), against the three-read kernel before it: 8,192 pools 0.38 ms on the short shape (0.40),
// 16,384 0.78 (0.73; 0.87 on the long shape), 20,480 1.01 (0.94), 24,576 1.05 (1.08; 1.47 on the
// short shape), 32,768 1.14 (1.37), 65,536 1.95 (2.63). kCachedKeys leaves 34 KiB for the static
// shared memory (33 KiB).
constexpr int kShortThreads = 256, kLongThreads = 1024, kShortBlocks = 6;
constexpr int64_t kShortRow = 16384;
constexpr int64_t kCachedKeys = (kMaxDynamicShared - 34 * 1024) / sizeof(unsigned);

// f(p, score) for every p in [begin, end) of the row, each of the T threads taking a share: float4
// loads over the 16-byte aligned middle, a batch of them a thread issued before their uses.
// kStreaming loads are marked evict-first in L2, for scores that are not read from global memory
// again.
template <int T, bool kStreaming, class F>
__device__ __forceinline__ void for_each_score(const float* __restrict__ row, int64_t begin, int64_t end,
                                               F f) {
  if (begin >= end) return;
  const int64_t misaligned = static_cast<int64_t>((reinterpret_cast<uintptr_t>(row + begin) / 4) % 4);
  const int64_t head = min(end, begin + (4 - misaligned) % 4);
  for (int64_t p = begin + threadIdx.x; p < head; p += T) f(p, row[p]);
  const float4* body = reinterpret_cast<const float4*>(row + head);
  const int64_t vectors = (end - head) / 4;
  constexpr int kBatch = T >= 1024 ? 4 : 2;  // within the short rows' 40 registers
  for (int64_t v0 = threadIdx.x; v0 < vectors; v0 += int64_t{kBatch} * T) {
    float4 x[kBatch];
#pragma unroll
    for (int j = 0; j < kBatch; ++j) {
      const int64_t v = v0 + int64_t{j} * T;
      x[j] = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
      if (v < vectors) x[j] = kStreaming ? __ldcs(body + v) : __ldg(body + v);
    }
#pragma unroll
    for (int j = 0; j < kBatch; ++j) {
      const int64_t v = v0 + int64_t{j} * T;
      if (v < vectors) {
        const int64_t p = head + 4 * v;
        f(p, x[j].x);
        f(p + 1, x[j].y);
        f(p + 2, x[j].z);
        f(p + 3, x[j].w);
      }
    }
  }
  for (int64_t p = head + 4 * vectors + threadIdx.x; p < end; p += T) f(p, row[p]);
}

// hist[b] = how many of the n keys key(i) with (key & mask) == prefix have bits [shift, shift +
// log2(bins)) equal to b. Every thread of the CTA calls it; it ends with a barrier.
template <int T, class Key>
__device__ void histogram_pass(Key key, int64_t n, unsigned mask, unsigned prefix, int shift, int bins,
                               unsigned* hist) {
  for (int b = threadIdx.x; b < bins; b += T) hist[b] = 0;
  __syncthreads();
#pragma unroll 4
  for (int64_t i = threadIdx.x; i < n; i += T) {
    const unsigned u = key(i);
    if ((u & mask) == prefix) atomicAdd(&hist[(u >> shift) & static_cast<unsigned>(bins - 1)], 1u);
  }
  __syncthreads();
}

// The bin of hist [bins] that holds the k-th largest key (k >= 1, at most the histogram's total)
// and, in k, that key's rank within its bin counted from the top. Each thread sums bins / T
// adjacent bins, a CTA scan orders the sums from the top bin down. Every thread calls it and gets
// both; it ends with a barrier.
template <int T>
__device__ void threshold_bin(const unsigned* hist, int bins, unsigned& k, unsigned& bin, int* scan_shared,
                              unsigned* found) {
  const int per = bins / T, top = bins - 1 - static_cast<int>(threadIdx.x) * per;
  unsigned local = 0;
  for (int b = 0; b < per; ++b) local += hist[top - b];
  int total = 0;
  unsigned above =
      static_cast<unsigned>(block_exclusive_scan<T>(static_cast<int>(local), scan_shared, total));
  if (above < k && above + local >= k) {
    for (int b = 0; b < per; ++b) {
      const unsigned h = hist[top - b];
      if (above + h >= k) {
        found[0] = static_cast<unsigned>(top - b);
        found[1] = k - above;
        break;
      }
      above += h;
    }
  }
  __syncthreads();
  bin = found[0];
  k = found[1];
  __syncthreads();
}

// One CTA of T threads per query of the block: the exact top topk/kpool of its visible pools'
// scores (row blockIdx.x of the workspace), ties to the lower pool, in ascending pool order,
// expanded to tokens; then the tail; -1 elsewhere. Query t (absolute) writes row t - first_query.
//
// Two reads of the row where there are few ties. The first radix pass's histogram, which also
// keeps the keys of pools below `cache_keys` in dynamic shared memory (cache_keys unsigned), where
// the later passes read them. Then each thread, over its own stretch of the row, appends the keys
// of the threshold's bin to shared memory (the other radix passes run there) and marks its groups
// of four pools that hold a key at or above that bin. The output reads only the marked groups
// again: each thread counts its pools above the threshold and equal to it, CTA scans order the
// counts, and each thread writes its pools taken at their places in pool order.
template <int T>
__global__ void __launch_bounds__(T, kShortThreads* kShortBlocks / T)
    indexer_topk_kernel(const float* __restrict__ workspace, int32_t* __restrict__ selected, int64_t t0,
                        int64_t first_query, int64_t pools, int64_t kp, int64_t topk, int64_t width,
                        int select_tail, int64_t cache_keys) {
  constexpr int kWarps = T / 32;
  static_assert(kHeadBins % T == 0 && kTailBins % T == 0, "each thread owns whole bins");
  extern __shared__ __align__(16) unsigned cache[];
  __shared__ unsigned hist[kHeadBins];
  __shared__ unsigned candidates[kCandidates];
  __shared__ unsigned found[2], candidate_count;
  __shared__ int scan_shared[kWarps + 1];
  const int lane = static_cast<int>(threadIdx.x) % 32;
  const int64_t t = t0 + blockIdx.x;
  const float* scores = workspace + static_cast<int64_t>(blockIdx.x) * pools;
  int32_t* out = selected + (t - first_query) * width;
  for (int64_t i = threadIdx.x; i < width; i += T) out[i] = -1;
  __syncthreads();  // the -1 fill is visible to the whole CTA before the selection overwrites it

  // Pools within a row are ints (the launcher checks that they fit).
  const int visible = static_cast<int>(min(pools, (t + 1) / kp));
  const int chosen = static_cast<int>(min(topk / kp, int64_t{visible}));
  if (chosen > 0) {
    // The threshold: the chosen-th largest key, and how many of the keys equal to it to take.
    const bool all = chosen == visible;
    // Keys below `cached` are in the cache once the first pass has run (it does not when all).
    const int cached = all ? 0 : static_cast<int>(min(int64_t{visible}, cache_keys));
    const auto row_key = [scores, cached](int p) { return p < cached ? cache[p] : ordered(scores[p]); };
    // After the first pass each thread takes `groups` groups of four adjacent pools from first_pool
    // on, visited from group lane % groups on so that a warp's 16-byte loads from the cache meet
    // no bank twice where groups is a multiple of 8 (16 in a 1M row). Bit b of `hits` marks groups
    // b * 2^hit_shift on (at most 64 bits) where a key reaches the threshold's first bin (all of them
    // when all).
    const int groups = (visible + 4 * T - 1) / (4 * T),
              first_pool = 4 * groups * static_cast<int>(threadIdx.x);
    int hit_shift = 0;
    while ((64 << hit_shift) < groups) ++hit_shift;
    uint64_t hits = all ? ~uint64_t{0} : 0;
    // 16-byte loads of the uncached scores too where the row is so aligned.
    const bool aligned = reinterpret_cast<uintptr_t>(scores) % 16 == 0;
    // Group `group`'s keys into u (0 past the visible ones); returns its first pool.
    const auto group_keys = [&](int group, unsigned* u) {
      const int p = first_pool + 4 * group;
      if (p + 3 < cached) {
        const uint4 v = *reinterpret_cast<const uint4*>(cache + p);
        u[0] = v.x;
        u[1] = v.y;
        u[2] = v.z;
        u[3] = v.w;
      } else if (aligned && p >= cached && p + 3 < visible) {
        const float4 v = __ldg(reinterpret_cast<const float4*>(scores + p));
        u[0] = ordered(v.x);
        u[1] = ordered(v.y);
        u[2] = ordered(v.z);
        u[3] = ordered(v.w);
      } else {
#pragma unroll
        for (int j = 0; j < 4; ++j) u[j] = p + j < visible ? row_key(p + j) : 0u;
      }
      return p;
    };
    unsigned threshold = 0;
    int equal_taken = 0;
    if (!all) {
      unsigned k = static_cast<unsigned>(chosen), bin = 0;
      for (int b = threadIdx.x; b < kHeadBins; b += T) hist[b] = 0;
      __syncthreads();
      for_each_score<T, true>(scores, 0, cached, [](int64_t p, float score) {
        const unsigned u = ordered(score);
        cache[p] = u;
        atomicAdd(&hist[u >> (32 - kHeadBits)], 1u);
      });
      for_each_score<T, false>(scores, cached, visible, [](int64_t, float score) {
        atomicAdd(&hist[ordered(score) >> (32 - kHeadBits)], 1u);
      });
      __syncthreads();
      threshold_bin<T>(hist, kHeadBins, k, bin, scan_shared, found);
      unsigned prefix = bin << (32 - kHeadBits), mask = ~0u << (32 - kHeadBits);
      if (threadIdx.x == 0) candidate_count = 0;
      __syncthreads();
      // The threshold bin's keys to the candidates, and `hits` marked where a key is at or above it.
      // A warp appends only where one of its keys is in the bin, few of them but where scores tie.
      // Long rows load kBatch groups before their uses: the warps over the uncached end of the row
      // wait on L2 once a batch (one CTA a multiprocessor hides little).
      constexpr int kBatch = T >= 1024 ? 4 : 1;
      for (int g = 0, group = lane % groups; g < groups; g += kBatch) {
        unsigned u[kBatch][4];
        int p[kBatch], visited[kBatch];
#pragma unroll
        for (int b = 0; b < kBatch; ++b) {
          visited[b] = group;
          p[b] = visible;  // no key, past the thread's groups
          if (g + b < groups) p[b] = group_keys(group, u[b]);
          group = group + 1 == groups ? 0 : group + 1;
        }
#pragma unroll
        for (int b = 0; b < kBatch; ++b) {
          bool in[4], any = false, reached = false;
#pragma unroll
          for (int j = 0; j < 4; ++j) {
            in[j] = p[b] + j < visible && (u[b][j] & mask) == prefix;
            any = any || in[j];
            reached = reached || (p[b] + j < visible && u[b][j] >= prefix);
          }
          if (reached) hits |= uint64_t{1} << (visited[b] >> hit_shift);
          if (!__any_sync(kFull, any)) continue;
#pragma unroll
          for (int j = 0; j < 4; ++j) {
            const unsigned ballot = __ballot_sync(kFull, in[j]);
            if (ballot == 0) continue;
            unsigned first = 0;
            if (lane == __ffs(ballot) - 1) first = atomicAdd(&candidate_count, __popc(ballot));
            first = __shfl_sync(kFull, first, __ffs(ballot) - 1);
            const unsigned slot = first + __popc(ballot & ((1u << lane) - 1u));
            if (in[j] && slot < kCandidates) candidates[slot] = u[b][j];
          }
        }
      }
      __syncthreads();
      const unsigned count = candidate_count;
      for (int shift = 32 - kHeadBits - kTailBits; shift >= 0; shift -= kTailBits) {
        if (count <= kCandidates)
          histogram_pass<T>([&](int64_t i) { return candidates[i]; }, count, mask, prefix, shift, kTailBins,
                            hist);
        else
          histogram_pass<T>(row_key, visible, mask, prefix, shift, kTailBins, hist);
        threshold_bin<T>(hist, kTailBins, k, bin, scan_shared, found);
        prefix |= bin << shift;
        mask |= static_cast<unsigned>(kTailBins - 1) << shift;
      }
      threshold = prefix;
      equal_taken = static_cast<int>(k);
    }
    // In pool order: every key above the threshold and the first equal_taken equal to it. The
    // thread's pools taken, in order, are in its marked groups: f(p, u) for each of their keys.
    const auto for_each_marked = [&](auto f) {
      for (uint64_t rest = hits; rest != 0; rest &= rest - 1u) {
        const int bit = __ffsll(static_cast<long long>(rest)) - 1;
        for (int group = bit << hit_shift; group < min(groups, (bit + 1) << hit_shift); ++group) {
          unsigned u[4];
          const int p = group_keys(group, u);
#pragma unroll
          for (int j = 0; j < 4; ++j)
            if (p + j < visible) f(p + j, u[j]);
        }
      }
    };
    const auto is_above = [&](unsigned u) { return all || u > threshold; };
    const auto is_equal = [&](unsigned u) { return !all && u == threshold; };
    int above = 0, equal = 0;
    for_each_marked([&](int, unsigned u) {
      above += is_above(u) ? 1 : 0;
      equal += is_equal(u) ? 1 : 0;
    });
    int total = 0;
    int above_before = block_exclusive_scan<T>(above, scan_shared, total);
    int equal_before = block_exclusive_scan<T>(equal, scan_shared, total);
    if (above > 0 || (equal > 0 && equal_before < equal_taken)) {
      const auto take = [&](int position, int pool) {
        for (int64_t j = 0; j < kp; ++j) out[position * kp + j] = static_cast<int32_t>(pool * kp + j);
      };
      for_each_marked([&](int p, unsigned u) {
        if (is_above(u)) {
          take(above_before + min(equal_taken, equal_before), p);
          ++above_before;
        } else if (is_equal(u)) {
          if (equal_before < equal_taken) take(above_before + equal_before, p);
          ++equal_before;
        }
      });
    }
  }
  if (select_tail && kp > 1) {
    const int64_t tail = (t + 1) % kp;
    for (int64_t j = threadIdx.x; j < tail; j += T) out[topk + j] = static_cast<int32_t>(t + 1 - tail + j);
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

void indexer_topk(const cpu::IndexerShape& s, const float* scores, int64_t first, int64_t rows,
                  int32_t* selected, cudaStream_t stream) {
  check(first >= s.first_query && rows >= 0 && first + rows <= s.tokens && rows < (int64_t{1} << 31),
        "indexer_topk: queries ", first, " + ", rows, " outside ", s.first_query, " .. ", s.tokens,
        " or too many for one launch");
  if (rows == 0) return;
  const int64_t pools = s.complete_pools(), longest = std::min(pools, (first + rows) / s.kpool);
  check(longest < (int64_t{1} << 31) - 4 * kLongThreads, "indexer_topk: rows of ", longest,
        " pools are too long");
  const unsigned grid = static_cast<unsigned>(rows);
  const int tail = s.select_tail ? 1 : 0;
  if (longest <= kShortRow) {
    indexer_topk_kernel<kShortThreads><<<grid, kShortThreads, 0, stream>>>(
        scores, selected, first, s.first_query, pools, s.kpool, s.topk, s.width(), tail, 0);
  } else {
    // The limit raised to the largest cache (past the default 48 KiB with the static shared memory);
    // a launch takes what its longest row needs.
    allow_shared_memory(indexer_topk_kernel<kLongThreads>, kCachedKeys * sizeof(unsigned),
                        "indexer_topk_kernel");
    const int64_t cache_keys = std::min(longest, kCachedKeys);
    const size_t bytes = static_cast<size_t>(cache_keys) * sizeof(unsigned);
    indexer_topk_kernel<kLongThreads><<<grid, kLongThreads, bytes, stream>>>(
        scores, selected, first, s.first_query, pools, s.kpool, s.topk, s.width(), tail, cache_keys);
  }
  SPINDLE_LAUNCHED("indexer_topk_kernel");
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
    indexer_scores(s, q, pool_keys, head_weights, t0, rows, workspace, stream);
    indexer_topk(s, workspace, t0, rows, selected, stream);
  }
}

}  // namespace spindle::cuda
