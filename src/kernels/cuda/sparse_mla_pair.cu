// The sparse MLA backward over pairs of neighbouring queries; see sparse_mla_pair.h for the design
// and sparse_mla.h for the contract. Scores are kept in the log2 domain, as in sparse_mla.cu.
#include <algorithm>
#include <cmath>
#include <sstream>

#include "backend/cuda/check.h"
#include "core/error.h"
#include "kernels/cuda/log2_domain.h"
#include "kernels/cuda/mma.cuh"
#include "kernels/cuda/shared_memory_limit.h"
#include "kernels/cuda/sparse_mla_mma.cuh"
#include "kernels/cuda/sparse_mla_pair.h"
#include "kernels/cuda/sparse_mla_tile.cuh"
#include "kernels/cuda/tma.cuh"

namespace spindle::cuda {

namespace {

using namespace mla;

constexpr int kKeys = 32;              // rows per tile
constexpr int kQueryRows = 32;         // head rows per query: two m16 tiles
constexpr int kRows = 2 * kQueryRows;  // the CTA's head rows
constexpr int kMT = kRows / 16;
constexpr int kProbStride = kKeys + kPad;
constexpr int kPartnerThreads = 256;
constexpr int kLatent = 512;          // dk = dv: the kernel's only instance
constexpr int64_t kMaxWidth = 16384;  // slots fit int16; the first pass's lists fit shared memory
// A warp's S or dP over its part of the reduction, for the owner: [16 warps][2 float4][32 lanes].
constexpr size_t kPartialBytes = kWarps * 2 * 32 * 16;
static_assert(kThreads == 8 * kRows, "delta: 8 threads per head row");

// The first pass's output for pair p (queries 2p, 2p + 1), [pairs][width] each: partner[p][slot], the
// second query's slot holding the row of the first's `slot` (-1: none); own_b[p][i < count_b[p]],
// the second query's slots whose rows the first does not hold, ascending; totals: the second
// queries' own rows and all their rows, summed over the pairs.
struct PairWorkspace {
  unsigned long long* totals;
  int16_t* partner;
  int16_t* own_b;
  int32_t* count_b;
};

constexpr size_t kTotalsBytes = 16;

PairWorkspace pair_workspace(void* base, int64_t pairs, int64_t width) {
  auto* bytes = static_cast<unsigned char*>(base);
  const size_t slots_bytes = static_cast<size_t>(pairs * width) * sizeof(int16_t);
  return {reinterpret_cast<unsigned long long*>(bytes), reinterpret_cast<int16_t*>(bytes + kTotalsBytes),
          reinterpret_cast<int16_t*>(bytes + kTotalsBytes + slots_bytes),
          reinterpret_cast<int32_t*>(bytes + kTotalsBytes + 2 * slots_bytes)};
}

int64_t pair_count(const SparseMlaShape& s) { return (s.tokens + 1) / 2; }

// The position of the calling thread's entry among the CTA's threads whose `flag` is set, in thread
// order, after `base` earlier ones; `total` gets how many are set. Every thread calls it.
__device__ int ordered_position(bool flag, int base, int* warp_counts, int& total) {
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  const unsigned ballot = __ballot_sync(0xffffffffu, flag);
  if (lane == 0) warp_counts[warp] = __popc(ballot);
  __syncthreads();
  int before = base;
  total = 0;
  for (int w = 0; w < kPartnerThreads / 32; ++w) {
    if (w < warp) before += warp_counts[w];
    total += warp_counts[w];
  }
  __syncthreads();  // warp_counts is written again by the next call
  return before + __popc(ballot & ((1u << lane) - 1));
}

// The valid (>= 0) rows of a query's selection `sel` in slot order into rows[], their slots into
// slots[]; returns how many. Every thread calls it.
__device__ int compact_selection(const int32_t* sel, int64_t width, int32_t* rows, int16_t* slots,
                                 int* warp_counts) {
  int count = 0;
  for (int64_t start = 0; start < width; start += kPartnerThreads) {
    const int64_t slot = start + threadIdx.x;
    const int32_t row = slot < width ? sel[slot] : -1;
    int total;
    const int at = ordered_position(row >= 0, count, warp_counts, total);
    if (row >= 0) {
      rows[at] = row;
      slots[at] = static_cast<int16_t>(slot);
    }
    count += total;
  }
  return count;
}

// Where `row` is in rows[0, n) (strictly ascending), or -1.
__device__ int find_row(const int32_t* rows, int n, int32_t row) {
  int lo = 0, hi = n;
  while (lo < hi) {
    const int mid = (lo + hi) / 2;
    if (rows[mid] < row)
      lo = mid + 1;
    else
      hi = mid;
  }
  return lo < n && rows[lo] == row ? lo : -1;
}

// One CTA per pair: the shared rows, when both selections are strictly ascending over their valid
// rows (a repeated or unordered row would otherwise be matched twice); else none.
__global__ void __launch_bounds__(kPartnerThreads)
    sparse_mla_pair_partners_kernel(const int32_t* selected, int64_t tokens, int64_t width, PairWorkspace w) {
  extern __shared__ __align__(16) unsigned char lists[];
  __shared__ int warp_counts[kPartnerThreads / 32];
  int32_t* rows_a = reinterpret_cast<int32_t*>(lists);
  int32_t* rows_b = rows_a + width;
  int16_t* slots_a = reinterpret_cast<int16_t*>(rows_b + width);
  int16_t* slots_b = slots_a + width;
  const int64_t p = blockIdx.x, ta = 2 * p;
  const bool has_b = ta + 1 < tokens;
  int16_t* partner = w.partner + p * width;
  int16_t* own_b = w.own_b + p * width;
  const int na = compact_selection(selected + ta * width, width, rows_a, slots_a, warp_counts);
  const int nb =
      has_b ? compact_selection(selected + (ta + 1) * width, width, rows_b, slots_b, warp_counts) : 0;
  for (int64_t slot = threadIdx.x; slot < width; slot += kPartnerThreads) partner[slot] = -1;
  __syncthreads();  // the lists are complete; partner's -1s precede the matches below
  bool unordered = false;
  for (int i = static_cast<int>(threadIdx.x); i + 1 < na; i += kPartnerThreads)
    unordered |= rows_a[i] >= rows_a[i + 1];
  for (int i = static_cast<int>(threadIdx.x); i + 1 < nb; i += kPartnerThreads)
    unordered |= rows_b[i] >= rows_b[i + 1];
  const bool match = __syncthreads_or(unordered) == 0;
  if (match) {
    for (int i = static_cast<int>(threadIdx.x); i < na; i += kPartnerThreads) {
      const int j = find_row(rows_b, nb, rows_a[i]);
      if (j >= 0) partner[slots_a[i]] = slots_b[j];
    }
  }
  int count = 0;
  for (int start = 0; start < nb; start += kPartnerThreads) {
    const int i = start + static_cast<int>(threadIdx.x);
    const bool own = i < nb && (!match || find_row(rows_a, na, rows_b[i]) < 0);
    int total;
    const int at = ordered_position(own, count, warp_counts, total);
    if (own) own_b[at] = slots_b[i];
    count += total;
  }
  if (threadIdx.x == 0) {
    w.count_b[p] = count;
    atomicAdd(&w.totals[0], static_cast<unsigned long long>(count));
    atomicAdd(&w.totals[1], static_cast<unsigned long long>(nb));
  }
}

struct PairArgs : SparseMlaInputs {
  int64_t tokens;
  const __nv_bfloat16* out;  // the forward's output
  const float* lse;          // the forward's
  const __nv_bfloat16* dout;
  __nv_bfloat16* dq;
  float* d_latent;
  float* mass;
  PairWorkspace w;
};

// A tile row: the latent row and its slot in each query's selection (-1 where the query has it not).
struct TileRow {
  int32_t row, slot_a, slot_b;
};

// Row `lane` of tile `tile` of pair p: tiles < tiles_a walk the first query's slots, the rest the
// second query's own rows (count_b of them).
__device__ __forceinline__ TileRow tile_row(const PairArgs& a, int64_t p, int tiles_a, int count_b, int tile,
                                            int lane) {
  TileRow r{-1, -1, -1};
  if (tile < tiles_a) {
    const int64_t slot = tile * kKeys + lane;
    if (slot < a.width) {
      r.row = a.selected[2 * p * a.width + slot];
      if (r.row >= 0) {
        r.slot_a = static_cast<int32_t>(slot);
        r.slot_b = a.w.partner[p * a.width + slot];
      }
    }
  } else {
    const int64_t i = (tile - tiles_a) * kKeys + lane;
    if (i < count_b) {
      r.slot_b = a.w.own_b[p * a.width + i];
      r.row = a.selected[(2 * p + 1) * a.width + r.slot_b];
    }
  }
  return r;
}

// By one warp: a tile's rows into ring entry `ring`, with its flags (bit 0: the first query has a row
// in it, bit 1: the second).
__device__ __forceinline__ void put_tile_rows(int32_t* rows_s, int32_t* slot_a_s, int32_t* slot_b_s,
                                              int32_t* flags_s, int ring, const TileRow& r, int lane) {
  rows_s[ring * kKeys + lane] = r.row;
  slot_a_s[ring * kKeys + lane] = r.slot_a;
  slot_b_s[ring * kKeys + lane] = r.slot_b;
  const unsigned has_a = __ballot_sync(0xffffffffu, r.slot_a >= 0),
                 has_b = __ballot_sync(0xffffffffu, r.slot_b >= 0);
  if (lane == 0) flags_s[ring] = (has_a != 0 ? 1 : 0) | (has_b != 0 ? 2 : 0);
}

// The backward's shared memory: q, dO, two tiles, P and dS, the warps' partial S and dP, delta and
// lse, the mass by m16 tile, three tiles' rows and slots (two) and flags.
constexpr int kQkStride = kLatent + kPad, kVStride = kLatent + kPad;
constexpr size_t kBackwardSharedBytes =
    kRows * kQkStride * 2 + kRows * kVStride * 2 + 2 * kKeys * kQkStride * 2 + 2 * kRows * kProbStride * 2 +
    kPartialBytes + 2 * kRows * 4 + kMT * kKeys * 4 + 3 * 3 * kKeys * 4 + 16;
static_assert(kBackwardSharedBytes <= 232448, "within Hopper's shared memory per CTA");

void check_workspace(const SparseMlaShape& s, const void* workspace) {
  const std::string why = sparse_mla_pair_unsupported(s);
  check(why.empty(), "sparse MLA over pairs of queries: ", why);
  check(workspace != nullptr && reinterpret_cast<uintptr_t>(workspace) % 8 == 0,
        "sparse MLA over pairs of queries: an 8-byte aligned workspace");
}

size_t partners_shared_bytes(const SparseMlaShape& s) {
  return static_cast<size_t>(s.width) * 2 * (sizeof(int32_t) + sizeof(int16_t));
}

// For the latent of 512 (GLM's kv_lora_rank) as a constant, which keeps dQ's 64 accumulators a thread
// and the rest within 128 registers.
__global__ void __launch_bounds__(kThreads, 1) sparse_mla_pair_backward_kernel(const PairArgs a) {
  constexpr int DK = kLatent, DV = kLatent;
  extern __shared__ __align__(16) unsigned char shared[];
  const int64_t p = blockIdx.x, ta = 2 * p;
  const bool has_b = ta + 1 < a.tokens;
  const int h0 = blockIdx.y * kQueryRows, tid = threadIdx.x, lane = tid % 32, warp = tid / 32, g = lane / 4,
            c = lane % 4;
  constexpr int qk_stride = kQkStride, v_stride = kVStride, k_units = DK / 16;
  __nv_bfloat16* q_s = reinterpret_cast<__nv_bfloat16*>(shared);            // [kRows][qk_stride]
  __nv_bfloat16* do_s = q_s + kRows * qk_stride;                            // [kRows][v_stride]
  __nv_bfloat16* kv_s = do_s + kRows * v_stride;                            // [2][kKeys][qk_stride]
  __nv_bfloat16* p_s = kv_s + 2 * kKeys * qk_stride;                        // [kRows][kProbStride]
  __nv_bfloat16* ds_s = p_s + kRows * kProbStride;                          // [kRows][kProbStride]
  float* partial_s = reinterpret_cast<float*>(ds_s + kRows * kProbStride);  // kPartialBytes
  float* delta_s = partial_s + kPartialBytes / 4;                           // [kRows] rowsum(dO o O)
  float* lse_s = delta_s + kRows;                                           // [kRows] log2 domain
  float* mass_s = lse_s + kRows;                                            // [kMT][kKeys]
  int32_t* rows_s = reinterpret_cast<int32_t*>(mass_s + kMT * kKeys);       // [3][kKeys]
  int32_t* slot_a_s = rows_s + 3 * kKeys;                                   // [3][kKeys]
  int32_t* slot_b_s = slot_a_s + 3 * kKeys;                                 // [3][kKeys]
  int32_t* flags_s = slot_b_s + 3 * kKeys;                                  // [3]

  const int tiles_a = static_cast<int>((a.width + kKeys - 1) / kKeys);
  const int count_b = has_b ? a.w.count_b[p] : 0;
  const int tiles = tiles_a + (count_b + kKeys - 1) / kKeys;
  // The m16 tiles that hold heads: each query's second only past 16 heads.
  const unsigned head_tiles = a.heads - h0 > 16 ? 0xfu : 0x5u;

  load_rows(q_s, a.q, ta, h0, kQueryRows, a.heads, DK, qk_stride);
  load_rows(q_s + kQueryRows * qk_stride, a.q, ta + 1, h0, kQueryRows, a.heads, DK, qk_stride, has_b);
  load_rows(do_s, a.dout, ta, h0, kQueryRows, a.heads, DV, v_stride);
  load_rows(do_s + kQueryRows * v_stride, a.dout, ta + 1, h0, kQueryRows, a.heads, DV, v_stride, has_b);
  if (warp == 0) {
    put_tile_rows(rows_s, slot_a_s, slot_b_s, flags_s, 0, tile_row(a, p, tiles_a, count_b, 0, lane), lane);
    put_tile_rows(rows_s, slot_a_s, slot_b_s, flags_s, 1, tile_row(a, p, tiles_a, count_b, 1, lane), lane);
  }
  __syncthreads();
  if (tiles > 0) load_tile(kv_s, rows_s, kKeys, a.latent, a.latent_stride, DK);
  copy_commit();
  {  // delta = rowsum(dO o O), 8 threads per row
    constexpr int per_row = kThreads / kRows;
    const int row = tid / per_row, part = tid % per_row, head = h0 + row % kQueryRows;
    const int64_t t = ta + row / kQueryRows;
    const bool valid = head < a.heads && (row < kQueryRows || has_b);
    float sum = 0.0f;
    if (valid) {
      const int64_t base = (t * a.heads + head) * DV;
      for (int col = part; col < DV; col += per_row)
        sum += __bfloat162float(a.dout[base + col]) * __bfloat162float(a.out[base + col]);
    }
#pragma unroll
    for (int offset = per_row / 2; offset > 0; offset /= 2) sum += __shfl_xor_sync(0xffffffffu, sum, offset);
    if (part == 0) {
      delta_s[row] = sum;
      lse_s[row] = valid ? a.lse[t * a.heads + head] * kLog2e : INFINITY;
    }
  }
  float dq[kMT][kMaxColTiles][4] = {};

  // Tile i's rows are in buffer i % 2, its rows and slots in ring entry i % 3 (written two tiles
  // ahead, read by the gather a tile ahead, then by the masks, the mass and the reductions); once dQ has read
  // a tile's keys, their buffer stages the rows' gradient 16 rows at a time for the TMA's bulk reductions, as
  // in sparse_mla.cu.
  constexpr int staged_stride = DK + kPad;
  for (int tile = 0; tile < tiles; ++tile) {
    const int buf = tile & 1, ring = tile % 3, next_ring = (tile + 1) % 3;
    copy_wait_all();
    __syncthreads();  // the tile landed; p_s and ds_s are free; ring entry (tile + 2) % 3 too
    const __nv_bfloat16* keys = kv_s + buf * kKeys * qk_stride;
    const int32_t* slot_a = slot_a_s + ring * kKeys;
    const int32_t* slot_b = slot_b_s + ring * kKeys;
    const int flags = flags_s[ring];
    const unsigned m_tiles = head_tiles & ((flags & 1 ? 0x3u : 0u) | (flags & 2 ? 0xcu : 0u));

    // S and dP for the n m16 tiles here (1, 2 or 4) over all 16 warps: the reduction in 4 / n parts,
    // warp w taking part w / (4 n) and in it task t = w % (4 n): the (t % n)-th tile here, keys
    // 16 ((t / n) % 2) .. + 15, product t / (2 n) (S or dP). The warps of S and part 0 (owners) sum
    // the others' results through shared memory and make P and dS.
    const int n = __popc(m_tiles), tasks = 4 * max(n, 1), parts = 4 / max(n, 1);
    const int part = warp / tasks, task = warp % tasks, product = task / (2 * max(n, 1));
    const int key16 = (task / max(n, 1)) % 2 * 16;
    // the (task % n)-th set bit of m_tiles: with n = 2 the lowest or the highest
    const int which = task % max(n, 1);
    const int row_tile = n == 4 ? which : (which == 0 ? __ffs(m_tiles) - 1 : 31 - __clz(m_tiles));
    const bool active = n > 0, owner = product == 0 && part == 0;
    float s[2][4] = {};
    if (active) {
      // From a.dk and a.dv (equal to DK and DV), not the constants: a loop the compiler cannot unroll
      // whole keeps the scores within the registers.
      const int width = (product == 0 ? a.dk : a.dv) / parts, k0 = part * width;
      if (product == 0)
        rows_by_16_keys(s, q_s + row_tile * 16 * qk_stride + k0, qk_stride, keys + key16 * qk_stride + k0,
                        qk_stride, width);
      else
        rows_by_16_keys(s, do_s + row_tile * 16 * v_stride + k0, v_stride, keys + key16 * qk_stride + k0,
                        qk_stride, width);
      if (!owner) {
        float4* to = reinterpret_cast<float4*>(partial_s) + warp * 2 * 32 + lane;
#pragma unroll
        for (int e = 0; e < 2; ++e) to[e * 32] = make_float4(s[e][0], s[e][1], s[e][2], s[e][3]);
      }
    }
    __syncthreads();
    // Warp 15, never an owner, reads tile + 2's rows while the owners make P and dS.
    if (warp == 15)
      put_tile_rows(rows_s, slot_a_s, slot_b_s, flags_s, (tile + 2) % 3,
                    tile_row(a, p, tiles_a, count_b, tile + 2, lane), lane);
    if (active && owner) {
      float dp[2][4] = {};
      const float4* from = reinterpret_cast<const float4*>(partial_s) + lane;
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        if (j >= parts) break;
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          if (j > 0) {  // S of part j
            const float4 x = from[((warp + j * tasks) * 2 + e) * 32];
            s[e][0] += x.x, s[e][1] += x.y, s[e][2] += x.z, s[e][3] += x.w;
          }
          const float4 y = from[((warp + 2 * n + j * tasks) * 2 + e) * 32];  // dP of part j
          dp[e][0] += y.x, dp[e][1] += y.y, dp[e][2] += y.z, dp[e][3] += y.w;
        }
      }
      probabilities_and_gradients<kKeys>(s, dp, row_tile * 16, key16, row_tile < 2 ? slot_a : slot_b, lse_s,
                                         delta_s, a.scale2, a.scale, p_s, ds_s,
                                         a.mass != nullptr ? mass_s + row_tile * kKeys : nullptr);
    }
    if (tid == 0) bulk_wait_read<0>();  // the previous tile's gradient has left the other buffer
    __syncthreads();
    if (tile + 1 < tiles)
      load_tile(kv_s + (buf ^ 1) * kKeys * qk_stride, rows_s + next_ring * kKeys, kKeys, a.latent,
                a.latent_stride, DK);
    copy_commit();
    if (a.mass != nullptr && tid < 2 * kKeys) {
      // One add per slot of each query: with one CTA per pair (heads <= 32) it lands on the caller's
      // zero alone, so the sum is deterministic.
      const int query = tid / kKeys, key = tid % kKeys;
      const int32_t slot = (query == 0 ? slot_a : slot_b)[key];
      if (slot >= 0) {  // the query's m16 tiles with heads made the sums
        float column = 0.0f;
#pragma unroll
        for (int m = 0; m < 2; ++m)
          if (m_tiles >> (2 * query + m) & 1) column += mass_s[(2 * query + m) * kKeys + key];
        atomicAdd(a.mass + (ta + query) * a.width + slot, column);
      }
    }

    // dQ += dS K over the warp's dk columns, for the m16 tiles with rows here.
    probs_times_values<kMT, kKeys>(dq, ds_s, keys, qk_stride, k_units, m_tiles);
    __syncthreads();  // nobody reads the keys any more
    float* staged = reinterpret_cast<float*>(kv_s + buf * kKeys * qk_stride);

    // The rows' gradient, [32 keys, dk] = dS^T Q + P^T dO (the value part: columns < dv), 16 keys
    // at a time (one m16 tile), the warp's dk columns, over the head rows of the m16 tiles here.
    const GradientOperands ops = gradient_operands<kKeys>(ds_s, p_s, q_s, qk_stride, do_s, v_stride);
#pragma unroll 1
    for (int half = 0; half < kKeys / 16; ++half) {
      float dl[kMaxColTiles][4] = {};
#pragma unroll
      for (int k = 0; k < kRows; k += 16) {
        if (!(m_tiles >> (k / 16) & 1)) continue;
        uint32_t ads[4], ap[4];
        ldmatrix_x4_trans(ads, ops.ds + (k * kProbStride + half * 16) * 2);
        ldmatrix_x4_trans(ap, ops.p + (k * kProbStride + half * 16) * 2);
#pragma unroll
        for (int j = 0; j < kMaxColTiles; j += 2) {
          if (warp + kWarps * (j / 2) >= k_units) break;
          uint32_t b[4];
          ldmatrix_x4_trans(b, ops.q + (k * qk_stride + tile_column(j)) * 2);
          mma_bf16(dl[j], ads, b[0], b[1]);
          mma_bf16(dl[j + 1], ads, b[2], b[3]);
          if (tile_column(j) < DV) {  // dv is a multiple of 16: both n8 tiles or neither
            ldmatrix_x4_trans(b, ops.dout + (k * v_stride + tile_column(j)) * 2);
            mma_bf16(dl[j], ap, b[0], b[1]);
            mma_bf16(dl[j + 1], ap, b[2], b[3]);
          }
        }
      }
      if (half > 0) {  // the first half's rows have left the buffer
        if (tid == 0) bulk_wait_read<0>();
        __syncthreads();
      }
#pragma unroll
      for (int rh = 0; rh < 2; ++rh) {
        float* dst = staged + (g + 8 * rh) * staged_stride + 2 * c;
#pragma unroll
        for (int j = 0; j < kMaxColTiles; ++j) {
          if (warp + kWarps * (j / 2) >= k_units) break;
          *reinterpret_cast<float2*>(dst + tile_column(j)) = make_float2(dl[j][2 * rh], dl[j][2 * rh + 1]);
        }
      }
      fence_async_shared();
      __syncthreads();
      if (tid == 0) {
        for (int r = 0; r < 16; ++r) {
          const int32_t index = rows_s[ring * kKeys + half * 16 + r];
          if (index >= 0)
            bulk_reduce_add(a.d_latent + static_cast<int64_t>(index) * a.latent_stride,
                            staged + r * staged_stride, DK * 4);
        }
        bulk_commit();
      }
    }
  }
  if (tid == 0) bulk_wait_all();  // the shared memory stays the CTA's until the last reads

#pragma unroll
  for (int m = 0; m < kMT; ++m) {
    const int query = m / 2;
    if (query == 1 && !has_b) continue;
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      const int row = m * 16 + g + 8 * half, head = h0 + row % kQueryRows;
      if (head >= a.heads) continue;
      __nv_bfloat16* dst = a.dq + ((ta + query) * a.heads + head) * DK + 2 * c;
#pragma unroll
      for (int j = 0; j < kMaxColTiles; ++j) {
        if (warp + kWarps * (j / 2) >= k_units) break;
        *reinterpret_cast<uint32_t*>(dst + tile_column(j)) =
            pack_bf16(dq[m][j][2 * half], dq[m][j][2 * half + 1]);
      }
    }
  }
}

}  // namespace

std::string sparse_mla_pair_unsupported(const SparseMlaShape& s) {
  std::string why = sparse_mla_unsupported(s);
  if (!why.empty()) return why;
  std::ostringstream out;
  if (s.dk != kLatent || s.dv != kLatent)
    out << "dk " << s.dk << " and dv " << s.dv << " are not the latent's " << kLatent << " it is built for";
  else if (s.width > kMaxWidth)
    out << "width " << s.width << " over " << kMaxWidth;
  return out.str();
}

size_t sparse_mla_pair_workspace_bytes(const SparseMlaShape& s) {
  if (!sparse_mla_pair_unsupported(s).empty()) return 0;
  const auto pairs = static_cast<size_t>(pair_count(s));
  return kTotalsBytes + pairs * static_cast<size_t>(s.width) * 2 * sizeof(int16_t) + pairs * sizeof(int32_t);
}

double sparse_mla_pair_partners(const SparseMlaShape& s, const int32_t* selected, void* workspace,
                                cudaStream_t stream) {
  check_workspace(s, workspace);
  if (s.tokens == 0) return 0.0;
  const int64_t pairs = pair_count(s);
  const PairWorkspace w = pair_workspace(workspace, pairs, s.width);
  SPINDLE_CUDA(cudaMemsetAsync(w.totals, 0, kTotalsBytes, stream));
  const size_t list_bytes = partners_shared_bytes(s);
  allow_shared_memory(sparse_mla_pair_partners_kernel, list_bytes, "sparse_mla_pair_partners_kernel: width ",
                      s.width);
  sparse_mla_pair_partners_kernel<<<static_cast<unsigned>(pairs), kPartnerThreads, list_bytes, stream>>>(
      selected, s.tokens, s.width, w);
  SPINDLE_LAUNCHED("sparse_mla_pair_partners_kernel");
  unsigned long long totals[2] = {};
  SPINDLE_CUDA(cudaMemcpyAsync(totals, w.totals, kTotalsBytes, cudaMemcpyDeviceToHost, stream));
  SPINDLE_CUDA(cudaStreamSynchronize(stream));
  return totals[1] > 0 ? 1.0 - static_cast<double>(totals[0]) / static_cast<double>(totals[1]) : 0.0;
}

void sparse_mla_backward_pairs(const SparseMlaShape& s, const __nv_bfloat16* q, const __nv_bfloat16* latent,
                               const int32_t* selected, const __nv_bfloat16* out, const float* lse,
                               const __nv_bfloat16* dout, __nv_bfloat16* dq, float* d_latent, float* mass,
                               const void* workspace, cudaStream_t stream) {
  check_workspace(s, workspace);
  check(reinterpret_cast<uintptr_t>(q) % 16 == 0 && reinterpret_cast<uintptr_t>(latent) % 16 == 0 &&
            reinterpret_cast<uintptr_t>(dout) % 16 == 0,
        "sparse MLA backward over pairs: q, the latent and dout must be 16-byte aligned (cp.async)");
  if (s.tokens == 0) return;
  const int64_t pairs = pair_count(s);
  PairArgs args{};
  static_cast<SparseMlaInputs&>(args) = sparse_mla_inputs(s, q, latent, selected);
  args.tokens = s.tokens;
  args.out = out;
  args.lse = lse;
  args.dout = dout;
  args.dq = dq;
  args.d_latent = d_latent;
  args.mass = mass;
  args.w = pair_workspace(const_cast<void*>(workspace), pairs, s.width);
  allow_shared_memory(sparse_mla_pair_backward_kernel, kBackwardSharedBytes,
                      "sparse_mla_pair_backward_kernel");
  const dim3 grid(static_cast<unsigned>(pairs),
                  static_cast<unsigned>((s.heads + kQueryRows - 1) / kQueryRows));
  sparse_mla_pair_backward_kernel<<<grid, kThreads, kBackwardSharedBytes, stream>>>(args);
  SPINDLE_LAUNCHED("sparse_mla_pair_backward_kernel");
}

}  // namespace spindle::cuda
