// The whole model on one GPU for one sequence: bf16 weights (fp32 for the small parameters),
// fp32 gradients, the same passes as the CPU reference (model/forward.cpp, model/backward.cpp):
// the forward keeps each residual site's input streams, the backward recomputes each sublayer.
#pragma once

#include <map>
#include <string>
#include <vector>

#include "model/backward.h"
#include "model/config.h"
#include "model/cuda/context.h"
#include "model/cuda/device_weights.h"
#include "model/cuda/modules.h"
#include "model/weights.h"

namespace spindle::cuda {

class CudaModel {
 public:
  CudaModel(const ModelConfig& config, const ModelWeights& host_weights, bool strict_kernels = false,
            bool absorbed_mla = false);

  const ModelConfig& config() const { return config_; }
  Context& context() { return ctx_; }
  DeviceWeights& weights() { return weights_; }
  DeviceWeights& grads() { return grads_; }
  void set_timer(KindTimer* timer) { ctx_.timer = timer; }

  // log p(tokens[i] | tokens[<i]) for i = 1 .. n-1, computed chunk_tokens tokens at a time through
  // all layers (0: the whole sequence as one chunk; the same values within bf16 rounding).
  std::vector<float> log_probs(const std::vector<int32_t>& tokens, int64_t chunk_tokens = 0);

  // As spindle::loss_and_gradients: accumulates the gradients into grads(). With
  // options.chunk_tokens in (0, tokens), the streaming executor (docs/STREAMING.md).
  LossResult loss_and_gradients(const std::vector<int32_t>& tokens, const LossOptions& options = {});

 private:
  // The streaming executor's loss and gradients (model/cuda/streaming.cpp).
  LossResult streamed_loss_and_gradients(const std::vector<int32_t>& tokens, const LossOptions& options);
  // Each layer's carry for a streamed sequence of `tokens` tokens: zero KDA carries, empty DSA
  // caches with room for the whole sequence.
  std::vector<LayerCarry> start_carries(int64_t tokens);

  void begin(const char* kind);
  void end();
  // One sublayer's forward, timed under its layer kind; with `kda` or `cache`, a chunk that
  // continues a sequence (modules.h).
  void attention_forward(const LayerWeights& layer, const __nv_bfloat16* x, int64_t L,
                         DeviceBuffer<int32_t>& selection, __nv_bfloat16* y, bool reuse_selection,
                         KdaCarry* kda = nullptr, DsaCache* cache = nullptr);
  // `load` and `router_logits` as for moe_forward (MoE layers only).
  void ffn_forward(const LayerWeights& layer, const __nv_bfloat16* x, int64_t L, __nv_bfloat16* y,
                   std::vector<int64_t>* load = nullptr, float* router_logits = nullptr);

  ModelConfig config_;
  Context ctx_;
  DeviceWeights weights_, grads_;
};

}  // namespace spindle::cuda
