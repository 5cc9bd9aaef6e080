// The selected rows of one 64-row tile of a query's selection, as both wgmma sparse MLA kernels
// gather them (sparse_mla_hopper.cu, sparse_mla_backward_hopper.cu): which rows a thread copies,
// and the copy into the no-swizzle core-matrix layout (wgmma.cuh) with cp.async.
#pragma once

#include <cuda_bf16.h>

#include <cstdint>

#include "kernels/cuda/mma.cuh"

namespace spindle::cuda {

constexpr int kTileKeys = 64;  // selected rows per tile

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

// A tile's rows (their first dk values of the latent, rows `stride` apart) into `dst` in the
// core-matrix layout, zero for unused slots, by Threads threads: thread i copies the 16-byte pieces
// i / 8, i / 8 + Threads / 8, .. of row 8 g + i % 8, so that a warp fills contiguous bytes.
template <int Threads>
__device__ __forceinline__ void gather_tile(unsigned char* dst, const TileRows& r,
                                            const __nv_bfloat16* latent, int64_t stride, int dk, int thread) {
  const int chunks = dk / 8;
#pragma unroll
  for (int g = 0; g < 8; ++g) {
    const bool valid = r.gather[g] >= 0;
    const __nv_bfloat16* from = latent + (valid ? static_cast<int64_t>(r.gather[g]) * stride : 0);
    unsigned char* to = dst + g * chunks * 128 + (thread % 8) * 16;
    for (int c = thread / 8; c < chunks; c += Threads / 8) copy16(to + c * 128, from + c * 8, valid);
  }
}

}  // namespace spindle::cuda
