// The DSA k-pool indexer on the GPU: pooled keys and per-query selection, the same contract as
// cpu::indexer_pool_keys / cpu::indexer_select (kernels/cpu/dsa.h). bf16 storage, fp32 math.
//
// Selection never forms a tokens x tokens buffer: queries are scored in blocks of `query_block`
// rows against the visible pooled keys, into an fp32 score tile [query_block, complete_pools] in
// a caller-provided workspace (indexer_select_workspace_bytes), reused block after block. The
// wrapper takes the largest block that fits the workspace it is given: e.g. 1M tokens with kpool 4
// (262144 pools) is 1 MiB per query row, so a 1 GiB workspace scores 1024 queries per launch;
// keep the workspace under 2 GiB.
//
// Launch shapes: pooling, one thread per (pool, channel), 256 per CTA. Selection, one CTA of 256
// threads per query of the block: the query's heads x head_dim values in shared memory as fp32
// (heads * head_dim * 4 bytes; the limit is raised past 48 KiB up to the device's opt-in maximum,
// 227 KiB on Hopper, else it fails loudly), one thread per visible pool computing
// sum_h w_h relu(q_h . k_p / sqrt(d)), then an exact radix select (4 passes of 8-bit histograms
// over the order-preserving bits of the fp32 scores) of the top topk/kpool pools, ties to the
// lower pool, written in ascending pool order, expanded to tokens, plus the tail.
// Scores are assumed finite (no NaN).
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

// Workspace bytes for scoring `query_block` queries at a time: query_block * complete_pools * 4.
size_t indexer_select_workspace_bytes(const cpu::IndexerShape& s, int64_t query_block);

// q: [tokens, heads, head_dim]; pool_keys: [complete_pools, head_dim]; head_weights: [tokens, heads]
// (already scaled by heads^-0.5); selected: [tokens, width()] written, -1 where unused. workspace:
// fp32 scratch of workspace_bytes, at least one query row (complete_pools * 4 bytes).
void indexer_select(const cpu::IndexerShape& s, const __nv_bfloat16* q, const __nv_bfloat16* pool_keys,
                    const __nv_bfloat16* head_weights, int32_t* selected, float* workspace,
                    size_t workspace_bytes, cudaStream_t stream);

}  // namespace spindle::cuda
