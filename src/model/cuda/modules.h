// The model's sublayers on the GPU, the same contracts as model/modules.h: x is the normalised
// sublayer input [tokens, hidden] (bf16), y the output (bf16, written). Each backward recomputes
// its sublayer's forward from x, accumulates the input gradient into dx (fp32) and the parameter
// gradients into `grad` (fp32 device weights, same layout as the weights).
#pragma once

#include <cuda_bf16.h>

#include <cstdint>
#include <vector>

#include "backend/cuda/device_memory.h"
#include "model/config.h"
#include "model/cuda/context.h"
#include "model/weights.h"

namespace spindle::cuda {

using bf16 = __nv_bfloat16;

void kda_forward(Context& ctx, const ModelConfig& c, const KdaWeights& w, const bf16* x, int64_t L, bf16* y);
void kda_backward(Context& ctx, const ModelConfig& c, const KdaWeights& w, const bf16* x, int64_t L,
                  const bf16* dy, float* dx, KdaWeights& grad);

// The indexer's KL training, accumulated over DSA layers on the device.
struct IndexerLoss {
  double coef = 0.0;                   // gradients of coef * mean KL go to the indexer only
  DeviceBuffer<double>* kl = nullptr;  // one value: the sum over layers of sum_q KL_q (device)
  int64_t layers = 0;
};

// `selection` ([tokens, width] int32) is written by a layer with its own indexer and read by one
// that shares the previous layer's, or by a recomputation (reuse_selection).
void dsa_forward(Context& ctx, const ModelConfig& c, const DsaWeights& w, const bf16* x, int64_t L,
                 DeviceBuffer<int32_t>& selection, bf16* y, bool reuse_selection = false);
void dsa_backward(Context& ctx, const ModelConfig& c, const DsaWeights& w, const bf16* x, int64_t L,
                  const int32_t* selection, const bf16* dy, float* dx, DsaWeights& grad,
                  IndexerLoss* indexer_loss);

void mlp_forward(Context& ctx, const MlpWeights& w, double swiglu_limit, const bf16* x, int64_t L, bf16* y);
void mlp_backward(Context& ctx, const MlpWeights& w, double swiglu_limit, const bf16* x, int64_t L,
                  const bf16* dy, float* dx, MlpWeights& grad);

// The balance loss's pooled statistics (device) and its coefficient, for the routers' gradient.
struct BalanceLoss {
  double coef = 0.0;
  const double* counts = nullptr;  // [experts]: top-k picks over all MoE layers
  double rows = 0.0;               // tokens over all MoE layers
};

// `load` (host, may be null): tokens routed to each expert. `router_logits` (device fp32
// [tokens, experts], may be null): written.
void moe_forward(Context& ctx, const ModelConfig& c, const MoeWeights& w, const bf16* x, int64_t L, bf16* y,
                 std::vector<int64_t>* load = nullptr, float* router_logits = nullptr);
void moe_backward(Context& ctx, const ModelConfig& c, const MoeWeights& w, const bf16* x, int64_t L,
                  const bf16* dy, float* dx, MoeWeights& grad, const BalanceLoss* balance = nullptr);

// A bf16 activation buffer of n elements (category Activations).
inline DeviceBuffer<bf16> activations(int64_t n) {
  return DeviceBuffer<bf16>(static_cast<size_t>(n), MemoryCategory::Activations);
}
inline DeviceBuffer<float> activations_f32(int64_t n) {
  return DeviceBuffer<float>(static_cast<size_t>(n), MemoryCategory::Activations);
}

}  // namespace spindle::cuda
