// Token rows to and from the expert-sorted order of the (token, slot) assignments a = t * topk + k
// that the grouped expert GEMMs consume (permutation[r] = the assignment at sorted row r, as
// ExpertPermutation builds it; inverse[a] = its row). Rows in bf16, math in fp32. Every output is
// summed by one warp per token in slot order: no float atomics, the same bits on every run.
// CPU reference: the gather and weighted scatter loops of moe_forward / moe_backward (model/moe.cpp).
// Rows move in 16-byte pieces when D % 8 == 0 and every pointer is 16-byte aligned, in pairs when
// D % 2 == 0 and every pointer is 8-byte aligned, one by one otherwise. Needs 1 <= topk <= 8 and
// tokens * topk < 2^31.
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>

namespace spindle::cuda {

// rows[inverse[t * topk + k], :] = x[t, :] for every slot k; x [tokens, D], rows [tokens * topk, D]
// (written).
void gather_expert_rows(const __nv_bfloat16* x, const int32_t* inverse, int64_t tokens, int64_t topk,
                        int64_t D, __nv_bfloat16* rows, cudaStream_t stream);

// y[t] = shared[t] + sum_k weight[t * topk + k] * rows[inverse[t * topk + k]], in fp32 in that
// order, rounded once to bf16. rows [tokens * topk, D], weight [tokens, topk], shared and y
// [tokens, D] (written; y may be shared itself, for an in-place add to the shared expert's output).
void combine_expert_rows(const __nv_bfloat16* rows, const int32_t* inverse, const float* weight,
                         const __nv_bfloat16* shared, int64_t tokens, int64_t topk, int64_t D,
                         __nv_bfloat16* y, cudaStream_t stream);

// The routed experts' down projection backward without its output out = hidden W_down^T: from
// g = dy rows W_down (the unweighted dy of each sorted row's token, [assignments, I] bf16),
// dweight[permutation[r]] = g[r] . hidden[r] (fp32, written; = dy . out), then, in place,
// g[r] *= weight[permutation[r]] (the hidden's gradient) and hidden[r] *= weight[permutation[r]]
// (so that the unweighted dy rows give the down weight's gradient). I as D above.
void expert_down_backward(const int32_t* permutation, const float* weight, int64_t assignments, int64_t I,
                          __nv_bfloat16* g, __nv_bfloat16* hidden, float* dweight, cudaStream_t stream);

// Backward of gather_expert_rows: dx[t] += sum_k drows[inverse[t * topk + k]] (fp32 [tokens, D],
// accumulated; the k rows summed first, in slot order).
void scatter_expert_rows_backward(const __nv_bfloat16* drows, const int32_t* inverse, int64_t tokens,
                                  int64_t topk, int64_t D, float* dx, cudaStream_t stream);

}  // namespace spindle::cuda
