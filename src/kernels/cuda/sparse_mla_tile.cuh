// What the sparse MLA kernels share: the inputs and sizes of a call (sparse_mla.cu and
// sparse_mla_hopper.cu), and for the wgmma forward the selected rows of one 64-row tile of a
// query's selection (which rows a thread copies, and the copy into the 128-byte swizzled layout,
// by TMA for whole pools of consecutive rows and by cp.async for the rest).
#pragma once

#include <cuda.h>
#include <cuda_bf16.h>

#include <cstdint>

#include "kernels/cuda/log2_domain.h"
#include "kernels/cuda/mma.cuh"
#include "kernels/cuda/sparse_mla.h"
#include "kernels/cuda/sparse_mla_pairs.h"
#include "kernels/cuda/tma.cuh"
#include "kernels/cuda/wgmma.cuh"

namespace spindle::cuda {

constexpr int kTileKeys = 64;  // selected rows per tile

// The inputs and sizes every kernel of a call reads; each kernel's arguments add its outputs.
struct SparseMlaInputs {
  const __nv_bfloat16* q;
  const __nv_bfloat16* latent;
  const int32_t* selected;
  int64_t width, latent_stride;
  int heads, dk, dv;
  float scale, scale2;  // scale2 = scale * log2(e): scores in the log2 domain, exp2_ftz one instruction
};

inline SparseMlaInputs sparse_mla_inputs(const SparseMlaShape& s, const __nv_bfloat16* q,
                                         const __nv_bfloat16* latent, const int32_t* selected) {
  SparseMlaInputs in{};
  in.q = q;
  in.latent = latent;
  in.selected = selected;
  in.width = s.width;
  in.latent_stride = s.latent_stride;
  in.heads = static_cast<int>(s.heads);
  in.dk = static_cast<int>(s.dk);
  in.dv = static_cast<int>(s.dv);
  in.scale = s.scale;
  in.scale2 = s.scale * kLog2e;
  return in;
}

// The selected rows thread `thread` gathers for `tile` of query t's selection ([width] int32 at
// selected + t * width): row 8 g + thread % 8 of each 8-row group g (-1 past the width), and, for
// thread < kTileKeys, row `thread` (kept for the masks and the atomics).
struct TileRows {
  int32_t gather[8];
  int32_t own;
};

__device__ __forceinline__ TileRows tile_rows(const int32_t* selected, int64_t width, int64_t t, int64_t tile,
                                              int thread) {
  TileRows r;
  const int32_t* sel = selected + t * width;
#pragma unroll
  for (int g = 0; g < 8; ++g) {
    const int64_t slot = tile * kTileKeys + 8 * g + thread % 8;
    r.gather[g] = slot < width ? sel[slot] : -1;
  }
  const int64_t slot = tile * kTileKeys + thread;
  r.own = thread < kTileKeys && slot < width ? sel[slot] : -1;
  return r;
}

// A tile of a pair's list (sparse_mla_pairs.h): the rows to gather without the queries' marks.
__device__ __forceinline__ void strip_marks(TileRows& r) {
#pragma unroll
  for (int g = 0; g < 8; ++g) r.gather[g] = r.gather[g] >= 0 ? r.gather[g] & kRowMask : -1;
}

constexpr int kPoolRows = 16;                        // a run of consecutive rows that one TMA box moves
constexpr int kSwizzleBlockBytes = kTileKeys * 128;  // a tile's 64 values of every row, 128 bytes each

// A tile's rows (their values 64 block_begin .. 64 block_end - 1, rows `stride` apart) into `dst`
// (1024-byte aligned) in the 128-byte swizzled K-major layout wgmma reads: column block b (values
// 64 b ..) at b * kSwizzleBlockBytes, row r at r * 128 in it, its 16-byte piece p at (p ^ r % 8) * 16
// (the TMA's own swizzle). By the warpgroup's 128 threads. Slots 16 j .. 16 j + 15 that hold 16
// consecutive rows (a whole pool of the indexer's selection) arrive by TMA, issued by thread 0 and
// counted on `bar` (armed here with their bytes: one arrival per fill, also when no pool comes so);
// every other row by cp.async, zero for unused slots. `map` is the latent's, boxes of 16 rows x 64
// values. The reader waits for the cp.async group and for bar's phase.
__device__ __forceinline__ void fill_tile_blocks(unsigned char* dst, const TileRows& r,
                                                 const __nv_bfloat16* latent, int64_t stride, int block_begin,
                                                 int block_end, int thread, const CUtensorMap* map,
                                                 uint64_t* bar) {
  constexpr int kPools = kTileKeys / kPoolRows;
  const int row8 = thread % 8;
  // Lanes l, l + 8, l + 16, l + 24 hold the same rows, lanes 0-7 all 64: every warp sees each run.
  bool run[kPools], runs = true;
  int32_t first[kPools];
#pragma unroll
  for (int j = 0; j < kPools; ++j) {
    first[j] = __shfl_sync(0xffffffffu, r.gather[2 * j], 0);
    const bool consecutive = r.gather[2 * j] == first[j] + row8 && r.gather[2 * j + 1] == first[j] + 8 + row8;
    run[j] = __all_sync(0xffffffffu, first[j] >= 0 && consecutive);
    runs = runs && run[j];
  }
  if (thread == 0) {
    uint32_t bytes = 0;
#pragma unroll
    for (int j = 0; j < kPools; ++j) bytes += run[j] ? kPoolRows * (block_end - block_begin) * 128 : 0;
    mbarrier_arrive_expect(bar, bytes);
#pragma unroll
    for (int j = 0; j < kPools; ++j) {
      if (!run[j]) continue;
      for (int b = block_begin; b < block_end; ++b)
        tma_load_2d(dst + b * kSwizzleBlockBytes + j * kPoolRows * 128, map, 64 * b, first[j], bar);
    }
  }
  // Whole pools only (a trained indexer's selections, mostly): one branch past the unrolled copies,
  // whose jumps group by group missed the instruction cache (the heads-as-M forward, ncu).
  if (runs) return;
#pragma unroll
  for (int g = 0; g < 8; ++g) {
    if (run[g / 2]) continue;
    const int row = 8 * g + row8;
    const bool valid = r.gather[g] >= 0;
    const __nv_bfloat16* from = latent + (valid ? static_cast<int64_t>(r.gather[g]) * stride : 0);
    unsigned char* to = dst + row * 128;
    for (int p = 8 * block_begin + thread / 8; p < 8 * block_end; p += 16)
      copy16(to + (p / 8) * kSwizzleBlockBytes + ((p % 8) ^ (row % 8)) * 16, from + p * 8, valid);
  }
}

// The whole tile: its rows' first dk values (a multiple of 64).
__device__ __forceinline__ void fill_tile(unsigned char* dst, const TileRows& r, const __nv_bfloat16* latent,
                                          int64_t stride, int dk, int thread, const CUtensorMap* map,
                                          uint64_t* bar) {
  fill_tile_blocks(dst, r, latent, stride, 0, dk / 64, thread, map, bar);
}

// s = K R^T [64 keys, Rows rows] over dk (a multiple of 64): the tile (fill_tile's layout) as A,
// read K-major; the Rows (32 or 64) rows of R (core matrices, 8 rows every row_group_bytes) as B. By
// one warpgroup, complete on return.
template <int Rows>
__device__ __forceinline__ void tile_times_rows(float (&s)[Rows / 2], uint32_t tile_address,
                                                uint32_t rows_address, int dk, uint32_t row_group_bytes) {
  static_assert(Rows == 32 || Rows == 64, "wgmma's N here: 32 or 64 rows");
  wgmma_hold(s);  // written before the fence, not sunk past it
  const uint64_t tile = wgmma_descriptor_128b(tile_address, 16, 1024),
                 rows = wgmma_descriptor(rows_address, 128, row_group_bytes);
  for (int k = 0; k < dk / 16; k += 4) {
    wgmma_fence();
#pragma unroll
    for (int kk = k; kk < k + 4; ++kk) {
      const uint64_t a = wgmma_descriptor_plus(tile, kk / 4 * kSwizzleBlockBytes + kk % 4 * 32),
                     b = wgmma_descriptor_plus(rows, kk * 256);
      if constexpr (Rows == 32)
        wgmma_m64n32k16<0>(s, a, b, kk > 0);
      else
        wgmma_m64n64k16(s, a, b, kk > 0);
    }
  }
  wgmma_commit();
  wgmma_wait<0>();
  wgmma_hold(s);
}

}  // namespace spindle::cuda
