// DSA attention over selected indices on the GPU, forward and backward: the same contract as
// cpu::sparse_attention / cpu::sparse_attention_backward (kernels/cpu/dsa.h), for any per-head
// query/key width and value width (the model's expanded form: latent 512, 576, 192/128, ...) and
// any selection width, padded with -1 or not. bf16 storage, fp32 softmax and accumulation.
//
// Layouts (row-major, contiguous):
//   q        [tokens, heads, qk_dim]             bf16
//   kv       [tokens, key_heads, qk_dim + v_dim] bf16 (key then value per head, as kv_b_proj writes
//                                                 it; key_heads = 1 for MLA's absorbed latent form)
//   selected [tokens, width]                     int32, each entry in [0, tokens) or negative (unused)
//   out      [tokens, heads, v_dim]              bf16
//   dout     [tokens, heads, v_dim]              bf16
//   dq       [tokens, heads, qk_dim]             bf16, written
//   dkv      [tokens, key_heads, qk_dim + v_dim] fp32, accumulated (zero it first)
//
// Launch shape (version 1, correct first, CUDA cores): one warp per (query, head); a CTA holds
// up to 4 warps = 4 heads of one query (grid = tokens * ceil(heads / warps)). Each warp walks the
// query's selected slots with an online softmax, so nothing width-sized is stored: shared memory
// is (qk_dim + v_dim) fp32 values per warp (the query row and the output/dq accumulator), e.g.
// 4.5 KiB per warp for 576+512. Warps per CTA shrink (down to 1) when that exceeds 48 KiB, and
// above that the dynamic shared-memory limit is raised up to the device's opt-in maximum
// (227 KiB on Hopper, i.e. qk_dim + v_dim <= ~58000); larger widths fail loudly, never silently.
// The backward makes two passes over the slots (statistics, then gradients) and recomputes
// scores rather than storing probabilities.
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include "kernels/cpu/dsa.h"

namespace spindle::cuda {

// out[t, h] = sum_{s in selected[t]} softmax_s(q[t, h] . k[s, h] * scale) v[s, h]; a query with no
// selected slot gets zeros (as on the CPU).
void sparse_attention_forward(const cpu::SparseAttentionShape& s, const __nv_bfloat16* q,
                              const __nv_bfloat16* kv, const int32_t* selected, __nv_bfloat16* out,
                              cudaStream_t stream);

// Backward: dq written (bf16), dkv accumulated in fp32 with atomics (several queries select the
// same key, so rows of dkv are shared; see the .cu for the transposed-index alternative).
void sparse_attention_backward(const cpu::SparseAttentionShape& s, const __nv_bfloat16* q,
                               const __nv_bfloat16* kv, const int32_t* selected, const __nv_bfloat16* dout,
                               __nv_bfloat16* dq, float* dkv, cudaStream_t stream);

}  // namespace spindle::cuda
