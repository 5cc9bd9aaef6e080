// The indexer's pool scores on wgmma (sm_90a): the contract of indexer_scores (indexer.h), which
// calls this when it takes the shape.
//
// One CTA of two warpgroups takes 16 queries (warpgroup g its 8 queries 8 g .. 8 g + 7, all their
// heads) and walks the pool tiles of 64 that its last query sees, tile blockIdx.y, + gridDim.y, ..
// Both warpgroups read the same tile (a 4-stage cp.async ring, 2 tiles in flight, one barrier per
// tile). Each computes scores^T [64 pools, 4 queries x 32 head slots] = K Q^T for its two halves of
// 4 queries, two m64n128k16 chains over head_dim queued together (K-major operands in the
// no-swizzle core-matrix layout, wgmma.cuh); heads past `heads` are zero rows. The epilogue of a
// half folds relu and the head weights (scale included) into 8 sums per thread (its two pool rows x
// 4 queries, over its 8 of each query's 32 head columns), adds them across the 4 lanes that share a
// row (two butterfly steps, the same tree for every pool, so that equal keys give bit-equal
// scores), and stores them (a warp's store: 8 consecutive pools of 4 queries). The first half's
// epilogue runs while the second half's products do. Where asked, the tiles of 64 pools are the
// tile maxima's (indexer.h): each warp reduces its 16 pools' keys of a query by shuffles, and four
// atomic maxima a (query, tile), into maxima zeroed before the launch, combine the warps.
//
// Why this shape: each 16 KB key tile feeds 2 x 4.2 MFLOP (512 FLOP per byte from L2), and the
// tensor cores work during half of the epilogues. Measured on the H200 (docs/PERF.md): one
// m64n256k16 chain per warpgroup, the epilogue after it, 498 TFLOP/s; these halves 543; quarters
// (m64n64k16) 414; one warpgroup per CTA and two CTAs per multiprocessor 445. What bounds it is the
// instructions its 8 warps issue (ncu: 1.4 a cycle), not the tensor cores: making the key loads'
// offsets and the descriptors once took it from 449 to 512 TFLOP/s (H100), while pipelining the
// halves across tiles made it slower (docs/PERF.md).
//
// Shared memory: q 2 x 256 rows x head_dim bf16 (128 KiB at 128), 4 key tiles of 64 x head_dim
// (64 KiB) and the head weights [16][32] fp32: 194 KiB at head_dim 128.
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
                           unsigned* maxima, cudaStream_t stream);

}  // namespace spindle::cuda
