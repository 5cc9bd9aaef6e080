// The sparse MLA backward over pairs of neighbouring queries (2p, 2p + 1): a trained indexer gives
// neighbours most of the same pools (docs/PERF.md, "Frozen first, then trained"), and one CTA for
// both gathers each shared row once and adds its gradient to the latent once, where a CTA per
// query moves it twice.
//
// A first pass (one CTA per pair) finds the shared rows: where both queries' valid selected rows
// are strictly ascending (the indexer's output), for each of query 2p's slots the slot of query
// 2p + 1 holding the same row, and the slots of 2p + 1 that 2p does not hold, in order; otherwise
// no row counts as shared and each query's rows are taken on their own (still exact).
//
// The backward then runs one CTA of 16 warps per pair (and group of 32 heads): both queries' heads
// as 64 rows (m16 tiles 0-1 the first query's, 2-3 the second's), over tiles of 32 rows (shared
// memory holds 64 head rows of q and dO, so half the one-query kernel's tile): first the first
// query's slots (the second query's heads too where the row is shared), then the second query's
// own rows. The m16 tiles of a query with no row in a tile are skipped and the scores' work is
// spread over all warps whatever the tiles here, yet rows that are not shared cost more than in the
// one-query kernel (1.2x with nothing shared, docs/PERF.md; likely the twice as many tiles),
// so the caller chooses by the share the first pass returns. Shared rows are gathered, and their
// gradient reduced into the latent, once for both queries. The products and the staging of the
// gradient are sparse_mla.cu's.
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>
#include <string>

#include "kernels/cuda/sparse_mla.h"

namespace spindle::cuda {

// Empty when the pair kernels take this shape (those of sparse_mla_unsupported with the latent of
// 512 they are built for, widths up to 16,384), else why not.
std::string sparse_mla_pair_unsupported(const SparseMlaShape& s);

// The backward of sparse_mla_backward's contract over pairs, from a workspace that
// sparse_mla_pair_partners (sparse_mla.h) filled for the same selection.
void sparse_mla_backward_pairs(const SparseMlaShape& s, const __nv_bfloat16* q, const __nv_bfloat16* latent,
                               const int32_t* selected, const __nv_bfloat16* out, const float* lse,
                               const __nv_bfloat16* dout, __nv_bfloat16* dq, float* d_latent, float* mass,
                               const void* workspace, cudaStream_t stream);

}  // namespace spindle::cuda
