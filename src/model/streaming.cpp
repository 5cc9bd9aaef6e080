#include "model/streaming.h"

#include <algorithm>

#include "core/progress.h"
#include "kernels/cpu/linear.h"
#include "kernels/cpu/loss.h"
#include "kernels/cpu/norms.h"
#include "model/balance_loss.h"
#include "model/modules.h"
#include "model/residual.h"

namespace spindle {

namespace {

// The DSA cache as it stood before position `first`: what a recomputed chunk attends to.
template <class T>
DsaCarry<T> cache_before(const DsaCarry<T>& cache, int64_t first, int64_t row, int64_t index_dim) {
  DsaCarry<T> prefix;
  prefix.tokens = first;
  prefix.kv.assign(cache.kv.begin(), cache.kv.begin() + first * row);
  if (!cache.index_keys.empty()) {
    prefix.index_keys.assign(cache.index_keys.begin(), cache.index_keys.begin() + first * index_dim);
    prefix.index_gate.assign(cache.index_gate.begin(), cache.index_gate.begin() + first * index_dim);
  }
  return prefix;
}

}  // namespace

template <class T>
LossResult streamed_loss_and_gradients(const ModelConfig& c, const ModelWeights& w,
                                       const std::vector<int32_t>& tokens, ModelWeights& g,
                                       const LossOptions& options) {
  const bool balance = options.aux_loss_coef > 0;
  BalanceStats stats;  // pooled over every chunk's tokens before any gradient
  const auto L = static_cast<int64_t>(tokens.size());
  const int64_t D = c.hidden_size, V = c.vocab_size, chunk = options.chunk_tokens;
  const int64_t row = c.num_attention_heads * (c.qk_head_dim() + c.v_head_dim), index_dim = c.index_head_dim;
  check_sequence(tokens, V);
  check(chunk > 0, "chunk_tokens must be positive, got ", chunk);
  const size_t layers = w.layers.size();
  const auto chunks = static_cast<size_t>((L + chunk - 1) / chunk);
  const auto piece = [&](size_t k) {
    const int64_t start = static_cast<int64_t>(k) * chunk;
    return std::vector<int32_t>(tokens.begin() + start, tokens.begin() + std::min(L, start + chunk));
  };
  LossResult result;
  result.expert_load.resize(layers);

  // Forward, chunk by chunk: keep the KDA carries at each chunk's start, grow the DSA caches.
  std::vector<KdaCarry<T>> kda(layers, KdaCarry<T>(c));
  std::vector<DsaCarry<T>> cache(layers);
  std::vector<std::vector<KdaCarry<T>>> kda_starts;
  Progress progress("streamed step (CPU)");
  for (size_t k = 0; k < chunks; ++k) {
    progress.update("forward chunk", k, chunks);
    kda_starts.push_back(kda);
    const std::vector<int32_t> ids = piece(k);
    const auto n = static_cast<int64_t>(ids.size());
    std::vector<T> streams = embedded_streams<T>(c, w, ids);
    std::vector<int32_t> selection;
    for (size_t i = 0; i < layers; ++i) {
      const LayerWeights& layer = w.layers[i];
      residual_site_forward<T>(c, layer.attn_hc, layer.input_layernorm, n, streams, [&](const T* x, T* y) {
        if (layer.attention == AttentionKind::Kda)
          kda_forward(c, layer.kda, x, n, y, kda[i]);
        else
          dsa_forward(c, layer.dsa, x, n, selection, y, cache[i]);
      });
      residual_site_forward<T>(c, layer.ffn_hc, layer.post_attention_layernorm, n, streams,
                               [&](const T* x, T* y) {
                                 if (layer.mlp == MlpKind::Dense) {
                                   mlp_forward(layer.dense, c.swiglu_limit, x, n, y);
                                 } else {
                                   std::vector<int64_t> load;
                                   std::vector<T> logits;
                                   moe_forward(c, layer.moe, x, n, y, &load, balance ? &logits : nullptr);
                                   if (balance) add_balance_stats(c, logits.data(), n, stats);
                                   auto& total = result.expert_load[i];
                                   total.resize(load.size(), 0);
                                   for (size_t e = 0; e < load.size(); ++e) total[e] += load[e];
                                 }
                               });
    }
  }

  if (balance) result.aux_loss = balance_value(c, stats);

  // Backward, last chunk first. Across chunks flow only the KDA carries' gradients and the DSA
  // caches' gradients (keys and values; the indexer's pooled keys, keys and gates); everything
  // else is per token.
  std::vector<KdaCarry<T>> kda_grad(layers, KdaCarry<T>(c));
  std::vector<DsaCacheGrad<T>> cache_grad;
  for (size_t i = 0; i < layers; ++i) cache_grad.emplace_back(c, cache[i]);
  IndexerLoss indexer_loss{options.indexer_kl_coef * options.scale};
  const T scale = T(options.scale) / T(L - 1);
  double log_prob_sum = 0;
  for (size_t k = chunks; k-- > 0;) {
    progress.update("backward chunk", chunks - 1 - k, chunks);
    const std::vector<int32_t> ids = piece(k);
    const auto n = static_cast<int64_t>(ids.size());
    const int64_t start = static_cast<int64_t>(k) * chunk;

    // Recompute the chunk through all layers, keeping each site's input and each DSA selection.
    std::vector<std::vector<T>> site_inputs(2 * layers);
    std::vector<std::vector<int32_t>> selections(layers);
    std::vector<T> streams = embedded_streams<T>(c, w, ids);
    std::vector<int32_t> selection;
    const auto attention = [&](size_t i, const T* x, T* y) {
      const LayerWeights& layer = w.layers[i];
      if (layer.attention == AttentionKind::Kda) {
        KdaCarry<T> carry = kda_starts[k][i];
        kda_forward(c, layer.kda, x, n, y, carry);
      } else {
        DsaCarry<T> prefix = cache_before(cache[i], start, row, index_dim);
        std::vector<int32_t> chosen = selection;
        dsa_forward(c, layer.dsa, x, n, chosen, y, prefix);
        selections[i] = chosen;
      }
    };
    std::vector<T> router_logits;  // of the MoE site being recomputed, for the balance loss
    const auto ffn = [&](size_t i, const T* x, T* y) {
      const LayerWeights& layer = w.layers[i];
      if (layer.mlp == MlpKind::Dense)
        mlp_forward(layer.dense, c.swiglu_limit, x, n, y);
      else
        moe_forward(c, layer.moe, x, n, y, nullptr, balance ? &router_logits : nullptr);
    };
    for (size_t i = 0; i < layers; ++i) {
      const LayerWeights& layer = w.layers[i];
      site_inputs[2 * i] = streams;
      residual_site_forward<T>(c, layer.attn_hc, layer.input_layernorm, n, streams,
                               [&](const T* x, T* y) { attention(i, x, y); });
      if (!selections[i].empty()) selection = selections[i];
      site_inputs[2 * i + 1] = streams;
      residual_site_forward<T>(c, layer.ffn_hc, layer.post_attention_layernorm, n, streams,
                               [&](const T* x, T* y) { ffn(i, x, y); });
    }

    // The head over this chunk's rows: row r predicts token start + r + 1, when there is one.
    const std::vector<T> mean = streams_mean(c, streams, n);
    std::vector<T> hidden(mean.size()), dhidden(mean.size(), T(0));
    cpu::rms_norm(mean.data(), w.norm.data<T>(), hidden.data(), n, D, c.rms_norm_eps);
    const int64_t predictions = std::min(n, L - 1 - start);
    if (predictions > 0) {
      std::vector<T> logits(static_cast<size_t>(predictions * V));
      cpu::linear(hidden.data(), w.lm_head.data<T>(), logits.data(), predictions, D, V);
      log_prob_sum +=
          cpu::target_log_probs_backward(logits.data(), tokens.data() + start + 1, predictions, V, scale);
      cpu::linear_backward(hidden.data(), w.lm_head.data<T>(), logits.data(), dhidden.data(),
                           g.lm_head.data<T>(), predictions, D, V);
    }
    std::vector<T> dmean(mean.size());
    cpu::rms_norm_backward(mean.data(), w.norm.data<T>(), dhidden.data(), dmean.data(), g.norm.data<T>(), n,
                           D, c.rms_norm_eps);
    std::vector<T> dstreams = streams_mean_backward(c, dmean, n);

    for (size_t i = layers; i-- > 0;) {
      const LayerWeights& layer = w.layers[i];
      LayerWeights& grad = g.layers[i];
      residual_site_backward<T>(
          c, layer.ffn_hc, layer.post_attention_layernorm, n, site_inputs[2 * i + 1], dstreams, grad.ffn_hc,
          grad.post_attention_layernorm, [&](const T* x, T* y) { ffn(i, x, y); },
          [&](const T* x, const T* dy, T* dx) {
            if (layer.mlp == MlpKind::Dense) {
              mlp_backward(layer.dense, c.swiglu_limit, x, n, dy, dx, grad.dense);
              return;
            }
            std::vector<T> aux_dlogits;
            if (balance) {
              aux_dlogits.resize(router_logits.size());
              balance_gradient(c, router_logits.data(), n, stats, options.aux_loss_coef * options.scale,
                               aux_dlogits.data());
            }
            moe_backward(c, layer.moe, x, n, dy, dx, grad.moe, balance ? aux_dlogits.data() : nullptr);
          });
      residual_site_backward<T>(
          c, layer.attn_hc, layer.input_layernorm, n, site_inputs[2 * i], dstreams, grad.attn_hc,
          grad.input_layernorm,
          [&](const T* x, T* y) {
            if (layer.attention == AttentionKind::Dsa) selection = selections[i];
            attention(i, x, y);
          },
          [&](const T* x, const T* dy, T* dx) {
            if (layer.attention == AttentionKind::Kda)
              kda_backward(c, layer.kda, x, n, dy, dx, grad.kda, kda_starts[k][i], kda_grad[i]);
            else
              dsa_backward(c, layer.dsa, x, n, selections[i], dy, dx, grad.dsa, &indexer_loss, cache[i],
                           start, cache_grad[i]);
          });
    }

    embedding_backward(c, ids, dstreams, g);
  }
  result.loss = -log_prob_sum / static_cast<double>(L - 1);
  indexer_loss.read(result);
  return result;
}

template LossResult streamed_loss_and_gradients<float>(const ModelConfig&, const ModelWeights&,
                                                       const std::vector<int32_t>&, ModelWeights&,
                                                       const LossOptions&);
template LossResult streamed_loss_and_gradients<double>(const ModelConfig&, const ModelWeights&,
                                                        const std::vector<int32_t>&, ModelWeights&,
                                                        const LossOptions&);

}  // namespace spindle
