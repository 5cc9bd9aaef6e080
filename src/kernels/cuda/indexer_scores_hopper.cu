// The indexer's pool scores on wgmma; see indexer_scores_hopper.h for the design.
#include <algorithm>
#include <cmath>

#include "backend/cuda/check.h"
#include "core/error.h"
#include "kernels/cuda/indexer.h"
#include "kernels/cuda/indexer_keys.cuh"
#include "kernels/cuda/indexer_scores_hopper.h"
#include "kernels/cuda/launch.cuh"
#include "kernels/cuda/mma.cuh"
#include "kernels/cuda/shared_memory_limit.h"
#include "kernels/cuda/wave_splits.h"
#include "kernels/cuda/wgmma.cuh"

namespace spindle::cuda {

namespace {

constexpr int kGroups = 2, kThreads = 128 * kGroups;
constexpr int kGroupQueries = 8, kQueries = kGroups * kGroupQueries;
constexpr int kSlots = 32;  // head slots per query
constexpr int kPools = 64;  // pools per tile: M
static_assert(kPools == kIndexerTilePools, "a CTA's tile is a tile of the maxima");
// A warpgroup multiplies its queries in two halves, N = 4 x 32 = 128 each, so that the first
// half's epilogue runs while the second half's products do.
constexpr int kHalfQueries = kGroupQueries / 2, kHalfColumns = kHalfQueries * kSlots;
// A ring of 4 key tiles, loaded 2 tiles ahead (measured faster than 3 ahead, and than a ring of 3).
constexpr int kStages = 4, kAhead = 2;
// A CTA's start in tile-times (its q, 8 tiles' bytes, and the ring's first tiles loaded; a tile's
// products take about 2 us a multiprocessor): an estimate, for wave_filling_splits.
constexpr int64_t kSetupTiles = 4;
static_assert(kAhead < kStages, "a stage is reloaded only after the barrier that follows its last read");

struct Args {
  const __nv_bfloat16* q;
  const __nv_bfloat16* pool_keys;
  const __nv_bfloat16* head_weights;
  float* scores;
  unsigned* maxima;  // null: none written
  int64_t first, rows, pools, kpool, first_query, tiles;
  int heads;
  float scale;
};

// Byte offsets into the dynamic shared memory.
struct Layout {
  uint32_t q_bytes;     // one warpgroup's q, [256][head_dim] bf16
  uint32_t tile_bytes;  // one key tile, [64][head_dim] bf16
  uint32_t keys, weights, total;
};

__host__ __device__ constexpr Layout layout(int head_dim) {
  Layout l{};
  l.q_bytes = static_cast<uint32_t>(kGroupQueries * kSlots * head_dim * 2);
  l.tile_bytes = static_cast<uint32_t>(kPools * head_dim * 2);
  l.keys = kGroups * l.q_bytes;
  l.weights = l.keys + kStages * l.tile_bytes;
  l.total = l.weights + kQueries * kSlots * 4;
  return l;
}

template <int KSteps>
__global__ void __launch_bounds__(kThreads, 1) indexer_scores_hopper_kernel(const Args a) {
  wait_for_earlier_kernels();
  extern __shared__ __align__(128) unsigned char shared[];
  constexpr int kDim = 16 * KSteps, kChunks = kDim / 8;
  constexpr Layout L = layout(kDim);
  // Through a shuffle, so that the compiler sees them uniform and does not serialise the wgmma.
  const int group = __shfl_sync(0xffffffffu, threadIdx.x / 128, 0),
            warp = __shfl_sync(0xffffffffu, threadIdx.x % 128 / 32, 0);
  const int tid = threadIdx.x, lane = tid % 32, c = lane % 4;

  const int64_t q0 = static_cast<int64_t>(blockIdx.x) * kQueries;  // the CTA's first row, < rows
  const int64_t last = min(a.rows, q0 + kQueries) - 1;
  const int64_t visible = min(a.pools, (a.first + last + 1) / a.kpool);
  const int64_t tiles = (visible + kPools - 1) / kPools;
  const int64_t mine = (tiles - blockIdx.y + gridDim.y - 1) / gridDim.y;  // tiles blockIdx.y + i gridDim.y
  if (static_cast<int64_t>(blockIdx.y) >= tiles) return;
  const int64_t offset = a.first - a.first_query;  // q's row of block row 0
  // The pools visible to this thread's query in each half (the store's row).
  int64_t row_visible[2];
#pragma unroll
  for (int half = 0; half < 2; ++half)
    row_visible[half] =
        min(a.pools, (a.first + q0 + kGroupQueries * group + kHalfQueries * half + c + 1) / a.kpool);

  // q as 512 rows (query 16 g + row / 32 of warpgroup g's 256, head row % 32), core-matrix layout:
  // 16-byte unit u lands at byte 16 u. Zero past the last head and row.
  for (int u = tid; u < kQueries * kSlots * kChunks; u += kThreads) {
    const int row = u / (8 * kChunks) * 8 + u % 8, chunk = u / 8 % kChunks;
    const int query = row / kSlots, head = row % kSlots;
    const bool valid = head < a.heads && q0 + query < a.rows;
    const __nv_bfloat16* from =
        valid ? a.q + ((offset + q0 + query) * a.heads + head) * kDim + chunk * 8 : a.q;
    copy16(shared + u * 16, from, valid);
  }
  // [16 queries][32], scale folded in; a query's heads in the order the fold reads them: head 8 jj +
  // 2 c + e at 8 c + 2 jj + e, so that lane c's four pairs are two float4 loads.
  float* weights = reinterpret_cast<float*>(shared + L.weights);
  for (int i = tid; i < kQueries * kSlots; i += kThreads) {
    const int query = i / kSlots, head = i % kSlots;
    const bool valid = head < a.heads && q0 + query < a.rows;
    weights[query * kSlots + head % 8 / 2 * 8 + head / 8 * 2 + head % 2] =
        valid ? a.scale * __bfloat162float(a.head_weights[(offset + q0 + query) * a.heads + head]) : 0.0f;
  }
  unsigned char* keys = shared + L.keys;
  const auto first_pool = [&](int64_t i) { return (blockIdx.y + i * gridDim.y) * kPools; };  // tile i's
  // This thread's 16-byte units of a key tile (u = tid + kThreads j): each one's pool in the tile and
  // element offset from the tile's first key, the same for every tile (the loop's index arithmetic
  // was a fifth of the kernel's instructions when made per tile).
  constexpr int kTileUnits = kPools * kChunks, kUnits = (kTileUnits + kThreads - 1) / kThreads;
  const auto has_unit = [&](int j) { return kTileUnits % kThreads == 0 || tid + kThreads * j < kTileUnits; };
  int unit_pool[kUnits], unit_offset[kUnits];
#pragma unroll
  for (int j = 0; j < kUnits; ++j) {
    const int u = tid + kThreads * j;
    unit_pool[j] = u / (8 * kChunks) * 8 + u % 8;
    unit_offset[j] = unit_pool[j] * kDim + u / 8 % kChunks * 8;
  }
  const auto load_keys = [&](int64_t i) {  // the CTA's i-th tile into stage i % 4, zero past the last pool
    unsigned char* dst = keys + (i % kStages) * L.tile_bytes + tid * 16;
    const int64_t p0 = first_pool(i);
    const __nv_bfloat16* tile = a.pool_keys + p0 * kDim;
    const int64_t left = a.pools - p0;  // pools of the tile that exist: unit_pool < left
#pragma unroll
    for (int j = 0; j < kUnits; ++j) {
      const bool valid = unit_pool[j] < left;
      if (has_unit(j)) copy16(dst + kThreads * 16 * j, valid ? tile + unit_offset[j] : a.pool_keys, valid);
    }
  };
  // kAhead commit groups, possibly empty, so that the count stays uniform: q and the first tile,
  // then the next tiles.
#pragma unroll
  for (int i = 0; i < kAhead; ++i) {
    if (i < mine) load_keys(i);
    copy_commit();
  }

  constexpr uint32_t kGroupBytes = kDim * 16;  // between 8-row groups
  // The descriptors of stage 0's key tile and of the warpgroup's two halves of q (kHalfColumns rows,
  // groups of 8, each), made once: a stage or a k-step of 16 (256 bytes) moves them
  // (wgmma_descriptor_plus).
  const uint64_t keys_descriptor = wgmma_descriptor(shared_address(keys), 128, kGroupBytes);
  const uint32_t q_address = shared_address(shared) + group * L.q_bytes;
  const uint64_t q_descriptor[2] = {wgmma_descriptor(q_address, 128, kGroupBytes),
                                    wgmma_descriptor(q_address + kHalfColumns / 8 * kGroupBytes, 128, kGroupBytes)};
  const float4* group_weights = reinterpret_cast<const float4*>(weights) + group * kGroupQueries * kSlots / 4;
  // scores^T [64 pools, 4 queries x 32 heads] = K Q^T over head_dim for one half, asynchronous.
  const auto issue = [&](float(&acc)[kHalfColumns / 2], int64_t i, int half) {
    const uint64_t tile = wgmma_descriptor_plus(keys_descriptor, static_cast<uint32_t>(i % kStages) * L.tile_bytes);
#pragma unroll
    for (int j = 0; j < kHalfColumns / 2; ++j) wgmma_hold(acc[j]);
    wgmma_fence();
#pragma unroll
    for (int k = 0; k < KSteps; ++k)
      wgmma_m64n128k16(acc, wgmma_descriptor_plus(tile, 256 * k), wgmma_descriptor_plus(q_descriptor[half], 256 * k),
                       k > 0);
    wgmma_commit();
  };
  // The scores of a finished half (tile i): per pool row (16 warp + lane / 4 + 8 h) and query, its
  // heads 8 jj + 2 c + e of this thread, relu times weight in explicit FMAs (one rounding path for
  // every pool), then added across the 4 lanes of the row.
  const auto store = [&](float(&acc)[kHalfColumns / 2], int64_t i, int half) {
#pragma unroll
    for (int j = 0; j < kHalfColumns / 2; ++j) wgmma_hold(acc[j]);
    float part[2 * kHalfQueries];  // [h][query]
#pragma unroll
    for (int query = 0; query < kHalfQueries; ++query) {
      float s0 = 0.0f, s1 = 0.0f;
      const float4* lane_weights = group_weights + ((kHalfQueries * half + query) * kSlots + 8 * c) / 4;
      const float4 w01 = lane_weights[0], w23 = lane_weights[1];
#pragma unroll
      for (int jj = 0; jj < 4; ++jj) {
        const float2 w = jj == 0 ? make_float2(w01.x, w01.y)
                         : jj == 1 ? make_float2(w01.z, w01.w)
                         : jj == 2 ? make_float2(w23.x, w23.y)
                                   : make_float2(w23.z, w23.w);
        const float* d = acc + 4 * (4 * query + jj);
        s0 = __fmaf_rn(w.x, fmaxf(d[0], 0.0f), s0);
        s0 = __fmaf_rn(w.y, fmaxf(d[1], 0.0f), s0);
        s1 = __fmaf_rn(w.x, fmaxf(d[2], 0.0f), s1);
        s1 = __fmaf_rn(w.y, fmaxf(d[3], 0.0f), s1);
      }
      part[query] = s0;
      part[kHalfQueries + query] = s1;
    }
    // Two butterfly steps: lane c ends with the sums f = 4 m + c, query c of pool row h = m.
    const bool b0 = (c & 1) != 0, b1 = (c & 2) != 0;
    float pair[kHalfQueries], sum[2];
#pragma unroll
    for (int k = 0; k < kHalfQueries; ++k) {
      const float send = b0 ? part[2 * k] : part[2 * k + 1], keep = b0 ? part[2 * k + 1] : part[2 * k];
      pair[k] = keep + __shfl_xor_sync(0xffffffffu, send, 1);
    }
#pragma unroll
    for (int m = 0; m < 2; ++m) {
      const float send = b1 ? pair[2 * m] : pair[2 * m + 1], keep = b1 ? pair[2 * m + 1] : pair[2 * m];
      sum[m] = keep + __shfl_xor_sync(0xffffffffu, send, 2);
    }
    // A warp's store covers 8 consecutive pools of 4 queries: whole 32-byte sectors.
    const int64_t row = q0 + kGroupQueries * group + kHalfQueries * half + c;
    const int64_t pool = first_pool(i) + 16 * warp + lane / 4;
#pragma unroll
    for (int m = 0; m < 2; ++m)
      if (row < a.rows && pool + 8 * m < a.pools) a.scores[row * a.pools + pool + 8 * m] = sum[m];
    if (a.maxima != nullptr) {
      // The warp's 16 pools of the row: its lanes c, c + 4, .. and their two pools each.
      unsigned key = 0;
#pragma unroll
      for (int m = 0; m < 2; ++m)
        if (pool + 8 * m < row_visible[half]) key = max(key, ordered_key(sum[m]));
#pragma unroll
      for (int step = 4; step < 32; step *= 2) key = max(key, __shfl_xor_sync(0xffffffffu, key, step));
      if (lane < 4 && row < a.rows && key != 0)
        atomicMax(a.maxima + row * a.tiles + first_pool(i) / kPools, key);
    }
  };

  // Both halves' products are queued at once; the first half's scores are folded and stored while
  // the second's products run (their wgmma groups complete in order).
  float acc0[kHalfColumns / 2] = {}, acc1[kHalfColumns / 2] = {};
  for (int64_t i = 0; i < mine; ++i) {
    copy_wait<kAhead - 1>();  // tile i (and q) landed for this thread
    fence_async_shared();
    __syncthreads();  // ... for every thread; stage (i + 2) % 4 was last read for tile i - 2
    if (i + kAhead < mine) load_keys(i + kAhead);
    copy_commit();  // possibly empty: the group count stays uniform
    issue(acc0, i, 0);
    issue(acc1, i, 1);
    wgmma_wait<1>();
    store(acc0, i, 0);
    wgmma_wait<0>();
    store(acc1, i, 1);
  }
}

}  // namespace

bool indexer_scores_hopper_takes(const cpu::IndexerShape& s) {
  return s.heads > 16 && s.heads <= kSlots && s.head_dim >= 16 && s.head_dim <= 128 && s.head_dim % 16 == 0 &&
         s.kpool > 0;
}

void indexer_scores_hopper(const cpu::IndexerShape& s, const __nv_bfloat16* q, const __nv_bfloat16* pool_keys,
                           const __nv_bfloat16* head_weights, int64_t first, int64_t rows, float* scores,
                           unsigned* maxima, cudaStream_t stream) {
  check(indexer_scores_hopper_takes(s), "indexer scores on wgmma: heads 17..", kSlots,
        " and head_dim a multiple of 16 up to 128, got heads ", s.heads, ", head_dim ", s.head_dim);
  check(reinterpret_cast<uintptr_t>(q) % 16 == 0 && reinterpret_cast<uintptr_t>(pool_keys) % 16 == 0,
        "indexer scores on wgmma: q and pool_keys must be 16-byte aligned (cp.async)");
  const int64_t pools = s.complete_pools();
  if (rows == 0 || pools == 0) return;
  const int64_t tiles = indexer_tiles(s);
  if (maxima != nullptr)  // the atomic maxima's start, below every key
    SPINDLE_CUDA(cudaMemsetAsync(maxima, 0, static_cast<size_t>(rows * tiles) * sizeof(unsigned), stream));
  int device = 0, sms = 0;
  SPINDLE_CUDA(cudaGetDevice(&device));
  SPINDLE_CUDA(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device));
  const int64_t query_tiles = (rows + kQueries - 1) / kQueries;
  check(query_tiles < (int64_t{1} << 31), "indexer scores on wgmma: ", rows,
        " queries are too many for one launch");
  // The pool tiles split over blockIdx.y so that the CTAs (one a multiprocessor) fill their waves.
  const int64_t most_tiles = (std::min(pools, (first + rows) / s.kpool) + kPools - 1) / kPools;
  const int64_t splits = wave_filling_splits(query_tiles, std::max<int64_t>(most_tiles, 1), sms, kSetupTiles);
  Args args{};
  args.q = q;
  args.pool_keys = pool_keys;
  args.head_weights = head_weights;
  args.scores = scores;
  args.maxima = maxima;
  args.tiles = tiles;
  args.first = first;
  args.rows = rows;
  args.pools = pools;
  args.kpool = s.kpool;
  args.first_query = s.first_query;
  args.heads = static_cast<int>(s.heads);
  args.scale = 1.0f / std::sqrt(static_cast<float>(s.head_dim));
  const size_t shared_bytes = layout(static_cast<int>(s.head_dim)).total;
  const dim3 grid(static_cast<unsigned>(query_tiles), static_cast<unsigned>(splits));
  const auto run = [&](auto kernel) {
    allow_shared_memory(kernel, shared_bytes, "indexer scores on wgmma: head_dim ", s.head_dim);
    launch_kernel(kernel, grid, kThreads, shared_bytes, stream, args);
    SPINDLE_LAUNCHED("indexer_scores_hopper_kernel");
  };
  switch (s.head_dim / 16) {
    case 1:
      return run(indexer_scores_hopper_kernel<1>);
    case 2:
      return run(indexer_scores_hopper_kernel<2>);
    case 3:
      return run(indexer_scores_hopper_kernel<3>);
    case 4:
      return run(indexer_scores_hopper_kernel<4>);
    case 5:
      return run(indexer_scores_hopper_kernel<5>);
    case 6:
      return run(indexer_scores_hopper_kernel<6>);
    case 7:
      return run(indexer_scores_hopper_kernel<7>);
    default:
      return run(indexer_scores_hopper_kernel<8>);
  }
}

}  // namespace spindle::cuda
