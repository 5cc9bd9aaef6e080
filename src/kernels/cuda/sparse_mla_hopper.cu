// The sparse MLA forward on wgmma over pairs of neighbouring queries; see sparse_mla_hopper.h for
// the design. Scores are kept in the log2 domain (scaled by scale * log2(e)) so that each
// exponential is one instruction (exp2_ftz).
#include <algorithm>
#include <cmath>

#include "backend/cuda/check.h"
#include "core/error.h"
#include "kernels/cuda/launch.cuh"
#include "kernels/cuda/mma.cuh"
#include "kernels/cuda/online_softmax.cuh"
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
  bool apart_only;  // the pairs that walk their list together are another kernel's (the latent of 512)
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
  const uint64_t tile = wgmma_descriptor_128b(tile_address, kSwizzleBlockBytes, 1024),
                 probabilities = wgmma_descriptor(wg.p_address, 128, kKeys * 16);
#pragma unroll
  for (int b = 0; b < Blocks; ++b) {
#pragma unroll
    for (int k = 0; k < kKeys / 16; ++k)
      wgmma_m64n32k16<1>(acc[b], wgmma_descriptor_plus(tile, b * kSwizzleBlockBytes + k * 16 * 128),
                         wgmma_descriptor_plus(probabilities, k * 256), true);
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
  wait_for_earlier_kernels();
  extern __shared__ __align__(1024) unsigned char shared[];
  if (threadIdx.x == 0 && shared_address(shared) % 1024 != 0) __trap();  // the swizzle's alignment
  if (a.apart_only && a.pairs.together[blockIdx.x] != 0) return;
  forward_pair_per_query<Blocks>(a, latent_map, shared, blockIdx.x);
}

// ---- The latent of 512: a pair's 64 heads as the products' M ----------------------------------
//
// One CTA per (pair, group of up to 32 heads) walks the pair's list with M = the pair's 64 heads
// (rows 0-31 the first query's, 32-63 the second's), so that each product reads a tile for both
// queries. The tiles go in twos, A = 2 i to warpgroup 0 and B = 2 i + 1 to warpgroup 1, each in its
// own buffer; warpgroup g holds the output's value columns 256 g .. 256 g + 255, O_g. Per two tiles:
//   WG0: S_A = Q K_A^T [64 rows, 64 keys]; M0 = max(M, row maxima of S_A), shared;
//        P_A = exp(S_A - M0) in registers; O_0 = O_0 exp(M - M0) + P_A V_A[:, 0:256];
//   WG1: S_B = Q K_B^T; M1 = max(M0, row maxima of S_B), shared; P_B = exp(S_B - M1);
//        O_1 = O_1 exp(M - M1) + P_B V_B[:, 256:512]; P_B to shared memory;
//   WG0: P_A exp(M0 - M1) to shared memory; O_0 = O_0 exp(M0 - M1) + P_B V_B[:, 0:256];
//   WG1: O_1 += P_A exp(M0 - M1) V_A[:, 256:512].
// Each warpgroup's softmax runs while the other's products do; they wait on each other only for a
// maximum or a P (named barriers: one arrives, the other waits). Each buffer's halves (values 0-255,
// 256-511) have their own barrier, and warpgroup g refills half g of both buffers with the next two
// tiles as soon as it has read it last (its P V from that half). The row sums stay per thread over
// each warpgroup's own tiles (in the same running maximum as its O), summed at the end.
constexpr int kLatentDim = 512;
constexpr int kPairRows = 2 * kHeads;        // M
constexpr int kHalfValues = kLatentDim / 2;  // a warpgroup's value columns in O, a buffer half's
constexpr int kHalfBlocks = kHalfValues / 64;
constexpr uint32_t kHalfBytes = kHalfBlocks * kSwizzleBlockBytes;

struct HeadsLayout {
  static constexpr uint32_t kTileBytes = kKeys * kLatentDim * 2;      // buffer 0 (tiles A), then 1 (B)
  static constexpr uint32_t kQ = 2 * kTileBytes;                      // [64 rows][512] bf16, core matrices
  static constexpr uint32_t kP = kQ + kPairRows * kLatentDim * 2;     // [2][64 rows][64 keys] bf16: P_A, P_B
  static constexpr uint32_t kMax = kP + 2 * kPairRows * kKeys * 2;    // [2][64 rows] float: M0, M1
  static constexpr uint32_t kSums = kMax + 2 * kPairRows * 4;         // [kGroups][64 rows] float
  static constexpr uint32_t kBars = kSums + kGroups * kPairRows * 4;  // full [buffer][half]
  static constexpr uint32_t kList = kBars + 4 * 8;                    // the pair's list, int32
  static uint32_t total(int64_t list_capacity) { return kList + static_cast<uint32_t>(4 * list_capacity); }
};
// The most entries a pair's list walked with the heads as M holds: its union, at most kHeadsShareLimit
// times the selection's width.
int64_t heads_list_capacity(int64_t width) {
  return static_cast<int64_t>(kHeadsShareLimit * static_cast<double>(width)) + 1;
}

// The warpgroups' named barriers (0 is __syncthreads', 1 and 2 the warpgroups' own): the writer of
// M0, M1, P_A or P_B arrives once it is in shared memory, the reader waits.
enum PairBarrier { kMaxA = 4, kMaxB = 5, kProbsA = 6, kProbsB = 7 };
template <int Id>
__device__ __forceinline__ void pair_arrive() {
  asm volatile("bar.arrive %0, 256;\n" ::"n"(Id) : "memory");
}
template <int Id>
__device__ __forceinline__ void pair_wait() {
  asm volatile("bar.sync %0, 256;\n" ::"n"(Id) : "memory");
}

// Which of the tile's keys this thread's scores hold (bit 2 j + e: key 8 j + 2 (lane % 4) + e) the
// query of its rows selected.
__device__ __forceinline__ uint32_t selected_keys(const int32_t* list, int64_t slots, int64_t tile, int lane,
                                                  int32_t mine) {
  uint32_t bits = 0;
#pragma unroll
  for (int j = 0; j < 8; ++j) {
#pragma unroll
    for (int e = 0; e < 2; ++e) {
      const int64_t slot = tile * kKeys + 8 * j + 2 * (lane % 4) + e;
      const int32_t entry = slot < slots ? list[slot] : -1;
      if (entry >= 0 && (entry & mine)) bits |= 1u << (2 * j + e);
    }
  }
  return bits;
}

// S [64 rows, 64 keys] = Q K^T over the 512 values of the tile at tile_address, each half once its
// barrier (halves[0], halves[1]) has completed phase `parity`, half First first; in the log2 domain,
// -inf where the row's query did not select the key (bits: selected_keys). Complete on return.
template <int First>
__device__ __forceinline__ void pair_scores(float (&s)[32], uint32_t q_address, uint32_t tile_address,
                                            uint64_t* halves, uint32_t parity, uint32_t bits, float scale2) {
  wgmma_hold(s);
  const uint64_t q = wgmma_descriptor(q_address, 128, kLatentDim * 16),
                 tile = wgmma_descriptor_128b(tile_address, 16, 1024);
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const int half = h == 0 ? First : 1 - First;
    mbarrier_wait(halves + half, parity);
    fence_async_shared();  // the cp.async rows, seen through the barrier, before wgmma reads them
    wgmma_fence();
#pragma unroll
    for (int kk = 0; kk < kLatentDim / 32; ++kk) {
      const int k = kLatentDim / 32 * half + kk;
      wgmma_m64n64k16(s, wgmma_descriptor_plus(q, k * 256),
                      wgmma_descriptor_plus(tile, k / 4 * kSwizzleBlockBytes + k % 4 * 32), h > 0 || kk > 0);
    }
  }
  wgmma_commit();
  wgmma_wait<0>();
  wgmma_hold(s);
#pragma unroll
  for (int j = 0; j < 32; ++j) {
    const int bit = 2 * (j / 4) + j % 2;  // s[4 j' + 2 h + e]: key 8 j' + 2 (lane % 4) + e
    s[j] = (bits >> bit) & 1u ? s[j] * scale2 : -INFINITY;
  }
}

// P [64 rows, 64 keys] from its A fragments into p_s (K-major core matrices: the other warpgroup's
// A operand), each row times `factor` where that is not 1 (rounded to bf16 a second time then),
// then fenced for the other warpgroup's wgmma.
__device__ __forceinline__ void store_probabilities(unsigned char* p_s, const uint32_t (&p)[4][4],
                                                    const float (&factor)[2], int row_a, int lane) {
#pragma unroll
  for (int k = 0; k < 4; ++k) {
#pragma unroll
    for (int r = 0; r < 4; ++r) {
      const int h = r % 2;
      uint32_t v = p[k][r];
      if (factor[h] != 1.0f) {
        const float2 x = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&v));
        v = pack_bf16(x.x * factor[h], x.y * factor[h]);
      }
      *reinterpret_cast<uint32_t*>(
          p_s + core_offset(row_a + 8 * h, 16 * k + 8 * (r / 2) + 2 * (lane % 4), kKeys)) = v;
    }
  }
  fence_async_shared();
}

// O_g's rows times factor (no product in flight on it).
__device__ __forceinline__ void scale_rows(float (&acc)[kHalfBlocks][32], const float (&factor)[2]) {
#pragma unroll
  for (int b = 0; b < kHalfBlocks; ++b) {
#pragma unroll
    for (int j = 0; j < 32; ++j) acc[b][j] *= factor[(j / 2) % 2];
  }
}

// O_g += P V over a tile's 64 keys, V the buffer half at half_address read MN-major; `product`
// issues the wgmma of value block b's k-step k given V's descriptor (P from registers or from
// shared memory). Committed, not waited for.
template <typename Product>
__device__ __forceinline__ void values_times(float (&acc)[kHalfBlocks][32], uint32_t half_address,
                                             Product product) {
  wgmma_hold(acc);
  wgmma_fence();
  const uint64_t half = wgmma_descriptor_128b(half_address, kSwizzleBlockBytes, 1024);
#pragma unroll
  for (int b = 0; b < kHalfBlocks; ++b) {
#pragma unroll
    for (int k = 0; k < kKeys / 16; ++k)
      product(acc[b], k, wgmma_descriptor_plus(half, b * kSwizzleBlockBytes + k * 16 * 128));
  }
  wgmma_commit();
}
// P from its A fragments, or from shared memory at p_address (K-major core matrices).
__device__ __forceinline__ void values_times(float (&acc)[kHalfBlocks][32], uint32_t (&p)[4][4],
                                             uint32_t half_address) {
  values_times(acc, half_address,
               [&](float(&d)[32], int k, uint64_t v) { wgmma_m64n64k16_rs<1>(d, p[k], v, true); });
}
__device__ __forceinline__ void values_times(float (&acc)[kHalfBlocks][32], uint32_t p_address,
                                             uint32_t half_address) {
  const uint64_t probabilities = wgmma_descriptor(p_address, 128, kKeys * 16);
  values_times(acc, half_address, [&](float(&d)[32], int k, uint64_t v) {
    wgmma_m64n64k16<0, 1>(d, wgmma_descriptor_plus(probabilities, k * 256), v, true);
  });
}

__device__ __forceinline__ void forward_pair_heads(const Args& a, const CUtensorMap& latent_map,
                                                   unsigned char* shared, int64_t pair) {
  using HL = HeadsLayout;
  const int64_t t0 = 2 * pair;
  const int group = __shfl_sync(0xffffffffu, threadIdx.x / 128, 0),
            warp = __shfl_sync(0xffffffffu, threadIdx.x % 128 / 32, 0);
  const int h0 = blockIdx.y * kHeads, wt = threadIdx.x % 128, lane = threadIdx.x % 32;
  uint64_t* full = reinterpret_cast<uint64_t*>(shared + HL::kBars);  // [buffer][half]
  const int64_t slots = a.pairs.lengths[pair], tiles = (slots + kKeys - 1) / kKeys;
  int32_t* list = reinterpret_cast<int32_t*>(shared + HL::kList);  // the pair's list, copied below
  // This thread's rows (heads) row_a and row_a + 8, both of query `second` (warps 2-3 hold its heads).
  const int row_a = 16 * warp + lane / 4;
  const int32_t mine = warp >= 2 ? kInSecond : kInFirst;
  // Half `half` (values 256 half ..) of buffer `buffer` filled with `tile`, by this warpgroup.
  const auto fill = [&](int buffer, int half, int64_t tile) {
    TileRows r = tile_rows(list, slots, 0, tile, wt);
    strip_marks(r);
    uint64_t* bar = full + 2 * buffer + half;
    fill_tile_blocks(shared + buffer * HL::kTileBytes, r, a.latent, a.latent_stride, kHalfBlocks * half,
                     kHalfBlocks * (half + 1), wt, &latent_map, bar);
    copy_arrive(bar);
  };

  if (threadIdx.x == 0) {
    for (int b = 0; b < 4; ++b) mbarrier_init(full + b, 1 + 128);
  }
  // Q of both queries (zero rows past the last head and for a missing second query) and the pair's
  // list into shared memory (every tile's gather and masks read it on the warpgroups' way), then
  // warpgroup g fills half g of the first two tiles.
  constexpr int kChunks = kLatentDim / 8;
  for (int u = threadIdx.x; u < kPairRows * kChunks; u += kThreads) {
    const int g = u / (8 * kChunks), c = u % (8 * kChunks) / 8, row = 8 * g + u % 8;
    const int64_t t = t0 + row / kHeads;
    const int head = h0 + row % kHeads;
    const bool valid = t < a.tokens && head < a.heads;
    copy16(shared + HL::kQ + u * 16, valid ? a.q + ((t * a.heads + head) * kLatentDim + c * 8) : a.q, valid);
  }
  copy_commit();
  for (int64_t i = threadIdx.x; i < slots; i += kThreads) list[i] = a.pairs.lists[pair * a.pairs.stride + i];
  mbarrier_init_fence();
  __syncthreads();
  for (int buffer = 0; buffer < 2; ++buffer)
    if (buffer < tiles) fill(buffer, group, buffer);
  copy_wait_all();
  fence_async_shared();
  __syncthreads();  // Q landed

  float m_run[2] = {-INFINITY, -INFINITY}, l_run[2] = {0.0f, 0.0f};  // rows row_a, row_a + 8
  float acc[kHalfBlocks][32] = {};
  const uint32_t q_address = shared_address(shared + HL::kQ), a_address = shared_address(shared),
                 b_address = a_address + HL::kTileBytes;
  float* max_s = reinterpret_cast<float*>(shared + HL::kMax);  // M0 [64 rows], then M1
  unsigned char *pa_s = shared + HL::kP, *pb_s = pa_s + kPairRows * kKeys * 2;
  float s[32];
  uint32_t p[4][4];
  for (int64_t ta = 0; ta < tiles; ta += 2) {
    const int64_t tb = ta + 1;
    const bool has_b = tb < tiles;
    const uint32_t parity = static_cast<uint32_t>(ta / 2 % 2);
    if (group == 0) {
      pair_scores<0>(s, q_address, a_address, full, parity, selected_keys(list, slots, ta, lane, mine),
                     a.scale2);
      float m0[2], alpha[2];
      row_maxima(s, m_run, m0);
      if (lane % 4 == 0) {
        max_s[row_a] = m0[0];
        max_s[row_a + 8] = m0[1];
      }
      pair_arrive<kMaxA>();
      for (int h = 0; h < 2; ++h) {
        alpha[h] = rescale(m_run[h], m0[h]);
        l_run[h] *= alpha[h];
      }
      scale_rows(acc, alpha);
      probabilities(s, m0, l_run, p);
      values_times(acc, p, a_address);
      wgmma_wait<0>();
      wgmma_hold(acc);
      wgmma_hold_fragment(p);
      if (ta + 2 < tiles) fill(0, 0, ta + 2);
      pair_wait<kMaxB>();
      float beta[2];
      for (int h = 0; h < 2; ++h) {
        m_run[h] = max_s[kPairRows + row_a + 8 * h];
        beta[h] = rescale(m0[h], m_run[h]);
        l_run[h] *= beta[h];
      }
      store_probabilities(pa_s, p, beta, row_a, lane);
      pair_arrive<kProbsA>();
      scale_rows(acc, beta);
      if (has_b) {
        pair_wait<kProbsB>();
        values_times(acc, shared_address(pb_s), b_address);
        wgmma_wait<0>();
        wgmma_hold(acc);
        if (tb + 2 < tiles) fill(1, 0, tb + 2);
      }
    } else {
      float mb[2] = {-INFINITY, -INFINITY};
      if (has_b) {
        pair_scores<1>(s, q_address, b_address, full + 2, parity, selected_keys(list, slots, tb, lane, mine),
                       a.scale2);
        row_maxima(s, mb, mb);
      }
      pair_wait<kMaxA>();
      float alpha[2];
      for (int h = 0; h < 2; ++h) {
        const float m1 = fmaxf(max_s[row_a + 8 * h], mb[h]);
        if (lane % 4 == 0) max_s[kPairRows + row_a + 8 * h] = m1;
        alpha[h] = rescale(m_run[h], m1);
        l_run[h] *= alpha[h];
        m_run[h] = m1;
      }
      pair_arrive<kMaxB>();
      scale_rows(acc, alpha);
      if (has_b) {
        probabilities(s, m_run, l_run, p);
        values_times(acc, p, b_address + kHalfBytes);
        const float one[2] = {1.0f, 1.0f};
        store_probabilities(pb_s, p, one, row_a, lane);
        pair_arrive<kProbsB>();
        wgmma_wait<0>();
        wgmma_hold(acc);
        wgmma_hold_fragment(p);
        if (tb + 2 < tiles) fill(1, 1, tb + 2);
      }
      pair_wait<kProbsA>();
      values_times(acc, shared_address(pa_s), a_address + kHalfBytes);
      wgmma_wait<0>();
      wgmma_hold(acc);
      if (ta + 2 < tiles) fill(0, 1, ta + 2);
    }
  }

  // Each row's sum over both warpgroups' tiles, then the output, normalised, as bf16 [64 rows][512]
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
  for (int b = 0; b < kHalfBlocks; ++b) {
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

// The latent of 512: one CTA per (pair, group of up to 32 heads) that walks its list together; the
// others (their selections hardly overlap: together each query would pay for the other's keys) are
// sparse_mla_forward_pairs_kernel's, a warpgroup per query, in a launch of their own (one kernel
// for both kept the two paths' registers at once, and spilled).
__global__ void __launch_bounds__(kThreads, 1)
    sparse_mla_forward_heads_kernel(const Args a, const __grid_constant__ CUtensorMap latent_map) {
  wait_for_earlier_kernels();
  extern __shared__ __align__(1024) unsigned char shared[];
  if (threadIdx.x == 0 && shared_address(shared) % 1024 != 0) __trap();  // the swizzle's alignment
  if (a.pairs.together[blockIdx.x] == 0) return;
  forward_pair_heads(a, latent_map, shared, blockIdx.x);
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
  // The heads as M for the latent of 512 where the pairs' lists fit beside the tiles (the model's
  // 2,063-wide selections: 12 KB of 18).
  const bool heads_as_m = s.dk == kLatentDim && s.dv == kLatentDim &&
                          HeadsLayout::total(heads_list_capacity(s.width)) <= kMaxDynamicShared;
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
    const uint32_t bytes = HeadsLayout::total(heads_list_capacity(s.width));
    allow_shared_memory(sparse_mla_forward_heads_kernel, bytes, "sparse MLA, the latent of 512: width ",
                        s.width);
    launch_kernel(sparse_mla_forward_heads_kernel, grid, kThreads, bytes, stream, args, map);
    SPINDLE_LAUNCHED("sparse_mla_forward_heads_kernel");
    args.apart_only = true;
  }
  const size_t shared_bytes = layout(args.dk).total;
  const auto run = [&](auto kernel) {
    allow_shared_memory(kernel, shared_bytes, "sparse MLA on wgmma: dk ", s.dk, ", dv ", s.dv);
    launch_kernel(kernel, grid, kThreads, shared_bytes, stream, args, map);
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
