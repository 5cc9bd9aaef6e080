// The whole model on one GPU for one sequence: bf16 weights (fp32 for the small parameters),
// fp32 gradients, the same passes as the CPU reference (model/forward.cpp, model/backward.cpp):
// the forward keeps each residual site's input streams (or each layer's, on the device or the
// host: LossOptions::site_memory), the backward recomputes each sublayer.
#pragma once

#include <functional>
#include <map>
#include <string>
#include <vector>

#include "model/backward.h"
#include "model/config.h"
#include "model/cuda/context.h"
#include "model/cuda/device_weights.h"
#include "model/cuda/layer_offload.h"
#include "model/cuda/modules.h"
#include "model/cuda/residual.h"
#include "model/cuda/sequence.h"
#include "model/weights.h"

namespace spindle::cuda {

// The timer's kind for a layer's attention ("kda", "dsa") and feed-forward ("mlp", "moe") work.
const char* attention_kind(const LayerWeights& layer);
const char* mlp_kind(const LayerWeights& layer);

class CudaModel {
 public:
  CudaModel(const ModelConfig& config, const ModelWeights& host_weights, bool strict_kernels = false,
            bool absorbed_mla = false);

  const ModelConfig& config() const { return config_; }
  Context& context() { return ctx_; }
  DeviceWeights& weights() { return weights_; }
  DeviceWeights& grads() { return grads_; }
  void set_timer(KindTimer* timer) { ctx_.timer = timer; }

  // Sees the selection of each DSA layer with its own indexer for a chunk of queries from `first`
  // on ([queries, width] on the device).
  using SelectionSeen =
      std::function<void(size_t layer, int64_t first, const DeviceBuffer<int32_t>& selection)>;

  // log p(tokens[i] | tokens[<i]) for i = 1 .. n-1, computed chunk_tokens tokens at a time through
  // all layers (0: the whole sequence as one chunk; the same values within bf16 rounding).
  // selected, where set, sees every chunk's DSA selections.
  std::vector<float> log_probs(const std::vector<int32_t>& tokens, int64_t chunk_tokens = 0,
                               const SelectionSeen& selected = {});

  // As spindle::loss_and_gradients: accumulates the gradients into grads(). With
  // options.chunk_tokens in (0, tokens), the streaming executor (docs/STREAMING.md); else what
  // the backward needs is kept as options.site_memory says.
  LossResult loss_and_gradients(const std::vector<int32_t>& tokens, const LossOptions& options = {});

 private:
  // The streaming executor's loss and gradients (model/cuda/streaming.cpp).
  LossResult streamed_loss_and_gradients(const std::vector<int32_t>& tokens, const LossOptions& options);
  // Each layer's carry for a streamed sequence of `tokens` tokens: zero KDA carries, empty DSA
  // caches with room for the whole sequence (the indexer's rows for index_rows tokens: DsaCache).
  std::vector<LayerCarry> start_carries(int64_t tokens, int64_t index_rows = 0);

  // Tokens start .. start + n of `sequence` forward through all layers, each attention sublayer
  // continuing from its carry (if any); ffn(i, x, y) runs layer i's feed-forward sublayer;
  // selected(i, start, selection), where set, sees the selection of each DSA layer i with its own
  // indexer. Returns the last layer's output streams [n, hc_mult, hidden]; with carries_only, nothing:
  // it stops after the last layer's attention sublayer, since nothing after it moves a carry on
  // (every layer's attention carries one: start_carries).
  using FfnForward = std::function<void(size_t layer, const __nv_bfloat16* x, __nv_bfloat16* y)>;
  DeviceBuffer<__nv_bfloat16> forward_chunk(const DeviceSequence& sequence, int64_t start, int64_t n,
                                            std::vector<LayerCarry>& carries, const FfnForward& ffn,
                                            const SelectionSeen& selected = {}, bool carries_only = false);
  // The head's input for n rows: the mean over the residual streams (kept for the backward), then
  // the final norm.
  void head_input(const __nv_bfloat16* streams, int64_t n, __nv_bfloat16* mean, __nv_bfloat16* hidden);

  void begin(const char* kind);
  void end();
  // One sublayer's forward, timed under its layer kind; with `kda` or `cache`, a chunk that
  // continues a sequence, which fills `keep` if given (modules.h).
  void attention_forward(const LayerWeights& layer, const __nv_bfloat16* x, int64_t L,
                         DeviceBuffer<int32_t>& selection, __nv_bfloat16* y, bool reuse_selection,
                         KdaCarry* kda = nullptr, DsaCache* cache = nullptr, AttentionKept* keep = nullptr);
  // Layer `layer`'s feed-forward residual site backward from its input streams `x` [L, hc_mult,
  // hidden]: dstreams comes in as the gradient of its output and leaves as that of its input.
  // `kept_y`, `kept_mix` and `kept_routing` (if not null and not empty): the feed-forward's
  // output, the site's mHC mix and a MoE's routing, taken instead of recomputed.
  void ffn_site_backward(const LayerWeights& layer, LayerWeights& grad, const __nv_bfloat16* x, int64_t L,
                         DeviceBuffer<__nv_bfloat16>& dstreams, const BalanceLoss* balance_loss,
                         DeviceBuffer<__nv_bfloat16>* kept_y = nullptr, SiteMix* kept_mix = nullptr,
                         MoeRouting* kept_routing = nullptr);
  // `load`, `router_logits` and `keep_routing` as for moe_forward's `keep` (MoE layers only).
  void ffn_forward(const LayerWeights& layer, const __nv_bfloat16* x, int64_t L, __nv_bfloat16* y,
                   std::vector<int64_t>* load = nullptr, float* router_logits = nullptr,
                   MoeRouting* keep_routing = nullptr);

  ModelConfig config_;
  Context ctx_;
  DeviceWeights weights_, grads_;
  OffloadedLayerInputs offload_;  // SiteMemory::OffloadLayerInputs: the pinned pool, kept across steps
};

}  // namespace spindle::cuda
