// The sparse MLA forward on Hopper's warpgroup MMA (wgmma): sparse_mla_forward's contract
// (sparse_mla.h), for the shapes sparse_mla_hopper_takes() accepts; sparse_mla_forward dispatches
// here.
//
// One CTA per (query, group of up to 32 heads), two warpgroups that take the selection's 64-row
// tiles in turn, each with its own tile buffer, online softmax and output accumulators, merged at
// the end. Per tile a warpgroup fills its buffer in the 128-byte swizzled layout, whole pools of
// consecutive rows by TMA and the other rows by cp.async (fill_tile, sparse_mla_tile.cuh), and
// computes S^T = K Q^T (M = 64 keys, N = 32 heads, K = dk), the
// softmax over each head's column, P^T to shared memory, and O^T += V^T P^T (M = 64 value columns a
// block, N = 32 heads, K = 64 keys; the tile's rows read transposed as V^T). The other warpgroup's
// gathers overlap one's arithmetic.
//
// The backward stays on mma.sync (sparse_mla.cu): a wgmma backward measured no faster when both
// were bound by DRAM on the latent gradient's fp32 atomics (docs/PERF.md).
#pragma once

#include "kernels/cuda/sparse_mla.h"

namespace spindle::cuda {

// dk and dv multiples of 64, dv <= dk <= 512 (shared memory); the rest as
// sparse_mla_unsupported.
bool sparse_mla_hopper_takes(const SparseMlaShape& s);

void sparse_mla_forward_hopper(const SparseMlaShape& s, const __nv_bfloat16* q, const __nv_bfloat16* latent,
                               const int32_t* selected, __nv_bfloat16* out, float* lse, cudaStream_t stream);

}  // namespace spindle::cuda
