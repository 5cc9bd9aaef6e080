// The sparse MLA backward on wgmma, for the latent of 512 that is both key and value (dk = dv = 512,
// GLM-5.3-Flash's shape): for a query alone, one CTA of two warpgroups per group of 32 heads, over
// tiles of 64 selected rows. A query's 32 heads are too few rows for wgmma's M of 64, so the selected rows
// (keys) are M throughout, as in the wgmma forward (sparse_mla_hopper.h). Per tile:
//   [S^T | dP^T] = K [Q; dO]^T, [64 keys, 64 columns] over the 512 values, by warpgroup 0 in one
//     product of N = 64 (the tile read K-major once, where two products of N = 32 read it twice),
//     then P = exp2(S scale2 - lse) and dS = P (dP - delta) scale from the same registers, into
//     shared memory as bf16 [dS; P] ([64 rows, 64 keys]); meanwhile warpgroup 1 waits for the
//     previous tile's reductions to read the other buffer and gathers the next tile into it
//     (fill_tile: whole pools by TMA, the rest by cp.async);
//   dQ^T += K^T dS^T ([512, 32 heads] in registers over all tiles, 256 values a warpgroup), the tile
//     read MN-major;
//   the rows' gradient [64 keys, 512] = [dS; P]^T [Q; dO], dS^T Q + P^T dO as one product of depth
//     64 (key and value are the same rows), 256 columns at a time (128 a warpgroup): staged as fp32
//     in the tile's spent buffer and added to the latent by TMA bulk reductions, which read the
//     first 256 columns while the second are computed.
// Where asked, P summed over the heads per slot (the indexer's attention mass), as the other
// backward kernels do.
//
// Queries come in pairs (one CTA per pair and head group), with the forward's first pass
// (sparse_mla_pairs.h): where a pair's union is at most 3/2 of the wider selection (a trained
// indexer's neighbours choose nearly the same pools), both queries walk it together in one tile
// buffer (their [Q0; dO0; Q1; dO1] take the other buffer's room): warpgroup g computes query g's
// scores and [dS_g; P_g], the rows the query did not select masked; dQ for both with N = 64; the
// rows' gradient as one product of depth 128, reduced into the latent once, so that a shared row is
// gathered and reduced once for two queries. The next tile's gather then starts once the staged
// gradient has been read. Other pairs take each query alone, one after the other, as above. A
// query's mass slot in a union is the count of its marks before the row (both selections ascend).
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "kernels/cuda/sparse_mla.h"

namespace spindle::cuda {

// Whether the kernel takes the shape: those of sparse_mla_unsupported with dk = dv = 512.
bool sparse_mla_backward_hopper_takes(const SparseMlaShape& s);

// sparse_mla_backward's contract (sparse_mla.h).
void sparse_mla_backward_hopper(const SparseMlaShape& s, const __nv_bfloat16* q, const __nv_bfloat16* latent,
                                const int32_t* selected, const __nv_bfloat16* out, const float* lse,
                                const __nv_bfloat16* dout, __nv_bfloat16* dq, float* d_latent, float* mass,
                                cudaStream_t stream);

}  // namespace spindle::cuda
