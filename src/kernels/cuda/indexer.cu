// DSA k-pool indexer: pooling, the scores' tile maxima and the per-query top-k (the scores:
// indexer_scores.cu). See indexer.h for the contract and launch shapes.
#include <algorithm>
#include <cmath>
#include <cstdint>

#include "backend/cuda/check.h"
#include "core/error.h"
#include "kernels/cuda/indexer.h"
#include "kernels/cuda/indexer_keys.cuh"
#include "kernels/cuda/launch.cuh"
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
  wait_for_earlier_kernels();
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

// One warp per (row, tile) of indexer_tiles: the largest key of the row's visible pools in the
// tile, 0 where it has none.
__global__ void indexer_tile_maxima_kernel(const float* __restrict__ scores, unsigned* __restrict__ maxima,
                                           int64_t first, int64_t rows, int64_t pools, int64_t kp,
                                           int64_t tiles) {
  wait_for_earlier_kernels();
  const int64_t w = (static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x) / 32;
  if (w >= rows * tiles) return;  // whole warps
  const int64_t r = w / tiles, j = w % tiles;
  const int64_t end = min(min(pools, (first + r + 1) / kp), (j + 1) * kIndexerTilePools);
  unsigned m = 0;
  for (int64_t p = j * kIndexerTilePools + threadIdx.x % 32; p < end; p += 32)
    m = max(m, ordered_key(scores[r * pools + p]));
  m = __reduce_max_sync(kFull, m);
  if (threadIdx.x % 32 == 0) maxima[w] = m;
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

// The two launch shapes of the radix select, by the launch's longest row (longer rows with the tile
// maxima: select_from_maxima's shape instead). Up to kShortRow pools: kShortThreads a CTA,
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
// loads over the 16-byte aligned middle, kBatch of them a thread issued before their uses (by
// default 2 within the short rows' 40 registers). kStreaming loads are marked evict-first in L2,
// for scores that are not read from global memory again.
template <int T, bool kStreaming, int kBatch = (T >= 1024 ? 4 : 2), class F>
__device__ __forceinline__ void for_each_score(const float* __restrict__ row, int64_t begin, int64_t end,
                                               F f) {
  if (begin >= end) return;
  const int64_t misaligned = static_cast<int64_t>((reinterpret_cast<uintptr_t>(row + begin) / 4) % 4);
  const int64_t head = min(end, begin + (4 - misaligned) % 4);
  for (int64_t p = begin + threadIdx.x; p < head; p += T) f(p, row[p]);
  const float4* body = reinterpret_cast<const float4*>(row + head);
  const int64_t vectors = (end - head) / 4;
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

// The k-th largest (k >= 1, at most n) of the n keys key(i): the three radix passes over them. k
// ends as that key's rank among the keys equal to it, counted from the top. Every thread calls it;
// it ends with a barrier.
template <int T, class Key>
__device__ unsigned radix_threshold(Key key, int64_t n, unsigned& k, unsigned* hist, int* scan_shared,
                                    unsigned* found) {
  unsigned bin = 0;
  histogram_pass<T>(key, n, 0u, 0u, 32 - kHeadBits, kHeadBins, hist);
  threshold_bin<T>(hist, kHeadBins, k, bin, scan_shared, found);
  unsigned prefix = bin << (32 - kHeadBits), mask = ~0u << (32 - kHeadBits);
  for (int shift = 32 - kHeadBits - kTailBits; shift >= 0; shift -= kTailBits) {
    histogram_pass<T>(key, n, mask, prefix, shift, kTailBins, hist);
    threshold_bin<T>(hist, kTailBins, k, bin, scan_shared, found);
    prefix |= bin << shift;
    mask |= static_cast<unsigned>(kTailBins - 1) << shift;
  }
  return prefix;
}

// The selection from the tile maxima (indexer.h) of rows with at least kMaximaTilesPerChosen tiles
// per chosen pool and at most kMaximaChosen chosen. tau, the chosen-th largest tile maximum, is a
// score of the row's chosen-th largest or below (the chosen largest maxima are chosen pools' keys),
// so the pools the rule takes are among those with a key >= tau: for independent scores about
// chosen * (1 + ln(tiles / chosen)) of them. One read of the row collects them (keys and pools) in
// shared memory, where the radix select finds the threshold among them.
constexpr int kMaximaTilesPerChosen = 2, kMaximaChosen = 256;
// Its launch shape, for every row of a launch of rows longer than kShortRow given the maxima (the
// shorter rows' launches keep the short shape: their rows have too few tiles): kShortThreads a CTA,
// kMaximaBlocks CTAs a multiprocessor (64 registers; six CTAs of the short shape's 40 spill),
// kMaximaBatch 16-byte loads a thread in flight (64 KiB a multiprocessor), and no cache: rows read
// once need none, and several CTAs a multiprocessor overlap a row's fixed work (six radix passes
// over a few thousand keys) with the others' reads. Its rows that overflow take the radix select
// without the cache.
constexpr int kMaximaBlocks = 4, kMaximaBatch = 4;
// Candidates held (keys, then pools, in the radix select's candidates), and keys equal to the
// threshold ranked by pool (quadratic in their count); more of either: the radix select instead.
constexpr int kMaximaHeld = kCandidates / 2, kMaximaTies = 256;
static_assert(kMaximaTies + kMaximaChosen <= kHeadBins, "the ties and the taken pools fit the histogram");

// The top `chosen` of the row's `visible` scores from its tile maxima, written as the radix select
// writes them (ties to the lower pool, in pool order, expanded to kp tokens), or false, having
// written nothing, where its candidates or ties at the threshold are more than shared memory holds.
// The shared memory is the radix select's. Every thread calls it; it ends with a barrier where it
// returns false.
template <int T>
__device__ bool select_from_maxima(const float* __restrict__ scores, const unsigned* __restrict__ row_maxima,
                                   int visible, int chosen, int64_t kp, int32_t* out, unsigned* hist,
                                   unsigned* candidates, unsigned* found, int* scan_shared, unsigned* count) {
  const int tiles = static_cast<int>((visible + kIndexerTilePools - 1) / kIndexerTilePools);
  unsigned k = static_cast<unsigned>(chosen);
  const unsigned tau = radix_threshold<T>([row_maxima](int64_t j) { return __ldg(row_maxima + j); }, tiles, k,
                                          hist, scan_shared, found);
  if (threadIdx.x == 0) *count = 0;
  __syncthreads();
  unsigned *keys = candidates, *pools = candidates + kMaximaHeld;
  for_each_score<T, true, kMaximaBatch>(scores, 0, visible, [&](int64_t p, float score) {
    const unsigned u = ordered_key(score);
    if (u >= tau) {
      const unsigned slot = atomicAdd(count, 1u);
      if (slot < kMaximaHeld) {
        keys[slot] = u;
        pools[slot] = static_cast<unsigned>(p);
      }
    }
  });
  __syncthreads();
  const unsigned held = *count;
  __syncthreads();  // read by every thread before the radix select resets it
  if (held > kMaximaHeld) return false;

  // The threshold among the candidates (every pool the rule takes is one) and how many of the keys
  // equal to it to take; then the pools taken, unordered, in hist[kMaximaTies ..]: those above the
  // threshold, and the equal ones whose pool has fewer than equal_taken equal ones below it.
  k = static_cast<unsigned>(chosen);
  const unsigned threshold =
      radix_threshold<T>([keys](int64_t i) { return keys[i]; }, held, k, hist, scan_shared, found);
  const unsigned equal_taken = k;
  unsigned *ties = hist, *taken = hist + kMaximaTies;
  if (threadIdx.x == 0) found[0] = found[1] = 0;  // ties, taken
  __syncthreads();
  for (unsigned i = threadIdx.x; i < held; i += T) {
    const unsigned u = keys[i];
    if (u > threshold) {
      taken[atomicAdd(&found[1], 1u)] = pools[i];
    } else if (u == threshold) {
      const unsigned slot = atomicAdd(&found[0], 1u);
      if (slot < kMaximaTies) ties[slot] = pools[i];
    }
  }
  __syncthreads();
  const unsigned tied = found[0];
  if (tied > kMaximaTies) {
    __syncthreads();  // found read by every thread
    return false;
  }
  for (unsigned i = threadIdx.x; i < tied; i += T) {
    unsigned below = 0;
    for (unsigned j = 0; j < tied; ++j) below += ties[j] < ties[i] ? 1u : 0u;
    if (below < equal_taken) taken[atomicAdd(&found[1], 1u)] = ties[i];
  }
  __syncthreads();
  // The chosen pools taken, each written at its rank among them.
  for (int i = threadIdx.x; i < chosen; i += T) {
    const unsigned pool = taken[i];
    int position = 0;
    for (int j = 0; j < chosen; ++j) position += taken[j] < pool ? 1 : 0;
    for (int64_t j = 0; j < kp; ++j) out[position * kp + j] = static_cast<int32_t>(pool * kp + j);
  }
  return true;
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
//
// kMaxima: the launch has the rows' tile maxima (row blockIdx.x at maxima + blockIdx.x * tiles), and
// the rows select_from_maxima takes are read once instead.
template <int T, bool kMaxima>
__global__ void __launch_bounds__(T, kMaxima ? kMaximaBlocks : kShortThreads* kShortBlocks / T)
    indexer_topk_kernel(const float* __restrict__ workspace, int32_t* __restrict__ selected, int64_t t0,
                        int64_t first_query, int64_t pools, int64_t kp, int64_t topk, int64_t width,
                        int select_tail, int64_t cache_keys, const unsigned* __restrict__ maxima,
                        int64_t tiles) {
  wait_for_earlier_kernels();
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
  const bool from_maxima =
      kMaxima && chosen < visible && chosen <= kMaximaChosen &&
      (visible + kIndexerTilePools - 1) / kIndexerTilePools >= int64_t{kMaximaTilesPerChosen} * chosen;
  if (chosen > 0 &&
      !(from_maxima &&
        select_from_maxima<T>(scores, maxima + static_cast<int64_t>(blockIdx.x) * tiles, visible, chosen, kp,
                              out, hist, candidates, found, scan_shared, &candidate_count))) {
    // The threshold: the chosen-th largest key, and how many of the keys equal to it to take.
    const bool all = chosen == visible;
    // Keys below `cached` are in the cache once the first pass has run (it does not when all).
    const int cached = all ? 0 : static_cast<int>(min(int64_t{visible}, cache_keys));
    const auto row_key = [scores, cached](int p) { return p < cached ? cache[p] : ordered_key(scores[p]); };
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
        u[0] = ordered_key(v.x);
        u[1] = ordered_key(v.y);
        u[2] = ordered_key(v.z);
        u[3] = ordered_key(v.w);
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
        const unsigned u = ordered_key(score);
        cache[p] = u;
        atomicAdd(&hist[u >> (32 - kHeadBits)], 1u);
      });
      for_each_score<T, false>(scores, cached, visible, [](int64_t, float score) {
        atomicAdd(&hist[ordered_key(score) >> (32 - kHeadBits)], 1u);
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
  launch_kernel(indexer_pool_keys_kernel, static_cast<unsigned>(blocks), kThreads, 0, stream, keys, gate, ape,
                pool_keys, s.complete_pools(), s.head_dim, s.kpool);
  SPINDLE_LAUNCHED("indexer_pool_keys_kernel");
}

void indexer_tile_maxima(const cpu::IndexerShape& s, const float* scores, int64_t first, int64_t rows,
                         unsigned* maxima, cudaStream_t stream) {
  check(first >= s.first_query && rows >= 0 && first + rows <= s.tokens, "indexer_tile_maxima: queries ",
        first, " + ", rows, " outside ", s.first_query, " .. ", s.tokens);
  const int64_t tiles = indexer_tiles(s), warps = rows * tiles;
  if (warps == 0) return;
  const int64_t blocks = (warps + kThreads / 32 - 1) / (kThreads / 32);
  check(blocks < (int64_t{1} << 31), "indexer_tile_maxima: ", warps, " tiles are too many for one launch");
  launch_kernel(indexer_tile_maxima_kernel, static_cast<unsigned>(blocks), kThreads, 0, stream, scores,
                maxima, first, rows, s.complete_pools(), s.kpool, tiles);
  SPINDLE_LAUNCHED("indexer_tile_maxima_kernel");
}

void indexer_topk(const cpu::IndexerShape& s, const float* scores, const unsigned* maxima, int64_t first,
                  int64_t rows, int32_t* selected, cudaStream_t stream) {
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
    launch_kernel(indexer_topk_kernel<kShortThreads, false>, grid, kShortThreads, 0, stream, scores, selected,
                  first, s.first_query, pools, s.kpool, s.topk, s.width(), tail, 0, nullptr, 0);
  } else if (maxima != nullptr) {
    launch_kernel(indexer_topk_kernel<kShortThreads, true>, grid, kShortThreads, 0, stream, scores, selected,
                  first, s.first_query, pools, s.kpool, s.topk, s.width(), tail, 0, maxima, indexer_tiles(s));
  } else {
    // The limit raised to the largest cache (past the default 48 KiB with the static shared memory);
    // a launch takes what its longest row needs.
    allow_shared_memory(indexer_topk_kernel<kLongThreads, false>, kCachedKeys * sizeof(unsigned),
                        "indexer_topk_kernel");
    const int64_t cache_keys = std::min(longest, kCachedKeys);
    const size_t bytes = static_cast<size_t>(cache_keys) * sizeof(unsigned);
    launch_kernel(indexer_topk_kernel<kLongThreads, false>, grid, kLongThreads, bytes, stream, scores,
                  selected, first, s.first_query, pools, s.kpool, s.topk, s.width(), tail, cache_keys,
                  nullptr, 0);
  }
  SPINDLE_LAUNCHED("indexer_topk_kernel");
}

int64_t indexer_tiles(const cpu::IndexerShape& s) {
  return (s.complete_pools() + kIndexerTilePools - 1) / kIndexerTilePools;
}

size_t indexer_select_workspace_bytes(const cpu::IndexerShape& s, int64_t query_block) {
  return static_cast<size_t>(query_block) * static_cast<size_t>(s.complete_pools() + indexer_tiles(s)) * 4;
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
  const size_t row_bytes = std::max<size_t>(indexer_select_workspace_bytes(s, 1), 1);
  const int64_t block = std::min<int64_t>(s.queries(), static_cast<int64_t>(workspace_bytes / row_bytes));
  check(block >= 1 || pools == 0, "indexer_select: the workspace (", workspace_bytes,
        " bytes) holds no query row of ", pools, " pooled scores and their tile maxima (", row_bytes,
        " bytes)");
  const int64_t query_block = pools == 0 ? s.queries() : block;
  // The block's scores, then its tile maxima.
  unsigned* maxima = reinterpret_cast<unsigned*>(workspace + query_block * pools);
  for (int64_t t0 = s.first_query; t0 < s.tokens; t0 += query_block) {
    const int64_t rows = std::min(query_block, s.tokens - t0);
    indexer_scores(s, q, pool_keys, head_weights, t0, rows, workspace, maxima, stream);
    indexer_topk(s, workspace, maxima, t0, rows, selected, stream);
  }
}

}  // namespace spindle::cuda
