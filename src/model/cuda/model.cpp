#include "model/cuda/model.h"

#include <algorithm>
#include <deque>
#include <utility>

#include "kernels/cuda/balance_loss.h"
#include "kernels/cuda/embedding.h"
#include "kernels/cuda/norms.h"
#include "model/cuda/modules.h"
#include "model/cuda/residual.h"
#include "model/cuda/sequence.h"
#include "model/residual.h"

namespace spindle::cuda {

const char* attention_kind(const LayerWeights& layer) {
  return layer.attention == AttentionKind::Kda ? "kda" : "dsa";
}
const char* mlp_kind(const LayerWeights& layer) { return layer.mlp == MlpKind::Dense ? "mlp" : "moe"; }

CudaModel::CudaModel(const ModelConfig& config, const ModelWeights& host_weights, bool strict_kernels,
                     bool absorbed_mla)
    : config_(config),
      ctx_(strict_kernels, absorbed_mla),
      weights_(config, DeviceWeights::Kind::Weights),
      grads_(config, DeviceWeights::Kind::Gradients) {
  weights_.upload(host_weights);
  grads_.zero(ctx_.stream());
  ctx_.synchronize();
}

void CudaModel::begin(const char* kind) {
  if (ctx_.timer) ctx_.timer->begin(kind, ctx_.stream());
}
void CudaModel::end() {
  if (ctx_.timer) ctx_.timer->end(ctx_.stream());
}

std::vector<LayerCarry> CudaModel::start_carries(int64_t tokens, int64_t index_rows) {
  std::vector<LayerCarry> carries(weights_.tensors().layers.size());
  for (size_t i = 0; i < carries.size(); ++i) {
    const LayerWeights& layer = weights_.tensors().layers[i];
    if (layer.attention == AttentionKind::Kda)
      carries[i].kda.emplace(config_, ctx_.stream());
    else
      carries[i].dsa.emplace(config_, ctx_.absorbed_mla, layer.dsa.has_indexer, tokens, index_rows);
  }
  return carries;
}

void CudaModel::attention_forward(const LayerWeights& layer, const bf16* x, int64_t L,
                                  DeviceBuffer<int32_t>& selection, bf16* y, bool reuse_selection,
                                  KdaCarry* kda, DsaCache* cache, AttentionKept* keep) {
  begin(attention_kind(layer));
  if (layer.attention == AttentionKind::Kda) {
    if (kda != nullptr)
      kda_forward(ctx_, config_, layer.kda, x, L, y, *kda, keep);
    else
      kda_forward(ctx_, config_, layer.kda, x, L, y);
  } else {
    if (cache != nullptr)
      dsa_forward(ctx_, config_, layer.dsa, x, L, selection, y, reuse_selection, *cache, keep);
    else
      dsa_forward(ctx_, config_, layer.dsa, x, L, selection, y, reuse_selection);
  }
  end();
}

void CudaModel::ffn_forward(const LayerWeights& layer, const bf16* x, int64_t L, bf16* y,
                            std::vector<int64_t>* load, float* router_logits, MoeRouting* keep_routing) {
  begin(mlp_kind(layer));
  if (layer.mlp == MlpKind::Dense)
    mlp_forward(ctx_, layer.dense, config_.swiglu_limit, x, L, y);
  else
    moe_forward(ctx_, config_, layer.moe, x, L, y, load, router_logits, keep_routing);
  end();
}

void CudaModel::ffn_site_backward(const LayerWeights& layer, LayerWeights& grad, const bf16* x, int64_t L,
                                  DeviceBuffer<bf16>& dstreams, const BalanceLoss* balance_loss,
                                  DeviceBuffer<bf16>* kept_y, SiteMix* kept_mix, MoeRouting* kept_routing) {
  const ModelConfig& c = config_;
  residual_site_backward(
      ctx_, c, layer.ffn_hc, layer.post_attention_layernorm, L, x, dstreams, grad.ffn_hc,
      grad.post_attention_layernorm, [&](const bf16* in, bf16* y) { ffn_forward(layer, in, L, y); },
      [&](const bf16* in, const bf16* dy, float* dx, bf16*) {
        begin(mlp_kind(layer));
        if (layer.mlp == MlpKind::Dense)
          mlp_backward(ctx_, layer.dense, c.swiglu_limit, in, L, dy, dx, grad.dense);
        else
          moe_backward(ctx_, c, layer.moe, in, L, dy, dx, grad.moe, balance_loss, kept_routing);
        end();
      },
      kept_y, kept_mix);
}

DeviceBuffer<bf16> CudaModel::forward_chunk(const DeviceSequence& sequence, int64_t start, int64_t n,
                                            std::vector<LayerCarry>& carries, const FfnForward& ffn,
                                            const SelectionSeen& selected, bool carries_only) {
  const ModelConfig& c = config_;
  const ModelWeights& w = weights_.tensors();
  const int64_t H = c.hc_mult, D = c.hidden_size;
  DeviceBuffer<bf16> streams = activations(n * H * D), next = activations(n * H * D);
  embed_streams(sequence.ids.data() + start, bf16_data(w.embed_tokens), streams.data(), n, H, D,
                ctx_.stream());
  DeviceBuffer<int32_t> selection;  // the last DSA selection, for a following shared layer
  SiteChain chain;
  const size_t last = carries_only ? w.layers.size() - 1 : w.layers.size();
  for (size_t i = 0; i < w.layers.size(); ++i) {
    const LayerWeights& layer = w.layers[i];
    LayerCarry& carry = carries[i];
    chain.next = &layer.ffn_hc;
    residual_site_forward(
        ctx_, c, layer.attn_hc, layer.input_layernorm, n, streams.data(), i == last ? nullptr : next.data(),
        [&](const bf16* x, bf16* y) {  // the last layer's output: read by nothing, not made
          attention_forward(layer, x, n, selection, i == last ? nullptr : y, false,
                            carry.kda ? &*carry.kda : nullptr, carry.dsa ? &*carry.dsa : nullptr);
        },
        nullptr, nullptr, &chain);
    if (selected && layer.attention == AttentionKind::Dsa && layer.dsa.has_indexer)
      selected(i, start, selection);
    if (i == last) return {};
    std::swap(streams, next);
    chain.next = i + 1 < w.layers.size() ? &w.layers[i + 1].attn_hc : nullptr;
    residual_site_forward(
        ctx_, c, layer.ffn_hc, layer.post_attention_layernorm, n, streams.data(), next.data(),
        [&](const bf16* x, bf16* y) { ffn(i, x, y); }, nullptr, nullptr, &chain);
    std::swap(streams, next);
  }
  return streams;
}

void CudaModel::head_input(const bf16* streams, int64_t n, bf16* mean, bf16* hidden) {
  const ModelConfig& c = config_;
  stream_mean(streams, mean, n, c.hc_mult, c.hidden_size, ctx_.stream());
  rms_norm_forward(mean, bf16_data(weights_.tensors().norm), hidden, n, c.hidden_size,
                   static_cast<float>(c.rms_norm_eps), ctx_.stream());
}

std::vector<float> CudaModel::log_probs(const std::vector<int32_t>& tokens, int64_t chunk_tokens,
                                        const SelectionSeen& selected) {
  const ModelConfig& c = config_;
  const ModelWeights& w = weights_.tensors();
  const auto L = static_cast<int64_t>(tokens.size());
  const int64_t D = c.hidden_size, V = c.vocab_size;
  check_sequence(tokens, V);
  check(chunk_tokens >= 0, "chunk_tokens must be >= 0, got ", chunk_tokens);
  const int64_t chunk = chunk_tokens > 0 ? std::min(chunk_tokens, L) : L;
  const cudaStream_t s = ctx_.stream();
  const DeviceSequence sequence(tokens);
  DeviceBuffer<float> log_prob = activations_f32(L);
  // One chunk needs no carry past each layer (the modules keep their own for the layer's length).
  std::vector<LayerCarry> carries = chunk < L ? start_carries(L, chunk % c.index_kpool == 0 ? chunk : 0)
                                              : std::vector<LayerCarry>(w.layers.size());

  for (int64_t start = 0; start < L; start += chunk) {
    const int64_t n = std::min(chunk, L - start);
    const DeviceBuffer<bf16> streams = forward_chunk(
        sequence, start, n, carries,
        [&](size_t i, const bf16* x, bf16* y) { ffn_forward(w.layers[i], x, n, y); }, selected);

    // The head over this chunk's rows: row r predicts token start + r + 1 (the last row of the
    // sequence predicts nothing).
    begin("head");
    DeviceBuffer<bf16> mean = activations(n * D), hidden = activations(n * D);
    head_input(streams.data(), n, mean.data(), hidden.data());
    ctx_.head.forward(hidden.data(), bf16_data(w.lm_head), sequence.targets.data() + start,
                      log_prob.data() + start, nullptr, nullptr, n, D, V, s);
    end();
  }
  ctx_.record.note("head", "cuda chunked lm_head + cross-entropy");
  std::vector<float> result = log_prob.download();
  result.pop_back();
  return result;
}

LossResult CudaModel::loss_and_gradients(const std::vector<int32_t>& tokens, const LossOptions& options) {
  const ModelConfig& c = config_;
  const ModelWeights& w = weights_.tensors();
  ModelWeights& g = grads_.tensors();
  const auto L = static_cast<int64_t>(tokens.size());
  const int64_t H = c.hc_mult, D = c.hidden_size, V = c.vocab_size, E = c.n_routed_experts;
  check_sequence(tokens, V);
  check(options.chunk_tokens >= 0, "chunk_tokens must be >= 0, got ", options.chunk_tokens);
  if (options.chunk_tokens > 0 && options.chunk_tokens < L) {
    check(
        options.site_memory == SiteMemory::KeepSites,
        "the streaming executor keeps its own chunk's sites; it does not recompute or offload layer inputs");
    return streamed_loss_and_gradients(tokens, options);
  }
  const cudaStream_t s = ctx_.stream();
  const DeviceSequence sequence(tokens);
  const size_t layers = w.layers.size();
  const bool all_sites = options.site_memory == SiteMemory::KeepSites;
  const bool offload = options.site_memory == SiteMemory::OffloadLayerInputs;
  if (offload) offload_.reserve(layers, static_cast<size_t>(L * H * D));

  // Forward, keeping every DSA layer's selection and the input of every residual site, or of the
  // attention sites only (each layer's input), those on the host once two later ones are out.
  std::vector<DeviceBuffer<bf16>> site_inputs(2 * layers);
  std::deque<size_t> on_device;  // offload: the layers whose input is still on the device
  std::vector<bool> on_host(layers, false);
  DeviceBuffer<bf16> streams = activations(L * H * D);
  embed_streams(sequence.ids.data(), bf16_data(w.embed_tokens), streams.data(), L, H, D, s);
  std::vector<std::shared_ptr<DeviceBuffer<int32_t>>> selections(layers);
  std::shared_ptr<DeviceBuffer<int32_t>> selection;
  LossResult result;
  result.expert_load.resize(layers);
  const bool balance = options.aux_loss_coef > 0;
  DeviceBuffer<double> balance_stats(balance ? static_cast<size_t>(2 * E) : 0, MemoryCategory::Workspace);
  if (balance) SPINDLE_CUDA(cudaMemsetAsync(balance_stats.data(), 0, 2 * E * sizeof(double), s));
  double balance_rows = 0;

  const auto run_site = [&](size_t index, const HyperConnectionWeights& hc, const Tensor& norm,
                            const SublayerForward& sublayer) {
    DeviceBuffer<bf16> next = activations(L * H * D);
    residual_site_forward(ctx_, c, hc, norm, L, streams.data(), next.data(), sublayer);
    const bool layer_input = index % 2 == 0;
    if (layer_input || all_sites) site_inputs[index] = std::move(streams);
    streams = std::move(next);  // a feed-forward input not kept is freed
    if (!offload || !layer_input) return;
    const size_t layer = index / 2;
    offload_.send(layer, site_inputs[index].data(), s);
    on_device.push_back(layer);
    if (on_device.size() > 2) {  // the oldest one's copy has had a whole layer's time to land
      const size_t out = on_device.front();
      on_device.pop_front();
      offload_.wait_sent(out, s);
      site_inputs[2 * out] = DeviceBuffer<bf16>();
      on_host[out] = true;
    }
  };
  for (size_t i = 0; i < layers; ++i) {
    const LayerWeights& layer = w.layers[i];
    run_site(2 * i, layer.attn_hc, layer.input_layernorm, [&](const bf16* x, bf16* y) {
      begin(attention_kind(layer));
      if (layer.attention == AttentionKind::Kda) {
        kda_forward(ctx_, c, layer.kda, x, L, y);
      } else {
        if (layer.dsa.has_indexer || !selection) selection = std::make_shared<DeviceBuffer<int32_t>>();
        dsa_forward(ctx_, c, layer.dsa, x, L, *selection, y);
        selections[i] = selection;
      }
      end();
    });
    run_site(2 * i + 1, layer.ffn_hc, layer.post_attention_layernorm, [&](const bf16* x, bf16* y) {
      begin(mlp_kind(layer));
      if (layer.mlp == MlpKind::Dense) {
        mlp_forward(ctx_, layer.dense, c.swiglu_limit, x, L, y);
      } else {
        DeviceBuffer<float> logits = activations_f32(balance ? L * E : 0);
        moe_forward(ctx_, c, layer.moe, x, L, y, &result.expert_load[i], balance ? logits.data() : nullptr);
        if (balance) {
          balance_statistics(logits.data(), L, E, c.num_experts_per_tok, balance_stats.data(),
                             balance_stats.data() + E, s);
          balance_rows += static_cast<double>(L);
        }
      }
      end();
    });
  }
  BalanceLoss balance_loss{options.aux_loss_coef * options.scale, balance_stats.data(), balance_rows};
  if (balance) {
    const std::vector<double> stats = balance_stats.download();
    result.aux_loss = balance_loss_value(stats.data(), stats.data() + E, E, balance_rows);
  }

  // Exit and head: mean over streams, final norm, the fused lm_head + cross-entropy.
  begin("head");
  DeviceBuffer<bf16> mean = activations(L * D), hidden = activations(L * D);
  head_input(streams.data(), L, mean.data(), hidden.data());
  streams = DeviceBuffer<bf16>();
  DeviceBuffer<float> log_prob = activations_f32(L), loss = activations_f32(1);
  DeviceBuffer<bf16> dhidden = activations(L * D), dmean = activations(L * D);
  ctx_.head.forward_backward(hidden.data(), bf16_data(w.lm_head), sequence.targets.data(), log_prob.data(),
                             nullptr, loss.data(),
                             static_cast<float>(options.scale / static_cast<double>(L - 1)), dhidden.data(),
                             f32_data(g.lm_head), L, D, V, s);
  rms_norm_backward(mean.data(), bf16_data(w.norm), dhidden.data(), dmean.data(), f32_data(g.norm), L, D,
                    static_cast<float>(c.rms_norm_eps), s);
  DeviceBuffer<bf16> dstreams = activations(L * H * D);
  stream_mean_backward(dmean.data(), dstreams.data(), L, H, D, s);
  end();
  ctx_.record.note("head", "cuda chunked lm_head + cross-entropy");

  // Layers in reverse: the feed-forward site, then the attention site.
  IndexerLoss indexer_loss(options.indexer_kl_coef * options.scale, s);
  for (size_t i = layers; i-- > 0;) {
    const LayerWeights& layer = w.layers[i];
    LayerWeights& grad = g.layers[i];
    if (offload) {  // this layer's input back (fetched one layer early), the previous one's on its way
      const auto fetch = [&](size_t j) {
        site_inputs[2 * j] = activations(L * H * D);
        offload_.fetch(j, site_inputs[2 * j].data(), s);
      };
      if (on_host[i] && site_inputs[2 * i].data() == nullptr) fetch(i);
      if (on_host[i]) offload_.wait_fetched(i, s);
      if (i > 0 && on_host[i - 1]) fetch(i - 1);
    }
    DeviceBuffer<int32_t> unused;  // KDA layers select nothing
    DeviceBuffer<int32_t>& chosen = selections[i] ? *selections[i] : unused;
    if (!all_sites) {  // the feed-forward site's input: the attention site once more
      site_inputs[2 * i + 1] = activations(L * H * D);
      residual_site_forward(ctx_, c, layer.attn_hc, layer.input_layernorm, L, site_inputs[2 * i].data(),
                            site_inputs[2 * i + 1].data(),
                            [&](const bf16* x, bf16* y) { attention_forward(layer, x, L, chosen, y, true); });
    }
    ffn_site_backward(layer, grad, site_inputs[2 * i + 1].data(), L, dstreams,
                      balance ? &balance_loss : nullptr);
    site_inputs[2 * i + 1] = DeviceBuffer<bf16>();
    residual_site_backward(
        ctx_, c, layer.attn_hc, layer.input_layernorm, L, site_inputs[2 * i].data(), dstreams, grad.attn_hc,
        grad.input_layernorm, {}, [&](const bf16* x, const bf16* dy, float* dx, bf16* y) {
          begin(attention_kind(layer));
          if (layer.attention == AttentionKind::Kda)
            kda_backward(ctx_, c, layer.kda, x, L, dy, dx, grad.kda, y);
          else
            dsa_backward(ctx_, c, layer.dsa, x, L, chosen.data(), dy, dx, grad.dsa, &indexer_loss, y);
          end();
        });
    // A layer whose input stayed on the device may still be copying it out (the last two).
    if (offload && !on_host[i]) offload_.wait_sent(i, s);
    site_inputs[2 * i] = DeviceBuffer<bf16>();
  }

  // Embedding: every stream started as the token's row.
  embed_backward(sequence.ids.data(), dstreams.data(), f32_data(g.embed_tokens), L, H, D,
                 c.pad_token_id && *c.pad_token_id < V ? static_cast<int32_t>(*c.pad_token_id) : -1, s);
  result.loss = static_cast<double>(loss.download()[0]);
  indexer_loss.read(L, result);
  return result;
}

}  // namespace spindle::cuda
