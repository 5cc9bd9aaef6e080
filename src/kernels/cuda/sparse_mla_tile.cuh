// What the sparse MLA kernels share: the inputs and sizes of a call (sparse_mla.cu and
// sparse_mla_hopper.cu), and for the wgmma forward the selected rows of one 64-row tile of a
// query's selection (which rows a thread copies, and the copy into the no-swizzle core-matrix
// layout of wgmma.cuh with cp.async).
#pragma once

#include <cuda_bf16.h>

#include <cstdint>

#include "kernels/cuda/mma.cuh"
#include "kernels/cuda/sparse_mla.h"

namespace spindle::cuda {

constexpr int kTileKeys = 64;  // selected rows per tile
constexpr float kLog2e = 1.4426950408889634f;

// The inputs and sizes every kernel of a call reads; each kernel's arguments add its outputs.
struct SparseMlaInputs {
  const __nv_bfloat16* q;
  const __nv_bfloat16* latent;
  const int32_t* selected;
  int64_t width, latent_stride;
  int heads, dk, dv;
  float scale, scale2;  // scale2 = scale * log2(e): scores in the log2 domain, exp2f one instruction
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
