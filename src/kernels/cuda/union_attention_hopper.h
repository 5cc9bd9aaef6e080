// The union form's forward as one flash-style kernel on Hopper's wgmma (version 2,
// docs/UNION_ATTENTION.md): a CTA holds 64 queries of one head and runs the online softmax over
// tiles of 64 keys, the union's tiles that any of its queries selects, then two tiles of the
// block's own latent rows (the tails). Keys and values come expanded (kv_b_proj's product), the
// scores never leave the SM.
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <string>

#include "kernels/cuda/union_attention.h"

namespace spindle::cuda {

// Why the fused forward cannot run this shape ("" if it can).
std::string union_fused_unsupported(const UnionAttentionShape& s);

// The rows a group of queries' tails reach: positions [low, high) of the latent, expanded.
struct TailRows {
  int64_t low, high;
};
TailRows union_fused_tail_rows(const UnionAttentionShape& s, int64_t q_begin, int64_t q_end);

// Queries q_begin .. q_end of the chunk: out and lse written for them (the layouts of
// union_attention.h). union_kv [u.count, heads (qk + v)], tail_kv [high - low, heads (qk + v)].
void union_attention_forward_fused(const UnionAttentionShape& s, const ChunkUnion& u,
                                   const __nv_bfloat16* union_kv, const __nv_bfloat16* tail_kv,
                                   const TailRows& tail, int64_t q_begin, int64_t q_end,
                                   const int32_t* selected, const __nv_bfloat16* q, __nv_bfloat16* out,
                                   float* lse, cudaStream_t stream);

// The backward's inputs: q, lse (the forward's) and dout as union_attention.h lays them out, dot
// [queries, heads] fp32 (dout . out).
struct UnionBackwardInputs {
  const __nv_bfloat16* q;
  const float* lse;
  const __nv_bfloat16* dout;
  const float* dot;
};

// The union keys' and values' gradient [u.count, heads (qk + v)] bf16 (written), from every query.
void union_attention_backward_fused_union(const UnionAttentionShape& s, const ChunkUnion& u,
                                          const __nv_bfloat16* union_kv, const int32_t* selected,
                                          const UnionBackwardInputs& in, __nv_bfloat16* union_dkv,
                                          cudaStream_t stream);

// Queries q_begin .. q_end: their dq (written) and their tails' gradient to the keys and values of
// the tail rows [tail.high - tail.low, heads (qk + v)] bf16 (written; rows no query's tail holds are
// zero). tail_masks [queries, 4]: scratch.
void union_attention_backward_fused_tails(const UnionAttentionShape& s, const ChunkUnion& u,
                                          const __nv_bfloat16* union_kv, const __nv_bfloat16* tail_kv,
                                          const TailRows& tail, int64_t q_begin, int64_t q_end,
                                          const int32_t* selected, const UnionBackwardInputs& in,
                                          uint32_t* tail_masks, __nv_bfloat16* dq, __nv_bfloat16* tail_dkv,
                                          cudaStream_t stream);

// The attention's probabilities summed over the heads at each selected slot of queries q_begin ..
// q_end: mass [queries, width] fp32, written at the selected slots (the caller zeroes the rest).
// tail_masks as union_attention_backward_fused_tails wrote them for the same queries. The slots must
// be the indexer's layout (pool slots ascending, then -1; the tail's ascending from `pooled`): the
// kernel traps otherwise.
void union_attention_mass_fused(const UnionAttentionShape& s, const ChunkUnion& u,
                                const __nv_bfloat16* union_kv, const __nv_bfloat16* tail_kv,
                                const TailRows& tail, int64_t q_begin, int64_t q_end, const int32_t* selected,
                                const __nv_bfloat16* q, const float* lse, const uint32_t* tail_masks,
                                float* mass, cudaStream_t stream);

}  // namespace spindle::cuda
