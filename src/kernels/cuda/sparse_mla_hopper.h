// The sparse MLA forward and backward on Hopper's warpgroup MMA (wgmma): sparse_mla_forward's and
// sparse_mla_backward's contracts (sparse_mla.h), for the shapes the *_takes() functions accept;
// sparse_mla_forward dispatches to the forward. The backward is not yet run on a GPU:
// sparse_mla_backward keeps the mma.sync kernel until the GPU tests have passed this one.
//
// One CTA per (query, group of up to 32 heads), two warpgroups that take the selection's 64-row
// tiles in turn, each with its own tile buffer, online softmax and output accumulators, merged at
// the end. Per tile a warpgroup gathers the rows with cp.async into the no-swizzle core-matrix
// layout (kernels/cuda/wgmma.cuh) and computes S^T = K Q^T (M = 64 keys, N = 32 heads, K = dk), the
// softmax over each head's column, P^T to shared memory, and O^T += V^T P^T (M = 64 value columns a
// block, N = 32 heads, K = 64 keys; the tile's rows read transposed as V^T). The other warpgroup's
// gathers overlap one's arithmetic.
//
// The backward: one CTA per (query, group of up to 32 heads), two warpgroups on each 64-row tile
// (double-buffered, gathered by both). Warpgroup 0 computes S^T = K Q^T and warpgroup 1 dP^T =
// V dO^T (M = 64 keys, N = 32 heads), exchanged through shared memory; both then hold P^T and
// dS^T = P^T (dP^T - delta) scale in registers. Each warpgroup owns half of dk: dQ^T (M = its dk
// rows in blocks of 64, N = 32 heads, K = 64 keys; the tile read MN-major, dS^T from shared memory)
// accumulates in its registers over the tiles, and the rows' gradient [64 keys, its dk columns] =
// dS^T Q + P^T dO (A = dS^T, P^T straight from the registers, B = Q, dO read MN-major; 64 columns
// at a time) is added to the latent's rows with fp32 atomics.
#pragma once

#include "kernels/cuda/sparse_mla.h"

namespace spindle::cuda {

// dk and dv multiples of 64, dv <= dk <= 512 (shared memory); the rest as
// sparse_mla_unsupported.
bool sparse_mla_hopper_takes(const SparseMlaShape& s);

// dk a multiple of 128 up to 512, dv a multiple of 64 up to dk; the rest as sparse_mla_unsupported.
bool sparse_mla_backward_hopper_takes(const SparseMlaShape& s);

void sparse_mla_backward_hopper(const SparseMlaShape& s, const __nv_bfloat16* q, const __nv_bfloat16* latent,
                                const int32_t* selected, const __nv_bfloat16* out, const float* lse,
                                const __nv_bfloat16* dout, __nv_bfloat16* dq, float* d_latent,
                                cudaStream_t stream);

void sparse_mla_forward_hopper(const SparseMlaShape& s, const __nv_bfloat16* q, const __nv_bfloat16* latent,
                               const int32_t* selected, __nv_bfloat16* out, float* lse, cudaStream_t stream);

}  // namespace spindle::cuda
