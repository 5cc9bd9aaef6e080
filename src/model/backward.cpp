#include "model/backward.h"

#include <algorithm>
#include <cmath>

#include "kernels/cpu/linear.h"
#include "kernels/cpu/loss.h"
#include "model/balance_loss.h"
#include "model/modules.h"
#include "model/residual.h"
#include "model/streaming.h"

namespace spindle {

ModelWeights zero_gradients(const ModelConfig& config, DType dtype) {
  ModelWeights grads = allocate_weights(config, dtype);
  for (Param& p : parameter_table(config, grads)) p.tensor.fill_zero();
  if (!config.tie_word_embeddings) grads.lm_head.fill_zero();
  return grads;
}

template <class T>
LossResult loss_and_gradients(const ModelConfig& c, const ModelWeights& w, const std::vector<int32_t>& tokens,
                              ModelWeights& g, const LossOptions& options) {
  check(w.dtype == dtype_of<T>() && g.dtype == dtype_of<T>(), "loss_and_gradients in ",
        dtype_name(dtype_of<T>()), " over weights in ", dtype_name(w.dtype), " and gradients in ",
        dtype_name(g.dtype));
  const auto L = static_cast<int64_t>(tokens.size());
  const int64_t D = c.hidden_size, V = c.vocab_size;
  check_sequence(tokens, V);
  check(options.site_memory == SiteMemory::KeepSites,
        "the CPU reference keeps every residual site: recomputing or offloading layer inputs is the GPU "
        "executor's");
  if (options.chunk_tokens > 0 && options.chunk_tokens < L)
    return streamed_loss_and_gradients<T>(c, w, tokens, g, options);

  // Forward, keeping the input of every residual site and every DSA layer's selection.
  std::vector<T> streams = embedded_streams<T>(c, w, tokens);
  const size_t layers = w.layers.size();
  std::vector<std::vector<T>> site_inputs(2 * layers);
  std::vector<std::vector<int32_t>> selections(layers);
  std::vector<int32_t> selection;
  LossResult result;
  result.expert_load.resize(layers);
  std::vector<std::vector<T>> router_logits(layers);
  for (size_t i = 0; i < layers; ++i) {
    const LayerWeights& layer = w.layers[i];
    site_inputs[2 * i] = streams;
    residual_site_forward<T>(c, layer.attn_hc, layer.input_layernorm, L, streams, [&](const T* x, T* y) {
      if (layer.attention == AttentionKind::Kda) {
        kda_forward(c, layer.kda, x, L, y);
      } else {
        dsa_forward(c, layer.dsa, x, L, selection, y);
        selections[i] = selection;
      }
    });
    site_inputs[2 * i + 1] = streams;
    residual_site_forward<T>(
        c, layer.ffn_hc, layer.post_attention_layernorm, L, streams, [&](const T* x, T* y) {
          if (layer.mlp == MlpKind::Dense)
            mlp_forward(layer.dense, c.swiglu_limit, x, L, y);
          else
            moe_forward(c, layer.moe, x, L, y, &result.expert_load[i], &router_logits[i]);
        });
  }
  std::vector<std::vector<T>> aux_dlogits(layers);
  if (options.aux_loss_coef > 0) {
    BalanceStats stats;
    for (const auto& logits : router_logits)
      if (!logits.empty())
        add_balance_stats(c, logits.data(), static_cast<int64_t>(logits.size()) / c.n_routed_experts, stats);
    result.aux_loss = balance_value(c, stats);
    for (size_t i = 0; i < layers; ++i) {
      if (router_logits[i].empty()) continue;
      aux_dlogits[i].resize(router_logits[i].size());
      balance_gradient(c, router_logits[i].data(), L, stats, options.aux_loss_coef * options.scale,
                       aux_dlogits[i].data());
    }
  }
  router_logits.clear();
  IndexerLoss indexer_loss{options.indexer_kl_coef * options.scale};

  // Exit and head: mean over streams, final norm, lm_head + softmax cross-entropy by blocks.
  const std::vector<T> mean = streams_mean(c, streams, L);
  std::vector<T> hidden(mean.size());
  cpu::rms_norm(mean.data(), w.norm.data<T>(), hidden.data(), L, D, c.rms_norm_eps);
  const int64_t targets = L - 1;
  const T scale = T(options.scale) / T(targets);
  std::vector<T> dhidden(static_cast<size_t>(L * D), T(0));
  const int64_t block = std::max<int64_t>(1, options.head_block);
  std::vector<T> logits(static_cast<size_t>(std::min(block, targets) * V));
  double log_prob_sum = 0;
  for (int64_t start = 0; start < targets; start += block) {
    const int64_t rows = std::min(block, targets - start);
    cpu::linear(hidden.data() + start * D, w.lm_head.data<T>(), logits.data(), rows, D, V);
    log_prob_sum += cpu::target_log_probs_backward(logits.data(), tokens.data() + start + 1, rows, V, scale);
    cpu::linear_backward(hidden.data() + start * D, w.lm_head.data<T>(), logits.data(),
                         dhidden.data() + start * D, g.lm_head.data<T>(), rows, D, V);
  }
  std::vector<T> dmean(static_cast<size_t>(L * D));
  cpu::rms_norm_backward(mean.data(), w.norm.data<T>(), dhidden.data(), dmean.data(), g.norm.data<T>(), L, D,
                         c.rms_norm_eps);
  std::vector<T> dstreams = streams_mean_backward(c, dmean, L);

  // Layers in reverse: the feed-forward site, then the attention site.
  for (size_t i = layers; i-- > 0;) {
    const LayerWeights& layer = w.layers[i];
    LayerWeights& grad = g.layers[i];
    residual_site_backward<T>(
        c, layer.ffn_hc, layer.post_attention_layernorm, L, site_inputs[2 * i + 1], dstreams, grad.ffn_hc,
        grad.post_attention_layernorm,
        [&](const T* x, T* y) {
          if (layer.mlp == MlpKind::Dense)
            mlp_forward(layer.dense, c.swiglu_limit, x, L, y);
          else
            moe_forward(c, layer.moe, x, L, y);
        },
        [&](const T* x, const T* dy, T* dx) {
          if (layer.mlp == MlpKind::Dense)
            mlp_backward(layer.dense, c.swiglu_limit, x, L, dy, dx, grad.dense);
          else
            moe_backward(c, layer.moe, x, L, dy, dx, grad.moe,
                         aux_dlogits[i].empty() ? nullptr : aux_dlogits[i].data());
        });
    site_inputs[2 * i + 1].clear();
    site_inputs[2 * i + 1].shrink_to_fit();
    residual_site_backward<T>(
        c, layer.attn_hc, layer.input_layernorm, L, site_inputs[2 * i], dstreams, grad.attn_hc,
        grad.input_layernorm,
        [&](const T* x, T* y) {
          if (layer.attention == AttentionKind::Kda)
            kda_forward(c, layer.kda, x, L, y);
          else
            dsa_forward(c, layer.dsa, x, L, selections[i], y);
        },
        [&](const T* x, const T* dy, T* dx) {
          if (layer.attention == AttentionKind::Kda)
            kda_backward(c, layer.kda, x, L, dy, dx, grad.kda);
          else
            dsa_backward(c, layer.dsa, x, L, selections[i], dy, dx, grad.dsa, &indexer_loss);
        });
    site_inputs[2 * i].clear();
    site_inputs[2 * i].shrink_to_fit();
  }

  embedding_backward(c, tokens, dstreams, g);
  result.loss = -log_prob_sum / static_cast<double>(targets);
  indexer_loss.read(result);
  return result;
}

template LossResult loss_and_gradients<float>(const ModelConfig&, const ModelWeights&,
                                              const std::vector<int32_t>&, ModelWeights&, const LossOptions&);
template LossResult loss_and_gradients<double>(const ModelConfig&, const ModelWeights&,
                                               const std::vector<int32_t>&, ModelWeights&,
                                               const LossOptions&);

}  // namespace spindle
