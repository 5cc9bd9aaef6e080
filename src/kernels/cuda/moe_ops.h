// Mixture-of-experts operations on the GPU: the clamped SwiGLU of the experts (bf16 storage,
// fp32 math), the DeepSeek-V3 router (fp32 logits, bias and weights) and the expert-sorted
// permutation of the (token, slot) assignments that grouped expert GEMMs consume.
// CPU references: cpu::clamped_swiglu(_backward), cpu::route_tokens, cpu::route_weights_backward.
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>
#include <memory>
#include <vector>

#include "backend/cuda/device_memory.h"
#include "backend/cuda/pinned_memory.h"
#include "backend/cuda/stream.h"
#include "kernels/cpu/moe.h"

namespace spindle::cuda {

// out = silu(min(gate, limit)) * clamp(up, -limit, limit), elementwise over n.
void clamped_swiglu_forward(const __nv_bfloat16* gate, const __nv_bfloat16* up, __nv_bfloat16* out, int64_t n,
                            float limit, cudaStream_t stream);

// dgate, dup written (zero where a clamp held the input; bounds pass the gradient, as torch.clamp).
void clamped_swiglu_backward(const __nv_bfloat16* gate, const __nv_bfloat16* up, const __nv_bfloat16* dout,
                             __nv_bfloat16* dgate, __nv_bfloat16* dup, int64_t n, float limit,
                             cudaStream_t stream);

// The same with gate and up as the two halves of each row of gate_up [rows, 2 cols] (as the
// experts' backward keeps them, so that one product with both weights gives the input gradient):
// out [rows, cols]; the backward writes dgate, dup over gate, up.
void clamped_swiglu_halves_forward(const __nv_bfloat16* gate_up, __nv_bfloat16* out, int64_t rows,
                                   int64_t cols, float limit, cudaStream_t stream);
void clamped_swiglu_halves_backward(__nv_bfloat16* gate_up, const __nv_bfloat16* dout, int64_t rows,
                                    int64_t cols, float limit, cudaStream_t stream);

// One warp per token: scores = sigmoid(logits), choice = scores + bias; the topk_groups groups
// with the largest sum of their two best choices are kept; topk experts by choice among them,
// in descending order, ties to the lower index (as cpu::route_tokens' stable sorts);
// weight = score (normalised by sum + 1e-20 if asked) * scaling. logits [tokens, experts],
// bias [experts], expert [tokens, topk] (int32), weight [tokens, topk]; all fp32.
// Needs experts % groups == 0, experts <= 2048, topk <= experts, topk_groups <= groups.
void route_tokens(const cpu::RouterShape& s, const float* logits, const float* bias, int32_t* expert,
                  float* weight, cudaStream_t stream);

// dlogits [tokens, experts] written: the gradient of the routing weights through the chosen
// experts' sigmoid scores (cpu::route_weights_backward). dweight [tokens, topk].
void route_weights_backward(const cpu::RouterShape& s, const float* logits, const int32_t* expert,
                            const float* dweight, float* dlogits, cudaStream_t stream);

// The assignments a = t * topk + k (expert[a] in [0, experts)) grouped by expert for grouped
// GEMMs: counts[e] = assignments to e; offsets[e] = sum of counts before e, offsets[experts] =
// total; permutation[offsets[e] + i] = the i-th assignment to e in token order (a stable sort
// by expert; token = permutation / topk). Workspace (owned, grown on demand): 8 bytes per
// assignment plus CUB's radix-sort temporary storage.
class ExpertPermutation {
 public:
  void build(const int32_t* expert, int64_t assignments, int64_t experts, int32_t* counts, int32_t* offsets,
             int32_t* permutation, cudaStream_t stream);
  // The per-expert products need the offsets (experts + 1 of them, as build wrote them) on the
  // host: the copy is queued here, and the host waits for it in host_offsets(), so that work queued
  // in between (the shared expert) keeps the GPU busy meanwhile.
  void download_offsets(const int32_t* offsets, int64_t experts, cudaStream_t stream);
  std::vector<int32_t> host_offsets() const;

 private:
  DeviceBuffer<int32_t> workspace_;
  std::shared_ptr<void> pinned_;  // [pinned_count_] int32
  int64_t pinned_count_ = 0, downloaded_ = 0;
  Event downloaded_event_{cudaEventDisableTiming};
};

}  // namespace spindle::cuda
