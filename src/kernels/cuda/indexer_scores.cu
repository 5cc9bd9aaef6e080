// The indexer's pool scores on the tensor cores (mma.sync m16n8k16, bf16 in, fp32 accumulate).
// See indexer.h for the contract, the tiles and the launch shape; indexer_scores hands the shapes
// the wgmma scorer takes (indexer_scores_hopper.h) to it.
#include <algorithm>
#include <cmath>

#include "backend/cuda/check.h"
#include "core/error.h"
#include "kernels/cuda/indexer.h"
#include "kernels/cuda/indexer_scores_hopper.h"
#include "kernels/cuda/launch.cuh"
#include "kernels/cuda/mma.cuh"
#include "kernels/cuda/shared_memory_limit.h"

namespace spindle::cuda {

namespace {

constexpr int kWarpsM = 4, kWarpsN = 2, kThreads = 32 * kWarpsM * kWarpsN;
constexpr int kWarpMTiles = 4;                     // m16 tiles per warp: 64 rows of q
constexpr int kWarpNTiles = 8;                     // n8 tiles per warp: 64 pools
constexpr int kMTiles = kWarpsM * kWarpMTiles;     // 16 m16 tiles: 256 rows of q per CTA
constexpr int kRows = 16 * kMTiles;                // 256
constexpr int kPools = 8 * kWarpNTiles * kWarpsN;  // 128 pools per tile
// Shared rows are head_dim (rounded up to 16) + 8 bf16 long: an odd number of 16-byte units, so
// the 8 row addresses of an ldmatrix land in 8 distinct groups of 4 banks.
constexpr int kRowPad = 8;
// Partial sums, [slot][8 queries][kPools + 8] floats: the 8 rows of a float2 store (one per
// query g) start 8 banks apart, so a half-warp's 16 float2 cover the 32 banks once.
constexpr int kPartialStride = kPools + 8;
constexpr int kMaxHeads = 2 * kMTiles;  // one group of 8 queries must fit the 16 m16 tiles
constexpr int kMaxHeadDim = 128;        // shared memory: q and two key tiles of 136-wide rows

// The tiling of one launch. Row r of an m16 tile is query (r % 8) of its group of 8 and head
// 2 * pair + r / 8: the two heads of a thread's accumulator rows g and g + 8 belong to one query,
// and the 8 queries of a group sit on the 8 lane groups g, so summing over heads needs no
// shuffles. A group takes group_mtiles m16 tiles (ceil(heads / 2) rounded up to 1, 2, 4 or a
// multiple of 4, so that a warp's 4 m16 tiles hold whole groups or a quarter-aligned part of
// one); the CTA's 16 m16 tiles hold `groups` groups; what is left over is zero.
struct Tiling {
  int kdim;          // head_dim rounded up to 16 (the padding is zero)
  int group_mtiles;  // m16 tiles per group of 8 queries
  int groups;        // groups per CTA: 8 * groups queries
  int segment;       // m16 tiles a thread sums in registers before storing a partial: min(group_mtiles, 4)
  size_t shared_bytes;
};

Tiling tiling(const cpu::IndexerShape& s) {
  Tiling t{};
  t.kdim = static_cast<int>((s.head_dim + 15) / 16 * 16);
  const int pairs = static_cast<int>((s.heads + 1) / 2);
  t.group_mtiles = pairs <= 1 ? 1 : pairs <= 2 ? 2 : pairs <= 4 ? 4 : (pairs + 3) / 4 * 4;
  t.groups = kMTiles / t.group_mtiles;
  t.segment = std::min(t.group_mtiles, kWarpMTiles);
  const size_t row = static_cast<size_t>(t.kdim + kRowPad) * sizeof(__nv_bfloat16);
  t.shared_bytes = kRows * row + 2 * kPools * row + kRows * sizeof(float) +
                   static_cast<size_t>(kMTiles / t.segment) * 8 * kPartialStride * sizeof(float);
  return t;
}

struct ScoreArgs {
  const __nv_bfloat16* q;             // [queries, heads, head_dim], from query first_query on
  const __nv_bfloat16* pool_keys;     // [pools, head_dim]
  const __nv_bfloat16* head_weights;  // [queries, heads]
  float* scores;                      // [rows, pools]
  int64_t first, rows, pools, kpool;  // queries first .. first + rows - 1 (absolute positions)
  int64_t first_query;                // the position of q's first row
  int heads, head_dim, kdim, group_mtiles, groups, segment;
  float scale;
};

// One CTA: 8 * groups queries (all their heads, 256 rows of q in shared memory for the whole
// CTA) against the pool tiles blockIdx.y, blockIdx.y + gridDim.y, ... that its last query sees.
// 8 warps, 4 along the rows x 2 along the pools, each 64 rows x 64 pools of accumulators; the key
// tiles are double-buffered with cp.async.
__global__ void __launch_bounds__(kThreads, 1) indexer_scores_kernel(const ScoreArgs args) {
  wait_for_earlier_kernels();
  extern __shared__ __align__(16) unsigned char shared[];
  const int stride = args.kdim + kRowPad;                            // bf16 per shared row
  __nv_bfloat16* q_s = reinterpret_cast<__nv_bfloat16*>(shared);     // [kRows][stride]
  __nv_bfloat16* k_s = q_s + kRows * stride;                         // [2][kPools][stride]
  float* w_s = reinterpret_cast<float*>(k_s + 2 * kPools * stride);  // [kRows]
  float* partial_s = w_s + kRows;                                    // [kMTiles / segment][8][kPartialStride]

  const int queries = 8 * args.groups;
  const int64_t q0 = static_cast<int64_t>(blockIdx.x) * queries;  // first query of the CTA, < rows
  const int64_t last = min(args.rows, q0 + queries) - 1;
  const int64_t visible = min(args.pools, (args.first + last + 1) / args.kpool);
  const int64_t tiles = (visible + kPools - 1) / kPools;
  if (static_cast<int64_t>(blockIdx.y) >= tiles) return;

  const int tid = threadIdx.x, chunks = args.kdim / 8, real_chunks = args.head_dim / 8;
  // q rows and their head weights, zero where the row is padding (head, group or query past the
  // end) or the column is past head_dim.
  for (int i = tid; i < kRows * chunks; i += kThreads) {
    const int row = i / chunks, chunk = i % chunks, mtile = row / 16;
    const int group = mtile / args.group_mtiles, head = 2 * (mtile % args.group_mtiles) + (row % 16) / 8;
    const int64_t query = q0 + 8 * group + row % 8;
    const bool valid = group < args.groups && head < args.heads && query < args.rows && chunk < real_chunks;
    const __nv_bfloat16* src =
        valid ? args.q + ((args.first - args.first_query + query) * args.heads + head) * args.head_dim +
                    chunk * 8
              : args.q;
    copy16(q_s + row * stride + chunk * 8, src, valid);
  }
  for (int row = tid; row < kRows; row += kThreads) {
    const int mtile = row / 16;
    const int group = mtile / args.group_mtiles, head = 2 * (mtile % args.group_mtiles) + (row % 16) / 8;
    const int64_t query = q0 + 8 * group + row % 8;
    const bool valid = group < args.groups && head < args.heads && query < args.rows;
    w_s[row] =
        valid
            ? __bfloat162float(args.head_weights[(args.first - args.first_query + query) * args.heads + head])
            : 0.0f;
  }
  // Pool tile `tile` into key buffer `buffer`, zero past the last pool and past head_dim.
  auto load_keys = [&](int64_t tile, int buffer) {
    __nv_bfloat16* dst = k_s + buffer * kPools * stride;
    for (int i = tid; i < kPools * chunks; i += kThreads) {
      const int row = i / chunks, chunk = i % chunks;
      const int64_t pool = tile * kPools + row;
      const bool valid = pool < args.pools && chunk < real_chunks;
      const __nv_bfloat16* src = valid ? args.pool_keys + pool * args.head_dim + chunk * 8 : args.pool_keys;
      copy16(dst + row * stride + chunk * 8, src, valid);
    }
  };
  load_keys(blockIdx.y, 0);
  copy_commit();

  const int lane = tid % 32, warp = tid / 32, warp_m = warp / kWarpsN, warp_n = warp % kWarpsN;
  const int g = lane / 4, c = lane % 4;
  // ldmatrix x4 row addresses. q (row-major m16 x k16): lanes 0-15 rows 0-15 at k 0, lanes 16-31
  // rows 0-15 at k 8, giving a0..a3. Keys ([pool][k], the "col" B operand): lanes 0-7 pools 0-7
  // at k 0 (b0 of n tile 2j), 8-15 pools 0-7 at k 8 (b1), 16-23 pools 8-15 at k 0 (b0 of n tile
  // 2j + 1), 24-31 pools 8-15 at k 8 (b1).
  const uint32_t q_address = shared_address(q_s + (warp_m * 64 + lane % 16) * stride + (lane / 16) * 8);
  const uint32_t k_address =
      shared_address(k_s + (warp_n * 64 + lane % 8 + (lane / 16) * 8) * stride + ((lane / 8) % 2) * 8);
  const uint32_t mtile_bytes = 16 * stride * 2, buffer_bytes = kPools * stride * 2;
  const int slots_per_group = max(1, args.group_mtiles / 4);

  int buffer = 0;
  for (int64_t tile = blockIdx.y; tile < tiles; tile += gridDim.y, buffer ^= 1) {
    // Prefetch the next tile into the other buffer (read by the previous tile, which every warp
    // has finished: the barrier before the reduction below).
    if (tile + gridDim.y < tiles) load_keys(tile + gridDim.y, buffer ^ 1);
    copy_commit();  // possibly empty: the group count stays uniform
    copy_wait_all_but_newest();
    __syncthreads();  // this tile's keys (and q, w) visible to all; partial_s free again

    float acc[kWarpMTiles][kWarpNTiles][4] = {};
    const uint32_t k_base = k_address + buffer * buffer_bytes;
    for (int k = 0; k < args.kdim / 16; ++k) {
      uint32_t a[kWarpMTiles][4], b[kWarpNTiles / 2][4];
#pragma unroll
      for (int i = 0; i < kWarpMTiles; ++i) ldmatrix_x4(a[i], q_address + i * mtile_bytes + k * 32);
#pragma unroll
      for (int j = 0; j < kWarpNTiles / 2; ++j) ldmatrix_x4(b[j], k_base + j * mtile_bytes + k * 32);
#pragma unroll
      for (int i = 0; i < kWarpMTiles; ++i)
#pragma unroll
        for (int j = 0; j < kWarpNTiles; ++j)
          mma_bf16(acc[i][j], a[i], b[j / 2][(j % 2) * 2], b[j / 2][(j % 2) * 2 + 1]);
    }

    // relu(scale * dot) * w summed over the thread's rows of one group (accumulator rows g and
    // g + 8 are query g's heads 2 * pair and 2 * pair + 1), stored per `segment` m16 tiles.
    float part[kWarpNTiles][2] = {};
#pragma unroll
    for (int i = 0; i < kWarpMTiles; ++i) {
      const int mtile = warp_m * kWarpMTiles + i;
      const float w0 = w_s[mtile * 16 + g], w1 = w_s[mtile * 16 + g + 8];
#pragma unroll
      for (int j = 0; j < kWarpNTiles; ++j) {
        part[j][0] +=
            w0 * fmaxf(args.scale * acc[i][j][0], 0.0f) + w1 * fmaxf(args.scale * acc[i][j][2], 0.0f);
        part[j][1] +=
            w0 * fmaxf(args.scale * acc[i][j][1], 0.0f) + w1 * fmaxf(args.scale * acc[i][j][3], 0.0f);
      }
      if (((i + 1) & (args.segment - 1)) == 0) {  // segment is 1, 2 or 4
        float* dst = partial_s + ((mtile / args.segment) * 8 + g) * kPartialStride + warp_n * 64 + 2 * c;
#pragma unroll
        for (int j = 0; j < kWarpNTiles; ++j) {
          *reinterpret_cast<float2*>(dst + 8 * j) = make_float2(part[j][0], part[j][1]);
          part[j][0] = part[j][1] = 0.0f;
        }
      }
    }
    __syncthreads();

    // Each query's score: the sum of its group's partials, in slot order (the same for every
    // pool, so equal keys give equal scores).
    const int64_t n0 = tile * kPools;
    for (int i = tid; i < queries * kPools; i += kThreads) {
      const int qi = i / kPools, col = i % kPools;
      const int64_t query = q0 + qi, pool = n0 + col;
      if (query >= args.rows || pool >= args.pools) continue;
      const float* src = partial_s + ((qi / 8) * slots_per_group * 8 + qi % 8) * kPartialStride + col;
      float sum = 0.0f;
      for (int slot = 0; slot < slots_per_group; ++slot) sum += src[slot * 8 * kPartialStride];
      args.scores[query * args.pools + pool] = sum;
    }
  }
}

}  // namespace

void indexer_scores_mma(const cpu::IndexerShape& s, const __nv_bfloat16* q, const __nv_bfloat16* pool_keys,
                        const __nv_bfloat16* head_weights, int64_t first, int64_t rows, float* scores,
                        cudaStream_t stream) {
  check(s.kpool > 0 && s.heads > 0 && s.heads <= kMaxHeads && s.head_dim > 0 && s.head_dim % 8 == 0 &&
            s.head_dim <= kMaxHeadDim,
        "indexer_scores: the tensor-core scorer takes heads 1..", kMaxHeads,
        " and head_dim a multiple of 8 up to ", kMaxHeadDim, " (kpool > 0), got heads ", s.heads,
        ", head_dim ", s.head_dim, ", kpool ", s.kpool);
  check(first >= s.first_query && s.first_query >= 0 && rows >= 0 && first + rows <= s.tokens,
        "indexer_scores: queries ", first, " .. ", first + rows, " outside ", s.first_query, " .. ",
        s.tokens);
  check(reinterpret_cast<uintptr_t>(q) % 16 == 0 && reinterpret_cast<uintptr_t>(pool_keys) % 16 == 0,
        "indexer_scores: q and pool_keys must be 16-byte aligned (cp.async)");
  const int64_t pools = s.complete_pools();
  if (rows == 0 || pools == 0) return;

  const Tiling t = tiling(s);
  int device = 0, sms = 0;
  SPINDLE_CUDA(cudaGetDevice(&device));
  SPINDLE_CUDA(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device));
  allow_shared_memory(indexer_scores_kernel, t.shared_bytes, "indexer_scores: heads ", s.heads,
                      " x head_dim ", s.head_dim);
  const int64_t queries = 8 * t.groups;
  const int64_t query_tiles = (rows + queries - 1) / queries;
  check(query_tiles < (int64_t{1} << 31), "indexer_scores: ", rows, " queries are too many for one launch");
  // Split the pool tiles over blockIdx.y when the query tiles alone would leave multiprocessors
  // idle (one CTA fits a multiprocessor): about two CTAs per multiprocessor in all.
  const int64_t most_tiles = (std::min(pools, (first + rows) / s.kpool) + kPools - 1) / kPools;
  const int64_t splits = std::clamp<int64_t>((2 * sms + query_tiles - 1) / query_tiles, 1,
                                             std::clamp<int64_t>(most_tiles, 1, 65535));
  ScoreArgs args{q,
                 pool_keys,
                 head_weights,
                 scores,
                 first,
                 rows,
                 pools,
                 s.kpool,
                 s.first_query,
                 static_cast<int>(s.heads),
                 static_cast<int>(s.head_dim),
                 t.kdim,
                 t.group_mtiles,
                 t.groups,
                 t.segment,
                 1.0f / std::sqrt(static_cast<float>(s.head_dim))};
  launch_kernel(indexer_scores_kernel,
                dim3(static_cast<unsigned>(query_tiles), static_cast<unsigned>(splits)), kThreads,
                t.shared_bytes, stream, args);
  SPINDLE_LAUNCHED("indexer_scores_kernel");
}

void indexer_scores(const cpu::IndexerShape& s, const __nv_bfloat16* q, const __nv_bfloat16* pool_keys,
                    const __nv_bfloat16* head_weights, int64_t first, int64_t rows, float* scores,
                    unsigned* maxima, cudaStream_t stream) {
  if (indexer_scores_hopper_takes(s)) {
    indexer_scores_hopper(s, q, pool_keys, head_weights, first, rows, scores, maxima, stream);
  } else {
    indexer_scores_mma(s, q, pool_keys, head_weights, first, rows, scores, stream);
    if (maxima != nullptr) indexer_tile_maxima(s, scores, first, rows, maxima, stream);
  }
}

const char* indexer_scorer(const cpu::IndexerShape& s) {
  return indexer_scores_hopper_takes(s) ? "wgmma" : "mma.sync";
}

}  // namespace spindle::cuda
