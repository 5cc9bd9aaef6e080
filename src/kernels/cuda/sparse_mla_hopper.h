// The sparse MLA forward on Hopper's warpgroup MMA (wgmma): sparse_mla_forward's contract
// (sparse_mla.h), for the shapes sparse_mla_hopper_takes() accepts; sparse_mla_forward dispatches
// here.
//
// One CTA per (pair of neighbouring queries 2p, 2p + 1, group of up to 32 heads). A first pass
// lists every row either query selected, each slot marked with the queries that chose it
// (sparse_mla_pairs.h): where both selections are the indexer's layout, their union in order.
//
// For the latent of 512 (dk = dv = 512, the model's shape), where the union is at most 3/2 of the
// wider selection (a trained indexer's neighbours choose nearly the same pools, docs/PERF.md), a
// kernel of its own walks it with the pair's 64 heads as the products' M, so that every product
// reads a tile for both queries: the tiles in twos, one to each warpgroup (S = Q K^T over its 64
// keys, each row's softmax over its own query's keys), each warpgroup holding half of O's 512 value
// columns and adding both tiles' P V to it (its own P from registers, the other's from shared
// memory), the pair's list in shared memory (sparse_mla_hopper.cu, forward_pair_heads). Other
// pairs, as other shapes, take a warpgroup per query, in a launch of their own.
//
// A warpgroup per query: each with its own online softmax and output. Where the union is at most
// 5/4 of the wider selection the two warpgroups walk it together, each tile gathered once into one
// of two buffers and each warpgroup masking the rows its query did not choose; otherwise each
// warpgroup walks its own selection in its own buffer, its next tile gathered after this one (so
// do the latent of 512's pairs that do not share). Per tile a warpgroup
// computes S^T = K Q^T (M = 64 keys, N = 32 heads, K = dk), the softmax over each head's column,
// P^T to shared memory, and O^T += V^T P^T (M = 64 value columns a block, N = 32 heads, K = 64 keys;
// the tile's rows read transposed as V^T).
//
// Tiles are filled in the 128-byte swizzled layout, whole pools of consecutive rows by TMA and the
// other rows by cp.async (fill_tile, sparse_mla_tile.cuh), both counted on the buffer's barrier.
#pragma once

#include "kernels/cuda/sparse_mla.h"

namespace spindle::cuda {

// dk and dv multiples of 64, dv <= dk <= 512 (shared memory); the rest as
// sparse_mla_unsupported.
bool sparse_mla_hopper_takes(const SparseMlaShape& s);

void sparse_mla_forward_hopper(const SparseMlaShape& s, const __nv_bfloat16* q, const __nv_bfloat16* latent,
                               const int32_t* selected, __nv_bfloat16* out, float* lse, cudaStream_t stream);

}  // namespace spindle::cuda
