// The indexer's pool scores on wgmma (sm_90a): the contract of indexer_scores (indexer.h), which
// calls this when it takes the shape.
//
// One CTA of two warpgroups takes 16 queries (warpgroup g its 8 queries 8 g .. 8 g + 7, all their
// heads) and walks the pool tiles of 64 that its last query sees, tile blockIdx.y, + gridDim.y, ..
// Both warpgroups read the same tile (a 3-stage cp.async ring, one barrier per tile) and compute
// scores^T [64 pools, 8 queries x 32 head slots] = K Q^T with m64n256k16 over head_dim (K-major
// operands in the no-swizzle core-matrix layout, wgmma.cuh); heads past `heads` are zero rows. The
// epilogue folds relu and the head weights (scale included) into 16 sums per thread (its two
// pool rows x 8 queries, over its 8 of each query's 32 head columns), adds them across the 4 lanes
// that share a row (two butterfly steps, the same tree for every pool, so that equal keys give
// bit-equal scores), and writes [8 queries, 64 pools] through shared memory in 256-byte rows.
//
// Why this shape: each 16 KB key tile feeds 2 x 4.2 MFLOP (512 FLOP per byte from L2), and the
// second warpgroup's products run on the tensor cores while the first's epilogue runs.
//
// Shared memory: q 2 x 256 rows x head_dim bf16 (128 KiB at 128), 3 key tiles of 64 x head_dim
// (48 KiB), head weights [16][32] fp32, the output staging [2][8][72] fp32: 182 KiB at head_dim 128.
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include "kernels/cpu/dsa.h"

namespace spindle::cuda {

// heads in 17..32 (fewer waste the 32 head slots; the mma.sync scorer packs them), head_dim a
// multiple of 16 up to 128.
bool indexer_scores_hopper_takes(const cpu::IndexerShape& s);

void indexer_scores_hopper(const cpu::IndexerShape& s, const __nv_bfloat16* q, const __nv_bfloat16* pool_keys,
                           const __nv_bfloat16* head_weights, int64_t first, int64_t rows, float* scores,
                           cudaStream_t stream);

}  // namespace spindle::cuda
