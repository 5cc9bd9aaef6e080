// The sparse MLA forward on wgmma over pairs of neighbouring queries; see sparse_mla_hopper.h for
// the design. Scores are kept in the log2 domain (scaled by scale * log2(e)) so that each
// exponential is one instruction (exp2_ftz).
#include <algorithm>
#include <cmath>

#include "backend/cuda/check.h"
#include "core/error.h"
#include "kernels/cuda/mma.cuh"
#include "kernels/cuda/shared_memory_limit.h"
#include "kernels/cuda/sparse_mla_hopper.h"
#include "kernels/cuda/sparse_mla_pairs.h"
#include "kernels/cuda/sparse_mla_tile.cuh"
#include "kernels/cuda/tensor_map.h"
#include "kernels/cuda/wgmma.cuh"

namespace spindle::cuda {

namespace {

constexpr int kGroups = 2;  // warpgroups: one query of the pair each
constexpr int kThreads = 128 * kGroups;
constexpr int kKeys = kTileKeys;  // rows per tile: the scores' M
constexpr int kHeads = 32;        // heads per CTA and query: both products' N
constexpr int kMaxDim = 512;

// The largest union, in units of the wider selection, that a pair walks together. A warpgroup per
// query: 5/4, where every tile costs both warpgroups' arithmetic once, against two tiles' gathers
// and arithmetic apart. Heads as M (the latent of 512): a tile together costs about 2/3 of one apart,
// so 3/2 (measured: bench_sparse_mla, docs/PERF.md).
constexpr double kShareLimit = 1.25, kHeadsShareLimit = 1.5;

struct Args : SparseMlaInputs {
  PairListView pairs;
  int64_t tokens;
  __nv_bfloat16* out;
  float* lse;
};

// Byte offsets into the dynamic shared memory (1024-byte aligned: the swizzled tiles').
struct Layout {
  uint32_t tile_bytes;        // one tile, [kKeys][dk] bf16; the two buffers come first
  uint32_t q;                 // [kGroups] Q, [kHeads][dk] bf16 each
  uint32_t p;                 // [kGroups] P^T, [kHeads][kKeys] bf16 each
  uint32_t red_max, red_sum;  // [kGroups][4 warps][kHeads] float: per-warp column maxima and sums
  uint32_t bars;              // full [2], empty [2] uint64: each buffer's tile landed, and was read
  uint32_t total;
};

__host__ __device__ constexpr Layout layout(int dk) {
  Layout l{};
  l.tile_bytes = static_cast<uint32_t>(kKeys * dk * 2);
  l.q = 2 * l.tile_bytes;
  l.p = l.q + kGroups * kHeads * dk * 2;
  l.red_max = l.p + kGroups * kHeads * kKeys * 2;
  l.red_sum = l.red_max + kGroups * 4 * kHeads * 4;
  l.bars = l.red_sum + kGroups * 4 * kHeads * 4;
  l.total = l.bars + 4 * 8;
  return l;
}

// What attend_tile needs of its warpgroup.
struct Warpgroup {
  int group, warp, lane, key_a;  // key_a: this thread's score rows, key_a and key_a + 8
  int dk;
  uint32_t q_address, p_address, row_group_bytes;
  unsigned char* p_s;
  float *red_max, *red_sum;
  float scale2;
};

// One tile for one query: S^T = K Q^T, the online softmax down each head's column over the rows
// the query selected (valid0, valid1: this thread's rows key_a, key_a + 8), P^T to shared memory,
// O^T = O^T alpha + V^T P^T. Blocks: dv / 64, a template argument so that no branch stands between
// a tile's wgmma (the compiler serialises them otherwise).
template <int Blocks>
__device__ __forceinline__ void attend_tile(const Warpgroup& wg, uint32_t tile_address, bool valid0,
                                            bool valid1, float (&m_run)[8], float (&l_run)[8],
                                            float (&acc)[Blocks][16]) {
  // S^T [64 keys, 32 heads] = K Q^T over dk.
  float s[16] = {};
  tile_times_rows<kHeads>(s, tile_address, wg.q_address, wg.dk, wg.row_group_bytes);

  // Online softmax down each head's column: the column's maximum over the 4 warps.
  float mx[8];
#pragma unroll
  for (int j = 0; j < 16; ++j) s[j] = ((j / 2) % 2 ? valid1 : valid0) ? s[j] * wg.scale2 : -INFINITY;
#pragma unroll
  for (int i = 0; i < 8; ++i) {
    mx[i] = fmaxf(s[4 * (i / 2) + i % 2], s[4 * (i / 2) + 2 + i % 2]);
#pragma unroll
    for (int offset = 4; offset < 32; offset *= 2)
      mx[i] = fmaxf(mx[i], __shfl_xor_sync(0xffffffffu, mx[i], offset));
  }
  if (wg.lane < 4) {
#pragma unroll
    for (int i = 0; i < 8; ++i) wg.red_max[wg.warp * kHeads + 8 * (i / 2) + 2 * wg.lane + i % 2] = mx[i];
  }
  warpgroup_barrier(wg.group);
  float alpha[8], sum[8];
#pragma unroll
  for (int i = 0; i < 8; ++i) {
    const int head = 8 * (i / 2) + 2 * (wg.lane % 4) + i % 2;
    float m_new = m_run[i];
#pragma unroll
    for (int w = 0; w < 4; ++w) m_new = fmaxf(m_new, wg.red_max[w * kHeads + head]);
    alpha[i] = m_new == -INFINITY ? 1.0f : exp2_ftz(m_run[i] - m_new);
    m_run[i] = m_new;
    sum[i] = 0.0f;
  }
  // P^T [32 heads, 64 keys] to shared memory, the B operand of the values' product.
#pragma unroll
  for (int j = 0; j < 16; ++j) {
    const int i = 2 * (j / 4) + j % 2, head = 8 * (j / 4) + 2 * (wg.lane % 4) + j % 2;
    const float p = m_run[i] == -INFINITY ? 0.0f : exp2_ftz(s[j] - m_run[i]);
    *reinterpret_cast<__nv_bfloat16*>(wg.p_s + core_offset(head, wg.key_a + 8 * ((j / 2) % 2), kKeys)) =
        __float2bfloat16(p);
    sum[i] += p;
  }
#pragma unroll
  for (int i = 0; i < 8; ++i) {
#pragma unroll
    for (int offset = 4; offset < 32; offset *= 2) sum[i] += __shfl_xor_sync(0xffffffffu, sum[i], offset);
  }
  if (wg.lane < 4) {
#pragma unroll
    for (int i = 0; i < 8; ++i) wg.red_sum[wg.warp * kHeads + 8 * (i / 2) + 2 * wg.lane + i % 2] = sum[i];
  }
  fence_async_shared();
  warpgroup_barrier(wg.group);
#pragma unroll
  for (int i = 0; i < 8; ++i) {
    const int head = 8 * (i / 2) + 2 * (wg.lane % 4) + i % 2;
    float total = 0.0f;
#pragma unroll
    for (int w = 0; w < 4; ++w) total += wg.red_sum[w * kHeads + head];
    l_run[i] = l_run[i] * alpha[i] + total;
  }

  // O^T [dv, 32 heads] = O^T alpha + V^T P^T: V^T is the tile read MN-major, 64 columns a block.
#pragma unroll
  for (int b = 0; b < Blocks; ++b) {
#pragma unroll
    for (int j = 0; j < 16; ++j) {
      acc[b][j] *= alpha[2 * (j / 4) + j % 2];
      wgmma_hold(acc[b][j]);
    }
  }
  wgmma_fence();
#pragma unroll
  for (int b = 0; b < Blocks; ++b) {
#pragma unroll
    for (int k = 0; k < kKeys / 16; ++k)
      wgmma_m64n32k16<1>(acc[b],
                         wgmma_descriptor_128b(tile_address + b * kSwizzleBlockBytes + k * 16 * 128,
                                               kSwizzleBlockBytes, 1024),
                         wgmma_descriptor(wg.p_address + k * 256, 128, kKeys * 16), true);
  }
  wgmma_commit();
  wgmma_wait<0>();
#pragma unroll
  for (int b = 0; b < Blocks; ++b) {
#pragma unroll
    for (int j = 0; j < 16; ++j) wgmma_hold(acc[b][j]);
  }
}

// Each tile buffer's barriers: full (fill_tile's TMA arrival and its warpgroup's 128 cp.async
// arrivals), empty (both warpgroups done reading); by the CTA, complete on return.
__device__ __forceinline__ void init_buffer_barriers(uint64_t* full, uint64_t* empty) {
  if (threadIdx.x == 0) {
    for (int b = 0; b < 2; ++b) {
      mbarrier_init(full + b, 1 + 128);
      mbarrier_init(empty + b, kGroups);
    }
  }
  mbarrier_init_fence();
  __syncthreads();
}

// A pair of queries and a group of up to 32 heads, a warpgroup per query: warpgroup g takes query
// 2 pair + g.
template <int Blocks>
__device__ __forceinline__ void forward_pair_per_query(const Args& a, const CUtensorMap& latent_map,
                                                       unsigned char* shared, int64_t pair) {
  const Layout L = layout(a.dk);
  // The warpgroup (and warp) through a shuffle: the compiler then knows them uniform across the warp,
  // and does not serialise the wgmma in branches and loops that depend on them.
  const int group = __shfl_sync(0xffffffffu, threadIdx.x / 128, 0),
            warp = __shfl_sync(0xffffffffu, threadIdx.x % 128 / 32, 0);
  const int h0 = blockIdx.y * kHeads, wt = threadIdx.x % 128, lane = threadIdx.x % 32;
  const int64_t t = 2 * pair + group;  // this warpgroup's query
  const bool live = t < a.tokens;
  uint64_t* full = reinterpret_cast<uint64_t*>(shared + L.bars);
  uint64_t* empty = full + 2;
  unsigned char* q_s = shared + L.q + group * kHeads * a.dk * 2;
  const Warpgroup wg{group,
                     warp,
                     lane,
                     16 * warp + lane / 4,
                     a.dk,
                     shared_address(q_s),
                     shared_address(shared + L.p + group * kHeads * kKeys * 2),
                     static_cast<uint32_t>(a.dk * 16),
                     shared + L.p + group * kHeads * kKeys * 2,
                     reinterpret_cast<float*>(shared + L.red_max) + group * 4 * kHeads,
                     reinterpret_cast<float*>(shared + L.red_sum) + group * 4 * kHeads,
                     a.scale2};
  // The list this warpgroup walks: the pair's union (both warpgroups, every tile) or its own
  // selection.
  const bool together = a.pairs.together[pair] != 0;
  const int32_t* list =
      together ? a.pairs.lists + pair * a.pairs.stride : a.selected + (live ? t : 0) * a.width;
  const int64_t slots = together ? a.pairs.lengths[pair] : (live ? a.width : 0);
  const int64_t tiles = (slots + kKeys - 1) / kKeys;
  const int32_t mine = group == 0 ? kInFirst : kInSecond;
  const auto rows_of = [&](int64_t tile) {
    TileRows r = tile_rows(list, slots, 0, tile, wt);
    if (together) strip_marks(r);
    return r;
  };
  // A buffer's fill: fill_tile's TMA arrival with its bytes, and each of its 128 threads' arrival
  // when its cp.async rows have landed.
  const auto fill = [&](int buffer, const TileRows& r) {
    fill_tile(shared + buffer * L.tile_bytes, r, a.latent, a.latent_stride, a.dk, wt, &latent_map,
              full + buffer);
    copy_arrive(full + buffer);
  };

  init_buffer_barriers(full, empty);
  // This query's Q (zero rows past the last head and for a missing second query), then the first
  // tiles: shared, warpgroup g fills tile g; apart, each its own first tile into buffer g.
  const int chunks = a.dk / 8;
  for (int u = wt; u < kHeads * chunks; u += 128) {
    const int g = u / (8 * chunks), c = u % (8 * chunks) / 8, head = 8 * g + u % 8;
    const bool valid = live && h0 + head < a.heads;
    copy16(q_s + u * 16, valid ? a.q + ((t * a.heads + h0 + head) * a.dk + c * 8) : a.q, valid);
  }
  copy_commit();
  if (together ? group < tiles : tiles > 0) fill(group, rows_of(together ? group : 0));
  TileRows next = rows_of(together ? group + 2 : 1);
  copy_wait_all();
  fence_async_shared();
  warpgroup_barrier(group);  // Q landed

  // Per thread, heads 8 b + 2 (lane % 4) + e at index 2 b + e (the accumulators' columns).
  float m_run[8], l_run[8];
#pragma unroll
  for (int i = 0; i < 8; ++i) {
    m_run[i] = -INFINITY;
    l_run[i] = 0.0f;
  }
  float acc[Blocks][16] = {};
  for (int64_t tile = 0; tile < tiles; ++tile) {
    // Shared, tile k sits in buffer k % 2 and warpgroup k % 2 refills it with tile k + 2 once both
    // have read it; apart, warpgroup g's tiles all use buffer g.
    const int buffer = together ? static_cast<int>(tile % 2) : group;
    const uint32_t parity = static_cast<uint32_t>(together ? tile / 2 % 2 : tile % 2);
    const int64_t slot = tile * kKeys + wg.key_a;
    const int32_t own0 = slot < slots ? list[slot] : -1, own1 = slot + 8 < slots ? list[slot + 8] : -1;
    const bool valid0 = own0 >= 0 && (!together || (own0 & mine)),
               valid1 = own1 >= 0 && (!together || (own1 & mine));
    mbarrier_wait(full + buffer, parity);
    fence_async_shared();  // the cp.async rows, seen through the barrier, before wgmma reads them
    warpgroup_barrier(group);
    attend_tile<Blocks>(wg, shared_address(shared + buffer * L.tile_bytes), valid0, valid1, m_run, l_run,
                        acc);
    warpgroup_barrier(group);  // every warp is done with the tile and P^T
    if (together) {
      if (wt == 0) mbarrier_arrive(empty + buffer);
      if (group == buffer && tile + 2 < tiles) {
        mbarrier_wait(empty + buffer, parity);
        fill(buffer, next);
        next = rows_of(tile + 4);
      }
    } else if (tile + 1 < tiles) {
      fill(buffer, next);
      next = rows_of(tile + 2);
    }
  }

  // This query's output, normalised, as bf16 [heads][dv] through its warpgroup's part of the spent
  // tile buffers, then out in 16-byte rows.
  __syncthreads();
  __nv_bfloat16* o_s = reinterpret_cast<__nv_bfloat16*>(shared) + group * kHeads * a.dv;
  float inv[8];
#pragma unroll
  for (int i = 0; i < 8; ++i) {
    const int head = 8 * (i / 2) + 2 * (lane % 4) + i % 2;
    inv[i] = l_run[i] > 0.0f ? 1.0f / l_run[i] : 0.0f;
    if (live && warp == 0 && lane < 4 && h0 + head < a.heads)
      a.lse[t * a.heads + h0 + head] = l_run[i] > 0.0f ? (m_run[i] + log2f(l_run[i])) / kLog2e : INFINITY;
  }
#pragma unroll
  for (int b = 0; b < Blocks; ++b) {
#pragma unroll
    for (int j = 0; j < 16; ++j) {
      const int dim = 64 * b + wg.key_a + 8 * ((j / 2) % 2), head = 8 * (j / 4) + 2 * (lane % 4) + j % 2;
      o_s[head * a.dv + dim] = __float2bfloat16(acc[b][j] * inv[2 * (j / 4) + j % 2]);
    }
  }
  warpgroup_barrier(group);
  if (!live) return;
  const int heads_here = min(kHeads, a.heads - h0), units = heads_here * a.dv / 8;
  uint4* dst = reinterpret_cast<uint4*>(a.out + (t * a.heads + h0) * a.dv);
  for (int u = wt; u < units; u += 128) dst[u] = reinterpret_cast<const uint4*>(o_s)[u];
}

// One CTA per (pair of queries, group of up to 32 heads).
template <int Blocks>
__global__ void __launch_bounds__(kThreads, 1)
    sparse_mla_forward_pairs_kernel(const Args a, const __grid_constant__ CUtensorMap latent_map) {
  extern __shared__ __align__(1024) unsigned char shared[];
  if (threadIdx.x == 0 && shared_address(shared) % 1024 != 0) __trap();  // the swizzle's alignment
  forward_pair_per_query<Blocks>(a, latent_map, shared, blockIdx.x);
}

// ---- The latent of 512: a pair's 64 heads as the products' M ----------------------------------
//
// One CTA per (pair, group of up to 32 heads) walks the pair's list with both warpgroups: M = the
// pair's 64 heads (rows 0-31 the first query's, 32-63 the second's), so that each product reads
// the tile for both queries at once. Per tile, warpgroup g:
//   S [64 heads, 32 keys] = Q K_g^T over the 512 values (K_g the tile's keys 32 g .. 32 g + 31),
//   each row's maximum over its keys, shared with the other warpgroup through shared memory;
//   P = exp(S - m) (0 where the row's query did not select the key) as bf16 into P [64, 64];
//   O_g [64 heads, 256 values] = O_g alpha + P V_g over the tile's 64 keys, V_g its values
//   256 g .. 256 g + 255 read MN-major.
// Each row's sum stays per thread over its own keys (both warpgroups scale by the same maximum) and
// is summed at the end. Tiles in two buffers as in the kernel above, warpgroup k % 2 refilling
// buffer k % 2 with tile k + 2; P and the maxima in two buffers, so that one barrier of both
// warpgroups a tile guards each.
constexpr int kLatentDim = 512;
constexpr int kPairRows = 2 * kHeads;        // M
constexpr int kHalfKeys = kKeys / 2;         // a warpgroup's keys in S
constexpr int kHalfValues = kLatentDim / 2;  // a warpgroup's value columns in O
constexpr int kValueBlocks = kHalfValues / 64;

struct HeadsLayout {
  static constexpr uint32_t kTileBytes = kKeys * kLatentDim * 2;
  static constexpr uint32_t kQ = 2 * kTileBytes;                         // [64 rows][512] bf16, core matrices
  static constexpr uint32_t kP = kQ + kPairRows * kLatentDim * 2;        // [2][64 rows][64 keys] bf16
  static constexpr uint32_t kMax = kP + 2 * kPairRows * kKeys * 2;       // [2][kGroups][64 rows] float
  static constexpr uint32_t kSums = kMax + 2 * kGroups * kPairRows * 4;  // [kGroups][64 rows] float
  static constexpr uint32_t kBars = kSums + kGroups * kPairRows * 4;     // full [2], empty [2]
  static constexpr uint32_t kTotal = kBars + 4 * 8;
};
static_assert(HeadsLayout::kTotal <= 227 * 1024, "the heads-as-M forward's shared memory");

// Both warpgroups (barrier 0 is __syncthreads', 1 and 2 the warpgroups' own).
__device__ __forceinline__ void pair_barrier() { asm volatile("bar.sync 3, 256;\n" ::: "memory"); }

__device__ __forceinline__ void forward_pair_heads(const Args& a, const CUtensorMap& latent_map,
                                                   unsigned char* shared, int64_t pair) {
  using HL = HeadsLayout;
  const int64_t t0 = 2 * pair;
  const int group = __shfl_sync(0xffffffffu, threadIdx.x / 128, 0),
            warp = __shfl_sync(0xffffffffu, threadIdx.x % 128 / 32, 0);
  const int h0 = blockIdx.y * kHeads, wt = threadIdx.x % 128, lane = threadIdx.x % 32;
  uint64_t* full = reinterpret_cast<uint64_t*>(shared + HL::kBars);
  uint64_t* empty = full + 2;
  const int32_t* list = a.pairs.lists + pair * a.pairs.stride;
  const int64_t slots = a.pairs.lengths[pair], tiles = (slots + kKeys - 1) / kKeys;
  // This thread's rows (heads) row_a and row_a + 8, both of query `second` (warps 2-3 hold its heads).
  const int row_a = 16 * warp + lane / 4;
  const bool second = warp >= 2;
  const int32_t mine = second ? kInSecond : kInFirst;
  const auto rows_of = [&](int64_t tile) {
    TileRows r = tile_rows(list, slots, 0, tile, wt);
    strip_marks(r);
    return r;
  };
  const auto fill = [&](int buffer, const TileRows& r) {
    fill_tile(shared + buffer * HL::kTileBytes, r, a.latent, a.latent_stride, kLatentDim, wt, &latent_map,
              full + buffer);
    copy_arrive(full + buffer);
  };

  init_buffer_barriers(full, empty);
  // Q of both queries (zero rows past the last head and for a missing second query), then warpgroup
  // g fills tile g.
  constexpr int kChunks = kLatentDim / 8;
  for (int u = threadIdx.x; u < kPairRows * kChunks; u += kThreads) {
    const int g = u / (8 * kChunks), c = u % (8 * kChunks) / 8, row = 8 * g + u % 8;
    const int64_t t = t0 + row / kHeads;
    const int head = h0 + row % kHeads;
    const bool valid = t < a.tokens && head < a.heads;
    copy16(shared + HL::kQ + u * 16, valid ? a.q + ((t * a.heads + head) * kLatentDim + c * 8) : a.q, valid);
  }
  copy_commit();
  if (group < tiles) fill(group, rows_of(group));
  TileRows next = rows_of(group + 2);
  copy_wait_all();
  fence_async_shared();
  __syncthreads();  // Q landed

  float m_run[2] = {-INFINITY, -INFINITY}, l_run[2] = {0.0f, 0.0f};  // rows row_a, row_a + 8
  float acc[kValueBlocks][32] = {};
  const uint32_t q_address = shared_address(shared + HL::kQ);
  for (int64_t tile = 0; tile < tiles; ++tile) {
    const int buffer = static_cast<int>(tile % 2);
    const uint32_t parity = static_cast<uint32_t>(tile / 2 % 2);
    const uint32_t tile_address = shared_address(shared + buffer * HL::kTileBytes);
    unsigned char* p_s = shared + HL::kP + buffer * kPairRows * kKeys * 2;
    float* max_s = reinterpret_cast<float*>(shared + HL::kMax) + buffer * kGroups * kPairRows;
    // Whether this thread's keys (of the warpgroup's half: 8 j + 2 (lane % 4) + e) are its query's.
    bool valid[4][2];
#pragma unroll
    for (int j = 0; j < 4; ++j) {
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        const int64_t slot = tile * kKeys + kHalfKeys * group + 8 * j + 2 * (lane % 4) + e;
        const int32_t entry = slot < slots ? list[slot] : -1;
        valid[j][e] = entry >= 0 && (entry & mine);
      }
    }
    mbarrier_wait(full + buffer, parity);
    fence_async_shared();  // the cp.async rows, seen through the barrier, before wgmma reads them

    // S [64 heads, 32 keys] = Q K_g^T: Q K-major (core matrices), the tile's keys K-major (swizzled).
    float s[16] = {};
    wgmma_hold(s);
    wgmma_fence();
#pragma unroll
    for (int k = 0; k < kLatentDim / 16; ++k)
      wgmma_m64n32k16<0>(
          s, wgmma_descriptor(q_address + k * 256, 128, kLatentDim * 16),
          wgmma_descriptor_128b(
              tile_address + k / 4 * kSwizzleBlockBytes + kHalfKeys * group * 128 + k % 4 * 32, 16, 1024),
          k > 0);
    wgmma_commit();
    wgmma_wait<0>();
    wgmma_hold(s);

    // s[4 j + 2 h + e]: row row_a + 8 h, key 8 j + 2 (lane % 4) + e. Each row's maximum over the
    // quad's keys, then over both warpgroups'.
    float mx[2] = {-INFINITY, -INFINITY};
#pragma unroll
    for (int j = 0; j < 4; ++j) {
#pragma unroll
      for (int h = 0; h < 2; ++h) {
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          float& x = s[4 * j + 2 * h + e];
          x = valid[j][e] ? x * a.scale2 : -INFINITY;
          mx[h] = fmaxf(mx[h], x);
        }
      }
    }
    float alpha[2];
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      mx[h] = fmaxf(mx[h], __shfl_xor_sync(0xffffffffu, mx[h], 1));
      mx[h] = fmaxf(mx[h], __shfl_xor_sync(0xffffffffu, mx[h], 2));
      if (lane % 4 == 0) max_s[group * kPairRows + row_a + 8 * h] = mx[h];
    }
    pair_barrier();
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const float other = max_s[(1 - group) * kPairRows + row_a + 8 * h];
      const float m_new = fmaxf(m_run[h], fmaxf(mx[h], other));
      alpha[h] = m_new == -INFINITY ? 1.0f : exp2_ftz(m_run[h] - m_new);
      m_run[h] = m_new;
      l_run[h] *= alpha[h];
    }
    // P into its buffer (K-major core matrices: row, key 32 g + 8 j + 2 (lane % 4) + e).
#pragma unroll
    for (int j = 0; j < 4; ++j) {
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const float p0 = m_run[h] == -INFINITY ? 0.0f : exp2_ftz(s[4 * j + 2 * h] - m_run[h]),
                    p1 = m_run[h] == -INFINITY ? 0.0f : exp2_ftz(s[4 * j + 2 * h + 1] - m_run[h]);
        l_run[h] += p0 + p1;
        *reinterpret_cast<uint32_t*>(
            p_s + core_offset(row_a + 8 * h, kHalfKeys * group + 8 * j + 2 * (lane % 4), kKeys)) =
            pack_bf16(p0, p1);
      }
    }
    fence_async_shared();
    pair_barrier();  // P whole: both warpgroups' keys

    // O_g = O_g alpha + P V_g: P K-major (core matrices), V_g the tile's values read MN-major.
#pragma unroll
    for (int b = 0; b < kValueBlocks; ++b) {
#pragma unroll
      for (int j = 0; j < 32; ++j) {
        acc[b][j] *= alpha[(j / 2) % 2];
        wgmma_hold(acc[b][j]);
      }
    }
    wgmma_fence();
    const uint32_t p_address = shared_address(p_s);
#pragma unroll
    for (int b = 0; b < kValueBlocks; ++b) {
#pragma unroll
      for (int k = 0; k < kKeys / 16; ++k)
        wgmma_m64n64k16<0, 1>(
            acc[b], wgmma_descriptor(p_address + k * 256, 128, kKeys * 16),
            wgmma_descriptor_128b(
                tile_address + (kValueBlocks * group + b) * kSwizzleBlockBytes + k * 16 * 128,
                kSwizzleBlockBytes, 1024),
            true);
    }
    wgmma_commit();
    wgmma_wait<0>();
#pragma unroll
    for (int b = 0; b < kValueBlocks; ++b) wgmma_hold(acc[b]);
    warpgroup_barrier(group);  // every warp is done with the tile
    if (wt == 0) mbarrier_arrive(empty + buffer);
    if (group == buffer && tile + 2 < tiles) {
      mbarrier_wait(empty + buffer, parity);
      fill(buffer, next);
      next = rows_of(tile + 4);
    }
  }

  // Each row's sum over both warpgroups' keys, then the output, normalised, as bf16 [64 rows][512]
  // through the spent tile buffers, and out in 16-byte rows per query.
  float* sums_s = reinterpret_cast<float*>(shared + HL::kSums);
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    l_run[h] += __shfl_xor_sync(0xffffffffu, l_run[h], 1);
    l_run[h] += __shfl_xor_sync(0xffffffffu, l_run[h], 2);
    if (lane % 4 == 0) sums_s[group * kPairRows + row_a + 8 * h] = l_run[h];
  }
  __syncthreads();
  float inv[2];
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const int row = row_a + 8 * h;
    const float l = sums_s[row] + sums_s[kPairRows + row];
    inv[h] = l > 0.0f ? 1.0f / l : 0.0f;
    const int64_t t = t0 + row / kHeads;
    const int head = h0 + row % kHeads;
    if (group == 0 && lane % 4 == 0 && t < a.tokens && head < a.heads)
      a.lse[t * a.heads + head] = l > 0.0f ? (m_run[h] + log2f(l)) / kLog2e : INFINITY;
  }
  __nv_bfloat16* o_s = reinterpret_cast<__nv_bfloat16*>(shared);  // [64 rows][512]
#pragma unroll
  for (int b = 0; b < kValueBlocks; ++b) {
#pragma unroll
    for (int j = 0; j < 32; ++j) {
      const int row = row_a + 8 * ((j / 2) % 2),
                dim = kHalfValues * group + 64 * b + 8 * (j / 4) + 2 * (lane % 4) + j % 2;
      o_s[row * kLatentDim + dim] = __float2bfloat16(acc[b][j] * inv[(j / 2) % 2]);
    }
  }
  __syncthreads();
  const int heads_here = min(kHeads, a.heads - h0), units = heads_here * kLatentDim / 8;
  for (int q = 0; q < 2; ++q) {
    const int64_t t = t0 + q;
    if (t >= a.tokens) break;
    uint4* dst = reinterpret_cast<uint4*>(a.out + (t * a.heads + h0) * kLatentDim);
    const uint4* src = reinterpret_cast<const uint4*>(o_s + q * kHeads * kLatentDim);
    for (int u = threadIdx.x; u < units; u += kThreads) dst[u] = src[u];
  }
}

// The latent of 512: one CTA per (pair, group of up to 32 heads), heads as M where the pair shares
// its tiles, else a warpgroup per query (its selections hardly overlap: together each would pay
// for the other's keys).
constexpr uint32_t kLatentShared = std::max(HeadsLayout::kTotal, layout(kLatentDim).total);
__global__ void __launch_bounds__(kThreads, 1)
    sparse_mla_forward_latent_kernel(const Args a, const __grid_constant__ CUtensorMap latent_map) {
  extern __shared__ __align__(1024) unsigned char shared[];
  if (threadIdx.x == 0 && shared_address(shared) % 1024 != 0) __trap();  // the swizzle's alignment
  const int64_t pair = blockIdx.x;
  // Through a shuffle, so that the compiler knows the branch uniform and keeps its wgmma unserialised.
  if (__shfl_sync(0xffffffffu, a.pairs.together[pair], 0) != 0)
    forward_pair_heads(a, latent_map, shared, pair);
  else
    forward_pair_per_query<kLatentDim / 64>(a, latent_map, shared, pair);
}

}  // namespace

bool sparse_mla_hopper_takes(const SparseMlaShape& s) {
  return sparse_mla_unsupported(s).empty() && s.dk % 64 == 0 && s.dv % 64 == 0 && s.dv <= s.dk &&
         s.dk <= kMaxDim;
}

void sparse_mla_forward_hopper(const SparseMlaShape& s, const __nv_bfloat16* q, const __nv_bfloat16* latent,
                               const int32_t* selected, __nv_bfloat16* out, float* lse, cudaStream_t stream) {
  check(sparse_mla_hopper_takes(s), "sparse MLA on wgmma: dk ", s.dk, " and dv ", s.dv,
        " must be multiples of 64 with dv <= dk <= ", kMaxDim);
  check(reinterpret_cast<uintptr_t>(q) % 16 == 0 && reinterpret_cast<uintptr_t>(latent) % 16 == 0 &&
            reinterpret_cast<uintptr_t>(out) % 16 == 0,
        "sparse MLA on wgmma: q, the latent and out must be 16-byte aligned");
  if (s.tokens == 0) return;
  const bool heads_as_m = s.dk == kLatentDim && s.dv == kLatentDim;
  const PairLists lists =
      pair_lists(selected, s.width, s.tokens, heads_as_m ? kHeadsShareLimit : kShareLimit, stream);
  Args args{};
  static_cast<SparseMlaInputs&>(args) = sparse_mla_inputs(s, q, latent, selected);
  args.pairs = lists.view;
  args.tokens = s.tokens;
  args.out = out;
  args.lse = lse;
  // The kernel does not know how many rows the latent has, only that every selected row is one:
  // the map claims more rows than any sequence, and only selected pools are read through it.
  const CUtensorMap map =
      bf16_tensor_map_128b(latent, int64_t{1} << 31, s.dk, s.latent_stride, kPoolRows, 64);
  const dim3 grid(static_cast<unsigned>((s.tokens + 1) / 2),
                  static_cast<unsigned>((s.heads + kHeads - 1) / kHeads));
  if (heads_as_m) {
    allow_shared_memory(sparse_mla_forward_latent_kernel, kLatentShared, "sparse MLA, the latent of 512");
    sparse_mla_forward_latent_kernel<<<grid, kThreads, kLatentShared, stream>>>(args, map);
    SPINDLE_LAUNCHED("sparse_mla_forward_latent_kernel");
    return;
  }
  const size_t shared_bytes = layout(args.dk).total;
  const auto run = [&](auto kernel) {
    allow_shared_memory(kernel, shared_bytes, "sparse MLA on wgmma: dk ", s.dk, ", dv ", s.dv);
    kernel<<<grid, kThreads, shared_bytes, stream>>>(args, map);
    SPINDLE_LAUNCHED("sparse_mla_forward_pairs_kernel");
  };
  switch (s.dv / 64) {
    case 1:
      return run(sparse_mla_forward_pairs_kernel<1>);
    case 2:
      return run(sparse_mla_forward_pairs_kernel<2>);
    case 3:
      return run(sparse_mla_forward_pairs_kernel<3>);
    case 4:
      return run(sparse_mla_forward_pairs_kernel<4>);
    case 5:
      return run(sparse_mla_forward_pairs_kernel<5>);
    case 6:
      return run(sparse_mla_forward_pairs_kernel<6>);
    case 7:
      return run(sparse_mla_forward_pairs_kernel<7>);
    default:
      return run(sparse_mla_forward_pairs_kernel<8>);
  }
}

}  // namespace spindle::cuda
