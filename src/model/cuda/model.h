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

  // log p(tokens[i] | tokens[<i]) for i = 1 .. n-1.
  std::vector<float> log_probs(const std::vector<int32_t>& tokens);

  // As spindle::loss_and_gradients: accumulates the gradients into grads().
  LossResult loss_and_gradients(const std::vector<int32_t>& tokens, const LossOptions& options = {});

 private:
  void begin(const char* kind);
  void end();
  // One sublayer's forward, timed under its layer kind.
  void attention_forward(const LayerWeights& layer, const __nv_bfloat16* x, int64_t L,
                         DeviceBuffer<int32_t>& selection, __nv_bfloat16* y, bool reuse_selection);
  void ffn_forward(const LayerWeights& layer, const __nv_bfloat16* x, int64_t L, __nv_bfloat16* y);

  ModelConfig config_;
  Context ctx_;
  DeviceWeights weights_, grads_;
};

}  // namespace spindle::cuda
