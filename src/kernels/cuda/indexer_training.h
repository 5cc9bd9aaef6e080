// Training of the DSA k-pool indexer on the GPU: the main attention's probability mass over the
// selected slots (the target), the KL between that target and the indexer's distribution over its
// chosen pools with its gradients, and the backward of the pooling. The same contracts as
// cpu::attention_mass, cpu::indexer_kl_backward and cpu::indexer_pool_keys_backward
// (kernels/cpu/dsa.h). bf16 storage, fp32 math; nothing tokens x tokens, nothing width-sized in
// global memory but the mass itself (scores are recomputed, never stored).
//
// Layouts (row-major, contiguous):
//   q (attention)  [tokens, heads, qk_dim]              bf16
//   kv             [tokens, heads, qk_dim + v_dim]      bf16 (key then value per head)
//   selected       [tokens, width]                      int32, -1 where unused
//   mass           [tokens, width]                      fp32
//   q (indexer)    [tokens, index heads, head_dim]      bf16
//   pool_keys      [complete_pools, head_dim]           bf16
//   head_weights   [tokens, index heads]                bf16 (already scaled by heads^-0.5)
//   keys, gate     [tokens, head_dim]                   bf16
//   ape            [kpool, head_dim]                    bf16
//
// Launch shapes:
//  - attention_mass: one CTA per query, up to 4 warps, each warp one head at a time (heads
//    h = warp, warp + warps, ...) with two passes over the slots like sparse_attention_forward
//    (online max and denominator, then the probabilities). Each warp adds its heads' probabilities
//    into its own fp32 row of the width in shared memory, summed over the warps in a fixed order at
//    the end: deterministic, no atomics. Shared memory: (width + qk_dim) fp32 per warp (10.3 KiB
//    for 2051 + 576); warps shrink when that passes 48 KiB, then the limit is raised up to the
//    device's opt-in maximum (227 KiB on Hopper), else it fails loudly.
//  - indexer_kl_backward: persistent CTAs of 4 warps on the tensor cores (mma.sync m16n8k16),
//    each walking queries t = blockIdx.x, + gridDim.x, ... (so each of the sums takes one double
//    atomic per CTA). Per query, in shared memory: q [heads, head_dim] and the chosen pools' keys
//    [topk / kpool, head_dim] in bf16 (padded to 16 with zeros), z = q k^T / sqrt(d) in fp32
//    (kept from the scores to the gradients: the relu's mask and d loss / d w), and d loss / d z as
//    bf16 hi + lo (fp32 accuracy from two products). dq = G k is written, dpool_keys += G^T q by
//    float2 global atomics (one per (query, pool, channel pair)). 78 KiB for 32 heads x 128 and
//    128 pools (two CTAs per SM). head_dim need not be a multiple of 8 (the rows are then copied
//    element by element).
//  - indexer_pool_keys_backward: a thread per (pool, channel), CTAs of 32 channels x 8 pools
//    walking the pools; dape summed per CTA in shared memory, one atomic per (CTA, pool slot,
//    channel). The incomplete pool's tokens get zeros.
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "kernels/cpu/dsa.h"

namespace spindle::cuda {

// mass[t, i] = sum_h softmax_i(q[t, h] . k[selected[t, i], h] * scale) over the selected slots of t;
// written, zero where the slot is unused.
void attention_mass(const cpu::SparseAttentionShape& s, const __nv_bfloat16* q, const __nv_bfloat16* kv,
                    const int32_t* selected, float* mass, cudaStream_t stream);

// KL(target || indexer) over each query's chosen complete pools, times `scale`. The queries are
// the tokens from s.first_query on (a chunk of a streamed sequence): the rows of q, head_weights,
// selected, mass, dq [queries, heads, head_dim] and dhead_weights [queries, heads] (the last two
// written, bf16); pool_keys and dpool_keys [complete_pools, head_dim] (fp32, accumulated) hold
// every complete pool of the s.tokens keys; sums (three device doubles) accumulated with what the
// CPU function returns (cpu::IndexerKlSums): the unscaled KL summed over the queries, the queries
// trained, and those with every relu closed.
void indexer_kl_backward(const cpu::IndexerShape& s, const __nv_bfloat16* q, const __nv_bfloat16* pool_keys,
                         const __nv_bfloat16* head_weights, const int32_t* selected, const float* mass,
                         float scale, __nv_bfloat16* dq, float* dpool_keys, __nv_bfloat16* dhead_weights,
                         double* sums, cudaStream_t stream);

// Backward of indexer_pool_keys: dkeys and dgate [tokens, head_dim] written (bf16; zero for the
// tokens of the incomplete pool); dape [kpool, head_dim] fp32 accumulated.
void indexer_pool_keys_backward(const cpu::IndexerShape& s, const __nv_bfloat16* keys,
                                const __nv_bfloat16* gate, const __nv_bfloat16* ape, const float* dpool_keys,
                                __nv_bfloat16* dkeys, __nv_bfloat16* dgate, float* dape, cudaStream_t stream);

}  // namespace spindle::cuda
