// Mixture-of-experts operations on the GPU: the clamped SwiGLU of the experts (bf16 storage,
// fp32 math), the DeepSeek-V3 router (fp32 logits, bias and weights) and the expert-sorted
// permutation of the (token, slot) assignments that grouped expert GEMMs consume, and its
// inverse.
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

// out = silu(min(gate, limit)) * clamp(up, -limit, limit) with gate and up the two halves of each
// row of gate_up [rows, 2 cols] (as the MLPs and the experts keep them, so that one product with
// both weights gives the input gradient): out [rows, cols]. The backward writes dgate, dup over
// gate, up (zero where a clamp held the input; bounds pass the gradient, as torch.clamp).
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
// GEMMs: permutation[offsets[e] + i] = the i-th assignment to e in token order (a stable sort by
// expert; token = permutation / topk), inverse[permutation[r]] = r, with offsets[e] = the
// assignments to experts before e, offsets[experts] = all of them. The per-expert products need
// the offsets on the host: build() writes them straight to pinned host memory, and host_offsets()
// waits for that, so that work queued in between (the gather, the shared expert) keeps the GPU
// busy meanwhile. Workspace (owned, grown on demand): 4 bytes per expert and tile of 2,048
// assignments.
class ExpertPermutation {
 public:
  void build(const int32_t* expert, int64_t assignments, int64_t experts, int32_t* permutation,
             int32_t* inverse, cudaStream_t stream);
  // The offsets of the last build (experts + 1 of them).
  std::vector<int32_t> host_offsets() const;

 private:
  DeviceBuffer<int32_t> tile_counts_;
  std::shared_ptr<void> pinned_;  // [pinned_count_] int32, written by the GPU
  int64_t pinned_count_ = 0, built_ = 0;
  Event built_event_{cudaEventDisableTiming};
};

}  // namespace spindle::cuda
