// The DSA k-pool indexer on the GPU: pooled keys and per-query selection, the same contract as
// cpu::indexer_pool_keys / cpu::indexer_select (kernels/cpu/dsa.h). bf16 storage, fp32 math.
//
// Selection never forms a tokens x tokens buffer: queries are scored in blocks of `query_block`
// rows against the visible pooled keys, into an fp32 score tile [query_block, complete_pools] and
// its tile maxima [query_block, indexer_tiles] (1/64 of it) in a caller-provided workspace
// (indexer_select_workspace_bytes), reused block after block. The wrapper takes the largest block
// that fits the workspace it is given: e.g. 1M tokens with kpool 4 (262144 pools) is 1 MiB (and
// 16 KiB) per query row, so a 1 GiB workspace scores 1008 queries per launch; keep the workspace
// under 2 GiB.
//
// Scoring (indexer_scores, indexer_scores.cu) runs on the tensor cores. With 17 to 32 heads and
// head_dim a multiple of 16 up to 128 (GLM's 32 x 128) on wgmma (indexer_scores_hopper.h);
// otherwise on warp-level mma.sync.m16n8k16 bf16 x bf16 -> fp32, score[t][p] = sum_h w[t][h] relu(q[t][h] .
// k[p] / sqrt(d)). A CTA of 256 threads (8 warps, 4 along q rows x 2 along pools, each warp 64 rows x 64
// pools of fp32 accumulators) holds 256 rows of q in shared memory for its whole life: groups of 8
// queries x all their heads, arranged so that each m16 tile is 8 queries x 2 heads (a thread's
// accumulator rows g and g + 8 are one query's two heads; the 8 queries lie on the 8 lane groups).
// A group takes ceil(heads / 2) m16 tiles rounded up to 1, 2, 4 or a multiple of 4, so a CTA
// covers 16 / that groups: 8 queries at heads 32, 16 at heads 16, 64 at heads 4; padding rows
// (odd heads, heads 24 and the like) are zero. It loops over the pool tiles of 128 that its last
// query can see (tiles past that are skipped), keys double-buffered through cp.async, K = head_dim
// rounded up to 16 with zero padding, in 16-wide steps from ldmatrix. Epilogue: relu(scale * acc)
// * w summed in registers over a thread's heads of one query, partial sums per (query, pool) in
// shared memory summed in a fixed order (equal keys give bit-equal scores), written as fp32 to the
// block's rows of the workspace. Shared memory: (256 + 2 * 128) rows of head_dim (rounded up to 16) + 8 bf16,
// plus up to 68 KiB of partial sums (154 KiB at heads 32, head_dim 128), one CTA per multiprocessor. Grid:
// query tiles x pool-tile splits (the splits, taken round-robin, only when there are fewer than two query
// tiles per multiprocessor). Limits, checked loudly: heads <= 32, head_dim a multiple of 8 up to 128, q and
// pool_keys 16-byte aligned.
//
// Selection (indexer_topk, indexer_topk_kernel), a second launch per query block: one CTA per
// query reads its workspace row and runs an exact radix select (a 12-bit histogram, then two 10-bit
// ones over the threshold bin's keys, over the order-preserving bits of the fp32 scores) of the top
// topk/kpool visible pools, ties to the lower pool, written in ascending pool order, expanded to
// tokens, plus the tail; -1 elsewhere. Rows of more than 16,384 pools take 1024 threads a CTA and keep
// up to 49,408 of their keys in shared memory after the first read; with the tile maxima (the
// scorer's, in indexer_select) they take 256 threads a CTA, four a multiprocessor, and those of at
// most 256 chosen pools and at least two tiles of 64 pools per chosen one are read once:
// tau, the chosen-th largest tile maximum, bounds the chosen-th largest score from below, so the
// scores >= tau (a few hundred where scores are spread) hold the selection, which the radix select
// finds among them in shared memory. Rows where more than 2,048 scores reach tau, or more than 256
// equal the threshold (ties, exact zeros), take the radix select.
// Pooling: one thread per (pool, channel), 256 per CTA. Scores are assumed not NaN (-inf ranks
// below every finite score).
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>

#include "kernels/cpu/dsa.h"

namespace spindle::cuda {

// keys, gate: [tokens, head_dim]; ape: [kpool, head_dim]; pool_keys: [complete_pools, head_dim].
void indexer_pool_keys(const cpu::IndexerShape& s, const __nv_bfloat16* keys, const __nv_bfloat16* gate,
                       const __nv_bfloat16* ape, __nv_bfloat16* pool_keys, cudaStream_t stream);

// Workspace bytes for scoring `query_block` queries at a time: their scores and tile maxima,
// query_block * (complete_pools + indexer_tiles) * 4.
size_t indexer_select_workspace_bytes(const cpu::IndexerShape& s, int64_t query_block);

// Pools per tile of the tile maxima: maxima[r][j] is the largest order-preserving key (the fp32
// score's bits, sign-flipped so that unsigned order is float order; indexer_keys.cuh) of row r's
// visible pools j * kIndexerTilePools .. (j + 1) * kIndexerTilePools - 1, 0 (below every score's key)
// where the tile has no visible pool. Row stride indexer_tiles(s) = ceil(complete_pools / 64).
constexpr int64_t kIndexerTilePools = 64;
int64_t indexer_tiles(const cpu::IndexerShape& s);

// Scores of queries first .. first + rows - 1 (absolute positions, first >= s.first_query)
// against their visible pools: scores[r][p] for p < min(complete_pools, (first + r + 1) / kpool),
// row stride complete_pools; the rest of each row is unspecified. q, pool_keys, head_weights as for
// indexer_select. Where maxima is not null, also the rows' tile maxima (all of each row's
// indexer_tiles): the wgmma scorer folds them into its epilogue, the mma.sync one's are read back
// from the scores (indexer_tile_maxima).
void indexer_scores(const cpu::IndexerShape& s, const __nv_bfloat16* q, const __nv_bfloat16* pool_keys,
                    const __nv_bfloat16* head_weights, int64_t first, int64_t rows, float* scores,
                    unsigned* maxima, cudaStream_t stream);

// The tile maxima of queries first .. first + rows - 1 from their scores (as indexer_scores writes
// them), for scores made elsewhere; bit for bit what indexer_scores writes.
void indexer_tile_maxima(const cpu::IndexerShape& s, const float* scores, int64_t first, int64_t rows,
                         unsigned* maxima, cudaStream_t stream);

// The mma.sync scorer alone, for any shape indexer_scores takes (tests and bench/ compare it with
// the wgmma one).
void indexer_scores_mma(const cpu::IndexerShape& s, const __nv_bfloat16* q, const __nv_bfloat16* pool_keys,
                        const __nv_bfloat16* head_weights, int64_t first, int64_t rows, float* scores,
                        cudaStream_t stream);

// "wgmma" or "mma.sync": the scorer indexer_scores runs for this shape.
const char* indexer_scorer(const cpu::IndexerShape& s);

// The top-k of the queries first .. first + rows - 1 (absolute positions, first >= s.first_query)
// from their scores as indexer_scores writes them (row r at scores + r * complete_pools): their rows
// of selected (row t - s.first_query for query t) written as indexer_select writes them. maxima:
// the rows' tile maxima (row r at maxima + r * indexer_tiles), which let long rows be read once; null:
// the radix select alone. The same selection either way.
void indexer_topk(const cpu::IndexerShape& s, const float* scores, const unsigned* maxima, int64_t first,
                  int64_t rows, int32_t* selected, cudaStream_t stream);

// The queries are the tokens from s.first_query on (a chunk of a streamed sequence; 0: all), the
// keys all s.tokens. q: [queries, heads, head_dim]; pool_keys: [complete_pools, head_dim];
// head_weights: [queries, heads] (already scaled by heads^-0.5); selected: [queries, width()]
// written (absolute token indices), -1 where unused. workspace: scratch of workspace_bytes, at
// least one query row (indexer_select_workspace_bytes(s, 1)).
void indexer_select(const cpu::IndexerShape& s, const __nv_bfloat16* q, const __nv_bfloat16* pool_keys,
                    const __nv_bfloat16* head_weights, int32_t* selected, float* workspace,
                    size_t workspace_bytes, cudaStream_t stream);

}  // namespace spindle::cuda
