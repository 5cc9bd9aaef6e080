// What the fused union-form kernels share (union_attention_hopper.cu: the forward;
// union_attention_backward_hopper.cu: the backward): a CTA's 64 queries or keys of one head, tiles
// of 64 keys, and the two products they run on wgmma.
//
// Shared memory holds [64 rows][128 values] bf16 matrices (Q, dO, a tile's K or V) as two halves of
// 64 values in the 128-byte swizzled layout (wgmma.cuh), written by the TMA (a 64 x 64 box a half).
// A product over the 128 values reads both operands K-major; a product over the 64 rows reads the
// second MN-major, with the first (P or dS) from registers: so one layout serves every product.
#pragma once

#include <cuda.h>
#include <cuda_bf16.h>

#include <cstdint>

#include "kernels/cuda/mma.cuh"
#include "kernels/cuda/tma.cuh"
#include "kernels/cuda/union_attention_hopper.h"
#include "kernels/cuda/wgmma.cuh"

namespace spindle::cuda::union_tile {

using bf16 = __nv_bfloat16;

constexpr int kThreads = 128;                 // one warpgroup
constexpr int kRows = 64;                     // a CTA's queries or keys: the products' M
constexpr int kKeys = 64;                     // a tile's keys
constexpr int kDim = 128;                     // the heads' key and value width
constexpr int kHalfBytes = kKeys * 128;       // 64 rows of 64 values: one swizzled half
constexpr int kMatrixBytes = 2 * kHalfBytes;  // 64 rows of 128 values
// A block's tails: the window of two tiles [p0 - kTailReach, p0 + kKeys) around its first query's
// position p0 holds every tail token of its queries where those lie at most kTailReach before them.
constexpr int kTailTiles = 2;
constexpr int kTailReach = kKeys;

// The chunk's union and tails as the kernels see them (union_attention.h's layouts): queries
// q_begin .. q_end, the union's keys and values [union_count, heads 2 kDim] and the tails' for
// positions tail_low .. tail_high.
struct Tiles {
  const bf16 *union_kv, *tail_kv;
  const uint32_t* masks;
  const int32_t* selected;
  int64_t q_begin, q_end, heads, width, pooled, words, union_count, union_tiles, first, tail_low, tail_high;
};

// The matrices the kernels read by the TMA, in boxes of 64 rows and 64 values (one swizzled half):
// q and dout [queries, heads kDim] (the chunk's), the union's and the tails' keys and values [rows,
// heads 2 kDim]. Rows past a map's end, and the tails' before its first row, read as zero.
struct Maps {
  CUtensorMap q, dout, union_kv, tail_kv;
};
Maps union_fused_maps(const Tiles& t, const bf16* q, const bf16* dout);

// 64 rows from row y, values x .. x + 127 of the map's matrix: two boxes into the halves at dst,
// counted on bar (kMatrixBytes).
__device__ __forceinline__ void load_matrix(unsigned char* dst, const CUtensorMap* map, int x, int64_t y,
                                            uint64_t* bar) {
  tma_load_2d(dst, map, x, static_cast<int>(y), bar);
  tma_load_2d(dst + kHalfBytes, map, x + 64, static_cast<int>(y), bar);
}

// Rows q0 .. q0 + 63 of head h of q or dout (rows past the chunk zero; those past q_end the
// kernels mask), counted on bar.
__device__ __forceinline__ void load_rows(const CUtensorMap* map, unsigned char* dst, int64_t q0, int h,
                                          uint64_t* bar) {
  load_matrix(dst, map, h * kDim, q0, bar);
}

// Where tile `tile`'s rows are: union tiles by their index in the union's map, then the two of the
// tail window starting at `window` in the tails' map.
struct TileRows {
  const CUtensorMap* map;
  int64_t y;
};
__device__ __forceinline__ TileRows tile_rows(const Tiles& t, const Maps& m, int64_t tile, int64_t window) {
  if (tile < t.union_tiles) return {&m.union_kv, tile * kKeys};
  return {&m.tail_kv, window + (tile - t.union_tiles) * kKeys - t.tail_low};
}

// Tile `tile`'s keys (at dst) and values (dst + kMatrixBytes) of head h; 2 kMatrixBytes counted
// on bar.
__device__ __forceinline__ void load_keys(const Tiles& t, const Maps& m, unsigned char* dst, int64_t tile,
                                          int64_t window, int h, uint64_t* bar) {
  const TileRows r = tile_rows(t, m, tile, window);
  load_matrix(dst, r.map, h * 2 * kDim, r.y, bar);
  load_matrix(dst + kMatrixBytes, r.map, h * 2 * kDim + kDim, r.y, bar);
}

// Union tile `tile`'s two mask words of queries q0 .. q0 + 63, [query][2], one copy a thread.
__device__ __forceinline__ void load_mask_words(const Tiles& t, uint32_t* dst, int64_t tile, int64_t q0) {
  static_assert(kRows * 2 == kThreads, "one mask word a thread");
  const int64_t query = q0 + threadIdx.x / 2, word = 2 * tile + threadIdx.x % 2;
  const bool valid = query < t.q_end && word < t.words;
  copy4(dst + threadIdx.x, valid ? t.masks + query * t.words + word : t.masks, valid);
}

// Query `query`'s tail slots as bits over its block's tail window (4 words; none past q_end).
__device__ __forceinline__ void tail_bits(const Tiles& t, int64_t query, int64_t window,
                                          uint32_t (&bits)[4]) {
#pragma unroll
  for (int w = 0; w < 4; ++w) bits[w] = 0;
  if (query >= t.q_end) return;
  for (int64_t k = t.pooled; k < t.width; ++k) {
    const int32_t token = t.selected[query * t.width + k];
    if (token < 0) continue;
    const int64_t d = token - window;
    if (d < 0 || d >= kTailTiles * kKeys) __trap();  // beyond kTailReach: union_fused_unsupported's promise
    const uint32_t bit = 1u << (d % 32);
    // Constant indices keep the words in registers.
    bits[0] |= d / 32 == 0 ? bit : 0u;
    bits[1] |= d / 32 == 1 ? bit : 0u;
    bits[2] |= d / 32 == 2 ? bit : 0u;
    bits[3] |= d / 32 == 3 ? bit : 0u;
  }
}

// Whether any of queries q0 .. q0 + 63 has a bit in union tile `tile` (the same in the warp).
__device__ __forceinline__ bool any_bit(const Tiles& t, int64_t q0, int64_t tile) {
  const int lane = threadIdx.x % 32;
  uint32_t any = 0;
#pragma unroll
  for (int k = 0; k < 2; ++k) {
    const int64_t query = q0 + lane + 32 * k;
    if (query >= t.q_end) continue;
    any |= t.masks[query * t.words + 2 * tile];
    if (2 * tile + 1 < t.words) any |= t.masks[query * t.words + 2 * tile + 1];
  }
  return __any_sync(0xffffffffu, any != 0);
}

// list[0 .. n) holds flags (warp 0 alone): compacted in place to the indices of the set ones,
// returned. A round reads its 32 flags before it writes at or below them.
__device__ __forceinline__ int compact_flags(int32_t* list, int64_t n) {
  const int lane = threadIdx.x % 32;
  int count = 0;
  for (int64_t base = 0; base < n; base += 32) {
    const int64_t i = base + lane;
    const bool set = i < n && list[i] != 0;
    const uint32_t ballot = __ballot_sync(0xffffffffu, set);
    if (set) list[count + __popc(ballot & ((1u << lane) - 1))] = static_cast<int32_t>(i);
    count += __popc(ballot);
  }
  return count;
}

constexpr int kStages = 2;  // the tiles' (or blocks') buffers in flight

// A CTA's mbarriers for the TMA's loads: each of its S stages' (or slots'), then the CTA's own rows'.
template <int S>
struct StageBarriers {
  static constexpr int kStages = S;
  uint64_t bars[kStages + 1];
  __device__ void init() {
    if (threadIdx.x == 0) {
      for (uint64_t& b : bars) mbarrier_init(&b, 1);
      mbarrier_init_fence();
    }
    __syncthreads();
  }
  __device__ uint64_t* stage(int i) { return &bars[i % kStages]; }
  __device__ uint32_t parity(int i) const { return (i / kStages) % 2; }
  __device__ uint64_t* own() { return &bars[kStages]; }
};
using Barriers = StageBarriers<kStages>;

// A stage of dq's loop: a tile's K, V, then its mask words (512 bytes); 1024-aligned.
constexpr int kTileStageBytes = 2 * kMatrixBytes + 1024;

// Tile `tile` into a stage: its keys and values by the TMA (thread 0, counted on bar), a union
// tile's mask words of queries q0 .. q0 + 63 by cp.async.
__device__ __forceinline__ void load_tile_stage(const Tiles& t, const Maps& m, unsigned char* stage,
                                                int64_t tile, int64_t window, int h, int64_t q0,
                                                uint64_t* bar) {
  if (threadIdx.x == 0) {
    mbarrier_arrive_expect(bar, 2 * kMatrixBytes);
    load_keys(t, m, stage, tile, window, h, bar);
  }
  if (tile < t.union_tiles)
    load_mask_words(t, reinterpret_cast<uint32_t*>(stage + 2 * kMatrixBytes), tile, q0);
}

// The tiles a CTA attends to, into list (their count returned, the same in every thread): the
// union's tiles where any of its queries has a bit, then the tail tiles where any has one.
__device__ __forceinline__ int live_tiles(const Tiles& t, int64_t q0, const uint32_t (&tails)[2][4],
                                          int32_t* list, int* count_s) {
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  for (int64_t tile = warp; tile < t.union_tiles; tile += kThreads / 32) {
    const bool live = any_bit(t, q0, tile);
    if (lane == 0) list[tile] = live;
  }
  const bool tail0 = __syncthreads_or((tails[0][0] | tails[0][1] | tails[1][0] | tails[1][1]) != 0);
  const bool tail1 = __syncthreads_or((tails[0][2] | tails[0][3] | tails[1][2] | tails[1][3]) != 0);
  if (warp == 0) {
    int count = compact_flags(list, t.union_tiles);
    if (lane == 0) {
      if (tail0) list[count++] = static_cast<int32_t>(t.union_tiles);
      if (tail1) list[count++] = static_cast<int32_t>(t.union_tiles + 1);
      *count_s = count;
    }
  }
  __syncthreads();
  return *count_s;
}

// This thread's two rows' bits over tile `tile` (wgmma.cuh's rows 16 warp + lane / 4 + 8 hh): a
// union tile's from the stage's words [query][2], a tail tile's from the rows' tail bits.
__device__ __forceinline__ void tile_bits(const Tiles& t, const uint32_t* words,
                                          const uint32_t (&tails)[2][4], int64_t tile,
                                          uint32_t (&bits)[2][2]) {
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
#pragma unroll
  for (int hh = 0; hh < 2; ++hh) {
    if (tile < t.union_tiles) {
      const int row = 16 * warp + lane / 4 + 8 * hh;
      bits[hh][0] = words[2 * row];
      bits[hh][1] = words[2 * row + 1];
    } else {
      const bool second = tile > t.union_tiles;
      bits[hh][0] = second ? tails[hh][2] : tails[hh][0];
      bits[hh][1] = second ? tails[hh][3] : tails[hh][1];
    }
  }
}

// d = A B^T over the 128 values, A and B [64 rows][128] at a and b (K-major). Not committed.
__device__ __forceinline__ void product_over_values(float (&d)[32], uint32_t a, uint32_t b) {
  const uint64_t da = wgmma_descriptor_128b(a, 16, 1024), db = wgmma_descriptor_128b(b, 16, 1024);
#pragma unroll
  for (int k = 0; k < kDim / 16; ++k) {
    const uint32_t step = k / 4 * kHalfBytes + k % 4 * 32;
    wgmma_m64n64k16(d, wgmma_descriptor_plus(da, step), wgmma_descriptor_plus(db, step), k > 0);
  }
}

// d += P B over 64 rows, P [64 x 64] as A fragments, B [64 rows][128] at b (MN-major): d[half] its
// 64-value halves. Not committed.
__device__ __forceinline__ void product_over_rows(float (&d)[2][32], const uint32_t (&p)[4][4], uint32_t b) {
  const uint64_t db = wgmma_descriptor_128b(b, kHalfBytes, 1024);
#pragma unroll
  for (int half = 0; half < 2; ++half) {
#pragma unroll
    for (int k = 0; k < kKeys / 16; ++k)
      wgmma_m64n64k16_rs<1>(d[half], p[k], wgmma_descriptor_plus(db, half * kHalfBytes + k * 16 * 128), true);
  }
}

// Whether the score at accumulator index j (wgmma.cuh's layout) is selected: bits [2][2] the two
// rows' words over the tile's 64 columns.
__device__ __forceinline__ bool column_bit(const uint32_t (&bits)[2][2], int j) {
  const int col = 8 * (j / 4) + 2 * (threadIdx.x % 4) + j % 2;
  return (bits[(j / 2) % 2][col / 32] >> (col % 32)) & 1u;
}

// This thread's two rows of a [64, 128] accumulator (product_over_rows' layout: rows row0 and
// row0 + 8, hh = 0 and 1) into out [queries, heads, 128] at head h as bf16, each row times its
// scale; rows past t.q_end are not written.
__device__ __forceinline__ void store_rows(const Tiles& t, const float (&acc)[2][32], const float (&scale)[2],
                                           int64_t row0, int h, bf16* out) {
  const int lane = threadIdx.x % 32;
#pragma unroll
  for (int hh = 0; hh < 2; ++hh) {
    const int64_t query = row0 + 8 * hh;
    if (query >= t.q_end) continue;
    bf16* dst = out + (query * t.heads + h) * kDim;
#pragma unroll
    for (int b = 0; b < 2; ++b) {
#pragma unroll
      for (int jj = 0; jj < 8; ++jj) {
        const int j = 4 * jj + 2 * hh;
        *reinterpret_cast<__nv_bfloat162*>(dst + 64 * b + 8 * jj + 2 * (lane % 4)) =
            __floats2bfloat162_rn(acc[b][j] * scale[hh], acc[b][j + 1] * scale[hh]);
      }
    }
  }
}

// The shared memory at p rounded up to 1024 bytes (the swizzled layout's alignment).
__device__ __forceinline__ unsigned char* align_1024(unsigned char* p) {
  return reinterpret_cast<unsigned char*>((reinterpret_cast<uintptr_t>(p) + 1023) & ~uintptr_t{1023});
}

// The kernels' view of queries q_begin .. q_end (fails where the shape is unsupported).
Tiles union_fused_tiles(const UnionAttentionShape& s, const ChunkUnion& u, const bf16* union_kv,
                        const bf16* tail_kv, const TailRows& tail, int64_t q_begin, int64_t q_end,
                        const int32_t* selected);

}  // namespace spindle::cuda::union_tile
