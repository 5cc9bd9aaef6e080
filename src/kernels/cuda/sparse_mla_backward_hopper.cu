// The sparse MLA backward on wgmma; see sparse_mla_backward_hopper.h for the design. Scores are in
// the log2 domain (scaled by scale * log2(e)), as in the other sparse MLA kernels.
#include <cmath>

#include "backend/cuda/check.h"
#include "core/error.h"
#include "kernels/cuda/launch.cuh"
#include "kernels/cuda/mma.cuh"
#include "kernels/cuda/shared_memory_limit.h"
#include "kernels/cuda/sparse_mla_backward_hopper.h"
#include "kernels/cuda/sparse_mla_pairs.h"
#include "kernels/cuda/sparse_mla_tile.cuh"
#include "kernels/cuda/tensor_map.h"
#include "kernels/cuda/wgmma.cuh"

namespace spindle::cuda {

namespace {

constexpr int kThreads = 256;      // two warpgroups
constexpr int kKeys = kTileKeys;   // selected rows per tile: every product's M but dQ's
constexpr int kHeads = 32;         // heads per CTA
constexpr int kDim = 512;          // dk = dv
constexpr int kRows = 2 * kHeads;  // [Q; dO] and [dS; P]: the heads' rows twice
// The rows' gradient, 256 fp32 columns a round, rows 264 floats apart: a warp's float2 stores (8
// rows, 4 column pairs) then take the two wavefronts their 256 bytes need, and each row stays
// 16-byte aligned for the bulk reduction.
constexpr int kRoundColumns = 256, kStageStride = kRoundColumns + 8;

// Byte offsets into the dynamic shared memory from its first 1024-byte boundary (the swizzled
// tiles' alignment; kAlignSlack more bytes are asked for). Two buffers, each a tile of 64 rows x 512
// values in the 128-byte swizzled layout (fill_tile's) and then the gradient staged from it.
constexpr uint32_t kAlignSlack = 1024;
constexpr uint32_t kBufferBytes = 68 * 1024;
static_assert(kBufferBytes >= kKeys * kDim * 2 && kBufferBytes >= kKeys * kStageStride * 4 &&
                  kBufferBytes % 1024 == 0,
              "a buffer holds a tile and its staged gradient, 1024-byte aligned");
// A query alone: two tile buffers.
constexpr uint32_t kQdo = 2 * kBufferBytes;                // [Q; dO], [kRows][kDim] bf16, core matrices
constexpr uint32_t kGrads = kQdo + kRows * kDim * 2;       // [dS; P], [kRows][kKeys] bf16, core matrices
constexpr uint32_t kIndices = kGrads + kRows * kKeys * 2;  // [2 buffers][kKeys] int32
constexpr uint32_t kStats = kIndices + 2 * kKeys * 4;      // lse (log2 domain), delta: [kHeads] float each
constexpr uint32_t kOneQueryEnd = kStats + 2 * kHeads * 4;
// A pair that walks its list together: the second query's [Q; dO] takes the second buffer's room.
constexpr int kPairRows = 2 * kRows;                              // [Q0; dO0; Q1; dO1] and [dS0; dS1; P0; P1]
constexpr uint32_t kPairQdo = kBufferBytes;                       // [kPairRows][kDim] bf16, core matrices
constexpr uint32_t kPairGrads = kPairQdo + kPairRows * kDim * 2;  // [kPairRows][kKeys] bf16, core matrices
constexpr uint32_t kPairEntries = kPairGrads + kPairRows * kKeys * 2;  // [kKeys] int32: the tile's list slots
constexpr uint32_t kPairSlots = kPairEntries + kKeys * 4;    // [2][kKeys] int32: each query's selection slot
constexpr uint32_t kPairStats = kPairSlots + 2 * kKeys * 4;  // lse, delta: [2 kHeads] float each
constexpr uint32_t kPairEnd = kPairStats + 4 * kHeads * 4;
constexpr uint32_t kBars = kPairEnd > kOneQueryEnd ? kPairEnd : kOneQueryEnd;  // [2] uint64, both kinds'
constexpr uint32_t kSharedBytes = kBars + 2 * 8 + kAlignSlack;
constexpr uint32_t kQdoGroupBytes = kDim * 16;     // 8 rows of [Q; dO]
constexpr uint32_t kGradsGroupBytes = kKeys * 16;  // 8 rows of [dS; P]

// The largest union, in units of the wider selection, that a pair walks together: a tile of it
// costs about 2/3 of the two tiles apart (estimated from the forward's, docs/PERF.md).
constexpr double kShareLimit = 1.5;

struct Args : SparseMlaInputs {
  const __nv_bfloat16* out;  // the forward's
  const float* lse;          // the forward's, natural log
  const __nv_bfloat16* dout;
  __nv_bfloat16* dq;
  float* d_latent;
  float* mass;
  PairListView pairs;  // sparse_mla_pairs.h
  int64_t tokens;
};

// The [Q; dO] row of k-step k's first row of [dS; P] in the rows' gradient: the same row for a query
// alone ([dS; P] against [Q; dO]); for a pair, [dS0; dS1; P0; P1] against [Q0; dO0; Q1; dO1].
template <bool Pair>
__device__ __forceinline__ constexpr int qdo_row_of_step(int k) {
  if (!Pair) return 16 * k;
  const int part = k / 2, row = 16 * (k % 2);  // part: dS0, dS1, P0, P1
  return (part % 2) * kRows + (part / 2) * kHeads + row;
}

// Issues acc = [dS; P]^T [Q; dO] for columns n0 .. n0 + 127: A the [dS; P] rows read MN-major (keys
// contiguous), B the [Q; dO] rows read MN-major (values contiguous), depth kRows (a pair: 2 kRows).
// The caller fences, commits and waits.
template <bool Pair>
__device__ __forceinline__ void issue_rows_gradient(float (&acc)[64], uint32_t grads_address,
                                                    uint32_t qdo_address, int n0) {
  const uint64_t grads = wgmma_descriptor(grads_address, kGradsGroupBytes, 128),
                 qdo = wgmma_descriptor(qdo_address + n0 / 8 * 128, kQdoGroupBytes, 128);
#pragma unroll
  for (int k = 0; k < (Pair ? kPairRows : kRows) / 16; ++k)
    wgmma_m64n128k16<1, 1>(acc, wgmma_descriptor_plus(grads, k * 2 * kGradsGroupBytes),
                           wgmma_descriptor_plus(qdo, qdo_row_of_step<Pair>(k) / 8 * kQdoGroupBytes), k > 0);
}

// issue_rows_gradient alone, complete on return.
template <bool Pair>
__device__ __forceinline__ void rows_gradient(float (&acc)[64], uint32_t grads_address, uint32_t qdo_address,
                                              int n0) {
  wgmma_hold(acc);
  wgmma_fence();
  issue_rows_gradient<Pair>(acc, grads_address, qdo_address, n0);
  wgmma_commit();
  wgmma_wait<0>();
  wgmma_hold(acc);
}

// The accumulators of rows_gradient into the staged rows, at the warpgroup's 128 of the round's
// columns.
__device__ __forceinline__ void stage_gradient(float* staged, const float (&acc)[64], int group, int key_a,
                                               int c2) {
#pragma unroll
  for (int j = 0; j < 16; ++j) {
#pragma unroll
    for (int h = 0; h < 2; ++h)
      *reinterpret_cast<float2*>(staged + (key_a + 8 * h) * kStageStride + group * 128 + 8 * j + c2) =
          make_float2(acc[4 * j + 2 * h], acc[4 * j + 2 * h + 1]);
  }
}

// [Q; dO] of `Queries` queries from t0 ([Q0; dO0; Q1; dO1] for two; zero rows past the last head
// and for a query past the sequence) in core matrices: 16-byte unit u of an 8-row group at 16 u.
template <int Queries>
__device__ __forceinline__ void load_q_dout(const Args& a, int64_t t0, int h0, unsigned char* qdo_s) {
  constexpr int kChunks = kDim / 8;
  for (int u = threadIdx.x; u < Queries * kRows * kChunks; u += kThreads) {
    const int g = u / (8 * kChunks), c = u % (8 * kChunks) / 8, row = 8 * g + u % 8, head = row % kHeads;
    const int64_t t = t0 + row / kRows;
    const bool valid = t < a.tokens && h0 + head < a.heads;
    const __nv_bfloat16* src = row % kRows < kHeads ? a.q : a.dout;
    copy16(qdo_s + u * 16, valid ? src + ((t * a.heads + h0 + head) * kDim + c * 8) : src, valid);
  }
}

// delta = rowsum(dO o O) and the log2-domain lse of each (query, head) row of `Queries` queries from
// t0, into delta_s and lse_s ([Queries kHeads] each), kThreads / (Queries kHeads) threads a row.
template <int Queries>
__device__ __forceinline__ void load_statistics(const Args& a, int64_t t0, int h0, float* lse_s,
                                                float* delta_s) {
  constexpr int kPerRow = kThreads / (Queries * kHeads);
  const int row = threadIdx.x / kPerRow, part = threadIdx.x % kPerRow, head = row % kHeads;
  const int64_t t = t0 + row / kHeads;
  const bool valid = t < a.tokens && h0 + head < a.heads;
  float sum = 0.0f;
  if (valid) {
    const int64_t base = (t * a.heads + h0 + head) * kDim;
    for (int col = part * 8; col < kDim; col += 8 * kPerRow) {
      const uint4 d = *reinterpret_cast<const uint4*>(a.dout + base + col),
                  o = *reinterpret_cast<const uint4*>(a.out + base + col);
      const __nv_bfloat162* d2 = reinterpret_cast<const __nv_bfloat162*>(&d);
      const __nv_bfloat162* o2 = reinterpret_cast<const __nv_bfloat162*>(&o);
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const float2 df = __bfloat1622float2(d2[e]), of = __bfloat1622float2(o2[e]);
        sum += df.x * of.x + df.y * of.y;
      }
    }
  }
#pragma unroll
  for (int offset = kPerRow / 2; offset > 0; offset /= 2) sum += __shfl_xor_sync(0xffffffffu, sum, offset);
  if (part == 0) {
    delta_s[row] = sum;
    lse_s[row] = valid ? a.lse[t * a.heads + h0 + head] * kLog2e : INFINITY;
  }
}

// dQ^T += K^T dS^T for warpgroup `group`'s 4 blocks of 64 values (N = Queries kHeads: the dS rows of
// [dS; P], or [dS0; dS1] of a pair's), then acc = the rows' gradient for the first round's columns,
// in one batch of wgmma; complete on return.
template <int Queries>
__device__ __forceinline__ void dq_and_rows_gradient(float (&dq)[4][16 * Queries], float (&acc)[64],
                                                     uint32_t tile_address, uint32_t grads_address,
                                                     uint32_t qdo_address, int group) {
#pragma unroll
  for (int j = 0; j < 64; ++j) acc[j] = 0.0f;
#pragma unroll
  for (int b = 0; b < 4; ++b) wgmma_hold(dq[b]);
  wgmma_hold(acc);
  wgmma_fence();
  const uint64_t tile = wgmma_descriptor_128b(tile_address, kSwizzleBlockBytes, 1024),
                 grads = wgmma_descriptor(grads_address, 128, kGradsGroupBytes);
#pragma unroll
  for (int b = 0; b < 4; ++b) {
#pragma unroll
    for (int k = 0; k < kKeys / 16; ++k) {
      const uint64_t keys = wgmma_descriptor_plus(tile, (4 * group + b) * kSwizzleBlockBytes + k * 16 * 128),
                     ds = wgmma_descriptor_plus(grads, k * 256);
      if constexpr (Queries == 1)
        wgmma_m64n32k16<1>(dq[b], keys, ds, true);
      else
        wgmma_m64n64k16<1, 0>(dq[b], keys, ds, true);
    }
  }
  issue_rows_gradient<Queries == 2>(acc, grads_address, qdo_address, group * 128);
  wgmma_commit();
  wgmma_wait<0>();
#pragma unroll
  for (int b = 0; b < 4; ++b) wgmma_hold(dq[b]);
  wgmma_hold(acc);
}

// A tile's rows' gradient into the latent, acc holding the first round's columns (this thread's rows
// key_a and key_a + 8, column pairs at c2, of warpgroup `group`'s half of them): each round staged
// in the tile's spent buffer and added by bulk reductions, issued and waited for by the `issuer`
// threads, thread wt for the tile's row wt (rows[wt] & mask; -1: none). On return the last round's
// reductions may still be reading the buffer.
template <bool Pair>
__device__ __forceinline__ void reduce_rows_gradient(const Args& a, float (&acc)[64], float* staged,
                                                     const int32_t* rows, int32_t mask,
                                                     uint32_t grads_address, uint32_t qdo_address, int group,
                                                     int key_a, int c2, bool issuer) {
  const int wt = threadIdx.x % 128;
  for (int round = 0; round < kDim / kRoundColumns; ++round) {
    if (round > 0) {
      rows_gradient<Pair>(acc, grads_address, qdo_address, round * kRoundColumns + group * 128);
      if (issuer) bulk_wait_read<0>();  // the previous round's columns left the buffer
      __syncthreads();
    }
    stage_gradient(staged, acc, group, key_a, c2);
    fence_async_shared();
    __syncthreads();
    if (issuer) {
      const int32_t row = rows[wt];
      if (row >= 0)
        bulk_reduce_add(
            a.d_latent + static_cast<int64_t>(row & mask) * a.latent_stride + round * kRoundColumns,
            staged + wt * kStageStride, kRoundColumns * 4);
      bulk_commit();
    }
  }
}

// dQ^T ([512, Queries kHeads]: warpgroup g values 256 g .. 256 g + 255, 64 a block of dq) to
// [query][heads][512] bf16 through dq_s, then out in 16-byte pieces. key_a, c2: as in
// reduce_rows_gradient.
template <int Queries>
__device__ __forceinline__ void write_dq(const Args& a, const float (&dq)[4][16 * Queries], int64_t t0,
                                         int h0, int group, int key_a, int c2, __nv_bfloat16* dq_s) {
  __syncthreads();
#pragma unroll
  for (int b = 0; b < 4; ++b) {
#pragma unroll
    for (int j = 0; j < 16 * Queries; ++j) {
      const int value = 64 * (4 * group + b) + key_a + 8 * ((j / 2) % 2), column = 8 * (j / 4) + c2 + j % 2;
      dq_s[column * kDim + value] = __float2bfloat16(dq[b][j]);
    }
  }
  __syncthreads();
  const int heads_here = min(kHeads, a.heads - h0), units = heads_here * kDim / 8;
  for (int q = 0; q < Queries && t0 + q < a.tokens; ++q) {
    uint4* dst = reinterpret_cast<uint4*>(a.dq + ((t0 + q) * a.heads + h0) * kDim);
    const uint4* src = reinterpret_cast<const uint4*>(dq_s + q * kHeads * kDim);
    for (int u = threadIdx.x; u < units; u += kThreads) dst[u] = src[u];
  }
}

// Query t alone (its pair walks apart), a tile in one buffer while the next lands in the other.
// bars: the two buffers' barriers, phases their parities (carried from query to query).
__device__ __forceinline__ void backward_one_query(const Args& a, const CUtensorMap& latent_map,
                                                   unsigned char* shared, uint64_t* bars, uint32_t& phases,
                                                   int64_t t) {
  // The warpgroup and warp through a shuffle: the compiler then knows them uniform across the warp
  // and does not serialise the wgmma in branches that depend on them.
  const int group = __shfl_sync(0xffffffffu, threadIdx.x / 128, 0),
            warp = __shfl_sync(0xffffffffu, threadIdx.x % 128 / 32, 0);
  const int h0 = blockIdx.y * kHeads, wt = threadIdx.x % 128, lane = threadIdx.x % 32;
  const int key_a = 16 * warp + lane / 4, c2 = 2 * (lane % 4);  // accumulator rows key_a, key_a + 8
  unsigned char* qdo_s = shared + kQdo;
  unsigned char* grads_s = shared + kGrads;
  int32_t* idx_s = reinterpret_cast<int32_t*>(shared + kIndices);
  float* lse_s = reinterpret_cast<float*>(shared + kStats);
  float* delta_s = lse_s + kHeads;
  const int64_t tiles = (a.width + kKeys - 1) / kKeys;
  load_q_dout<1>(a, t, h0, qdo_s);
  TileRows rows{};
  if (group == 1) {  // warpgroup 1 gathers every tile
    rows = tile_rows(a.selected, a.width, t, 0, wt);
    if (wt < kKeys) idx_s[wt] = rows.own;
    if (tiles > 0) fill_tile(shared, rows, a.latent, a.latent_stride, kDim, wt, &latent_map, &bars[0]);
    rows = tile_rows(a.selected, a.width, t, 1, wt);
  }
  copy_commit();
  load_statistics<1>(a, t, h0, lse_s, delta_s);

  // dQ^T [512, 32 heads]: warpgroup g holds values 256 g .. 256 g + 255, 64 a block.
  float dq[4][16] = {};
  const uint32_t qdo_address = shared_address(qdo_s), grads_address = shared_address(grads_s);
  copy_wait_all();
  fence_async_shared();
  __syncthreads();  // [Q; dO] and the statistics are in
  // The bulk reductions are issued, and waited for, by warpgroup 1's first kKeys threads: the gatherer
  // then knows without a barrier when the spent buffer has been read.
  const bool issuer = group == 1 && wt < kKeys;
  for (int64_t tile = 0; tile < tiles; ++tile) {
    const int buf = static_cast<int>(tile & 1);
    unsigned char* tile_s = shared + buf * kBufferBytes;
    const uint32_t tile_address = shared_address(tile_s);
    const int32_t* idx = idx_s + buf * kKeys;
    if (group == 1) {
      copy_wait_all();
      fence_async_shared();
    }
    mbarrier_wait(&bars[buf], phases >> buf & 1);
    phases ^= 1u << buf;
    __syncthreads();

    if (group == 0) {    // S^T and dP^T, then P and dS into [dS; P], the mass by key
      float s[32] = {};  // [S^T | dP^T]: s[j] of S, s[16 + j] of dP at the same key and head
      tile_times_rows<kRows>(s, tile_address, qdo_address, kDim, kQdoGroupBytes);
      const bool valid[2] = {idx[key_a] >= 0, idx[key_a + 8] >= 0};
      float column[2] = {};  // P over this thread's heads, keys key_a and key_a + 8
#pragma unroll
      for (int j = 0; j < 16; ++j) {
        const int h = (j / 2) % 2, key = key_a + 8 * h, head = 8 * (j / 4) + c2 + j % 2;
        const float p = valid[h] ? exp2f(s[j] * a.scale2 - lse_s[head]) : 0.0f;
        const float ds = p * (s[16 + j] - delta_s[head]) * a.scale;
        column[h] += p;
        *reinterpret_cast<__nv_bfloat16*>(grads_s + core_offset(head, key, kKeys)) = __float2bfloat16(ds);
        *reinterpret_cast<__nv_bfloat16*>(grads_s + core_offset(kHeads + head, key, kKeys)) =
            __float2bfloat16(p);
      }
      if (a.mass != nullptr) {  // over the heads: the 4 lanes of a row
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          column[h] += __shfl_xor_sync(0xffffffffu, column[h], 1);
          column[h] += __shfl_xor_sync(0xffffffffu, column[h], 2);
          const int64_t slot = tile * kKeys + key_a + 8 * h;
          // One add per slot and CTA: with one CTA per query (heads <= 32) it lands on the caller's
          // zero alone, so the sum is deterministic.
          if (lane % 4 == 0 && slot < a.width) atomicAdd(a.mass + t * a.width + slot, column[h]);
        }
      }
      fence_async_shared();
    } else {  // the next tile into the other buffer, once the previous tile's gradient has left it
      if (issuer) bulk_wait_read<0>();
      if (tile + 1 < tiles) {
        if (wt < kKeys) idx_s[(buf ^ 1) * kKeys + wt] = rows.own;
        fill_tile(shared + (buf ^ 1) * kBufferBytes, rows, a.latent, a.latent_stride, kDim, wt, &latent_map,
                  &bars[buf ^ 1]);
        rows = tile_rows(a.selected, a.width, t, tile + 2, wt);
      }
    }
    copy_commit();
    __syncthreads();  // [dS; P] is in

    float acc[64];
    dq_and_rows_gradient<1>(dq, acc, tile_address, grads_address, qdo_address, group);
    __syncthreads();  // nobody reads the tile any more: its buffer stages the gradient

    reduce_rows_gradient<false>(a, acc, reinterpret_cast<float*>(tile_s), idx, -1, grads_address, qdo_address,
                                group, key_a, c2, issuer);
  }
  if (issuer) bulk_wait_all();  // the shared memory stays the CTA's until the last reads

  write_dq<1>(a, dq, t, h0, group, key_a, c2,
              reinterpret_cast<__nv_bfloat16*>(qdo_s));  // through the [Q; dO] buffer
}

// For a tile of a pair's list (kKeys slots from `tile`): each query's slot in its own selection of
// each row it selected (-1 for the other rows), into slots_s[2][kKeys]. The list is the union of two
// ascending selections, so a row's slot is the count of that query's marks before it: `base` carries
// the counts of the earlier tiles. By one warp.
__device__ __forceinline__ void mark_slots(const int32_t* list, int64_t length, int64_t tile, int lane,
                                           int (&base)[2], int32_t* slots_s) {
  const uint32_t before = (1u << lane) - 1;
#pragma unroll
  for (int half = 0; half < 2; ++half) {
    const int64_t i = tile * kKeys + 32 * half + lane;
    const int32_t entry = i < length ? list[i] : -1;
#pragma unroll
    for (int q = 0; q < 2; ++q) {
      const bool in = entry >= 0 && (entry & (q == 0 ? kInFirst : kInSecond));
      const uint32_t ballot = __ballot_sync(0xffffffffu, in);
      slots_s[q * kKeys + 32 * half + lane] = in ? base[q] + __popc(ballot & before) : -1;
      base[q] += __popc(ballot);
    }
  }
}

// A pair that walks its list together (queries t0 = 2 pair and t0 + 1): every tile serves both, so
// that it is gathered once and its rows' gradient, [dS0; dS1; P0; P1]^T [Q0; dO0; Q1; dO1] of depth
// 128, is reduced into the latent once. Warpgroup g computes query g's scores and [dS_g; P_g] (the
// rows its query did not select masked); both then compute dQ for both queries (256 values each, N =
// the pair's 64 heads) and the rows' gradient. One tile buffer (both queries' [Q; dO] take the other
// one's room), so the next tile's gather starts once the staged gradient has been read.
__device__ __forceinline__ void backward_pair(const Args& a, const CUtensorMap& latent_map,
                                              unsigned char* shared, uint64_t* bar, uint32_t& phases,
                                              int64_t pair) {
  const int group = __shfl_sync(0xffffffffu, threadIdx.x / 128, 0),
            warp = __shfl_sync(0xffffffffu, threadIdx.x % 128 / 32, 0);
  const int h0 = blockIdx.y * kHeads, wt = threadIdx.x % 128, lane = threadIdx.x % 32;
  const int key_a = 16 * warp + lane / 4, c2 = 2 * (lane % 4);  // accumulator rows key_a, key_a + 8
  const int64_t t0 = 2 * pair;
  unsigned char* qdo_s = shared + kPairQdo;
  unsigned char* grads_s = shared + kPairGrads;
  int32_t* entries_s = reinterpret_cast<int32_t*>(shared + kPairEntries);
  int32_t* slots_s = reinterpret_cast<int32_t*>(shared + kPairSlots);
  float* lse_s = reinterpret_cast<float*>(shared + kPairStats);  // [query][head]
  float* delta_s = lse_s + 2 * kHeads;
  const int32_t* list = a.pairs.lists + pair * a.pairs.stride;
  const int64_t length = a.pairs.lengths[pair], tiles = (length + kKeys - 1) / kKeys;
  const bool gatherer = group == 1, slot_warp = gatherer && warp == 0 && a.mass != nullptr;
  int slot_base[2] = {0, 0};  // slot_warp's: each query's marks in the tiles so far

  load_q_dout<2>(a, t0, h0, qdo_s);
  TileRows rows{};
  if (gatherer) {  // warpgroup 1 gathers every tile
    rows = tile_rows(list, length, 0, 0, wt);
    if (wt < kKeys) entries_s[wt] = rows.own;
    strip_marks(rows);
    if (slot_warp) mark_slots(list, length, 0, lane, slot_base, slots_s);
    if (tiles > 0) fill_tile(shared, rows, a.latent, a.latent_stride, kDim, wt, &latent_map, bar);
    rows = tile_rows(list, length, 0, 1, wt);
  }
  copy_commit();
  load_statistics<2>(a, t0, h0, lse_s, delta_s);

  // dQ^T [512, 64]: warpgroup g holds values 256 g .. 256 g + 255, 64 a block; columns 0-31 the first
  // query's heads, 32-63 the second's.
  float dq[4][32] = {};
  const uint32_t qdo_address = shared_address(qdo_s), grads_address = shared_address(grads_s),
                 tile_address = shared_address(shared);
  const int32_t mine = group == 0 ? kInFirst : kInSecond;
  copy_wait_all();
  fence_async_shared();
  __syncthreads();  // [Q0; dO0; Q1; dO1] and the statistics are in
  // The bulk reductions are issued, and waited for, by warpgroup 1's first kKeys threads.
  const bool issuer = gatherer && wt < kKeys;
  for (int64_t tile = 0; tile < tiles; ++tile) {
    if (gatherer) {
      copy_wait_all();
      fence_async_shared();
    }
    mbarrier_wait(bar, phases & 1);
    phases ^= 1;
    __syncthreads();  // the tile, its entries and slots are in

    {  // query g's S^T and dP^T, then its P and dS into [dS0; dS1; P0; P1], its mass by slot
      float s[32] = {};  // [S^T | dP^T]: s[j] of S, s[16 + j] of dP at the same key and head
      tile_times_rows<kRows>(s, tile_address, qdo_address + group * (kRows / 8) * kQdoGroupBytes, kDim,
                             kQdoGroupBytes);
      const int32_t entry[2] = {entries_s[key_a], entries_s[key_a + 8]};
      const bool valid[2] = {entry[0] >= 0 && (entry[0] & mine), entry[1] >= 0 && (entry[1] & mine)};
      float column[2] = {};  // P over this thread's heads, keys key_a and key_a + 8
#pragma unroll
      for (int j = 0; j < 16; ++j) {
        const int h = (j / 2) % 2, key = key_a + 8 * h, head = 8 * (j / 4) + c2 + j % 2,
                  row = group * kHeads + head;
        const float p = valid[h] ? exp2f(s[j] * a.scale2 - lse_s[row]) : 0.0f;
        const float ds = p * (s[16 + j] - delta_s[row]) * a.scale;
        column[h] += p;
        *reinterpret_cast<__nv_bfloat16*>(grads_s + core_offset(row, key, kKeys)) = __float2bfloat16(ds);
        *reinterpret_cast<__nv_bfloat16*>(grads_s + core_offset(kRows + row, key, kKeys)) =
            __float2bfloat16(p);
      }
      if (a.mass != nullptr) {  // over the heads: the 4 lanes of a row; one add per slot and CTA
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          column[h] += __shfl_xor_sync(0xffffffffu, column[h], 1);
          column[h] += __shfl_xor_sync(0xffffffffu, column[h], 2);
          const int32_t slot = slots_s[group * kKeys + key_a + 8 * h];
          if (lane % 4 == 0 && slot >= 0) atomicAdd(a.mass + (t0 + group) * a.width + slot, column[h]);
        }
      }
      fence_async_shared();
    }
    __syncthreads();  // [dS0; dS1; P0; P1] is in

    float acc[64];
    dq_and_rows_gradient<2>(dq, acc, tile_address, grads_address, qdo_address, group);
    __syncthreads();  // nobody reads the tile any more: its buffer stages the gradient

    reduce_rows_gradient<true>(a, acc, reinterpret_cast<float*>(shared), entries_s, kRowMask, grads_address,
                               qdo_address, group, key_a, c2, issuer);
    // The next tile into the buffer once the TMA has read the staged gradient.
    if (gatherer) {
      if (issuer) bulk_wait_read<0>();
      warpgroup_barrier(1);
      if (tile + 1 < tiles) {
        if (wt < kKeys) entries_s[wt] = rows.own;
        strip_marks(rows);
        if (slot_warp) mark_slots(list, length, tile + 1, lane, slot_base, slots_s);
        fill_tile(shared, rows, a.latent, a.latent_stride, kDim, wt, &latent_map, bar);
        rows = tile_rows(list, length, 0, tile + 2, wt);
      }
      copy_commit();
    }
  }
  if (issuer) bulk_wait_all();  // the shared memory stays the CTA's until the last reads

  write_dq<2>(a, dq, t0, h0, group, key_a, c2,
              reinterpret_cast<__nv_bfloat16*>(qdo_s));  // through the [Q; dO] buffer
}

// One CTA per (pair of queries, group of up to 32 heads): the pair together where its list says so,
// else each query alone, one after the other.
__global__ void __launch_bounds__(kThreads, 1)
    sparse_mla_backward_hopper_kernel(const Args a, const __grid_constant__ CUtensorMap latent_map) {
  wait_for_earlier_kernels();
  extern __shared__ __align__(128) unsigned char shared_base[];
  unsigned char* shared =
      shared_base + ((kAlignSlack - shared_address(shared_base) % kAlignSlack) % kAlignSlack);
  uint64_t* bars = reinterpret_cast<uint64_t*>(shared + kBars);
  uint32_t phases = 0;  // bit b: the phase barrier b is in
  if (threadIdx.x == 0) {
    mbarrier_init(&bars[0], 1);
    mbarrier_init(&bars[1], 1);
  }
  mbarrier_init_fence();
  __syncthreads();
  const int64_t pair = blockIdx.x;
  // Through a shuffle, so that the compiler knows the branch uniform and keeps its wgmma unserialised.
  if (__shfl_sync(0xffffffffu, a.pairs.together[pair], 0) != 0) {
    backward_pair(a, latent_map, shared, bars, phases, pair);
    return;
  }
  for (int64_t t = 2 * pair; t < 2 * pair + 2 && t < a.tokens; ++t) {
    backward_one_query(a, latent_map, shared, bars, phases, t);
    __syncthreads();  // dQ's last reads of the shared memory before the next query's [Q; dO]
  }
}

}  // namespace

bool sparse_mla_backward_hopper_takes(const SparseMlaShape& s) {
  return sparse_mla_unsupported(s).empty() && s.dk == kDim && s.dv == kDim;
}

void sparse_mla_backward_hopper(const SparseMlaShape& s, const __nv_bfloat16* q, const __nv_bfloat16* latent,
                                const int32_t* selected, const __nv_bfloat16* out, const float* lse,
                                const __nv_bfloat16* dout, __nv_bfloat16* dq, float* d_latent, float* mass,
                                cudaStream_t stream) {
  check(sparse_mla_backward_hopper_takes(s), "sparse MLA backward on wgmma: dk ", s.dk, " and dv ", s.dv,
        " must both be ", kDim);
  const auto aligned = [](const void* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; };
  check(aligned(q) && aligned(latent) && aligned(out) && aligned(dout) && aligned(dq) && aligned(d_latent),
        "sparse MLA backward on wgmma: q, the latent, out, dout, dq and d_latent must be 16-byte aligned");
  if (s.tokens == 0) return;
  Args args{};
  static_cast<SparseMlaInputs&>(args) = sparse_mla_inputs(s, q, latent, selected);
  args.out = out;
  args.lse = lse;
  args.dout = dout;
  args.dq = dq;
  args.d_latent = d_latent;
  args.mass = mass;
  const PairLists lists = pair_lists(selected, s.width, s.tokens, kShareLimit, stream);
  args.pairs = lists.view;
  args.tokens = s.tokens;
  // As in the forward: the map claims more rows than any sequence; only selected pools are read.
  const CUtensorMap map =
      bf16_tensor_map_128b(latent, int64_t{1} << 31, s.dk, s.latent_stride, kPoolRows, 64);
  allow_shared_memory(sparse_mla_backward_hopper_kernel, kSharedBytes, "sparse MLA backward on wgmma");
  const dim3 grid(static_cast<unsigned>((s.tokens + 1) / 2),
                  static_cast<unsigned>((s.heads + kHeads - 1) / kHeads));
  launch_kernel(sparse_mla_backward_hopper_kernel, grid, kThreads, kSharedBytes, stream, args, map);
  SPINDLE_LAUNCHED("sparse_mla_backward_hopper_kernel");
}

}  // namespace spindle::cuda
