// The streaming executor on the GPU: the loss and gradients of one sequence computed a chunk of
// tokens at a time, as the CPU reference does (model/streaming.cpp, docs/STREAMING.md). The
// forward goes through all layers chunk by chunk, keeping each KDA layer's carry at every chunk's
// start, growing each DSA layer's cache and keeping its selections as pool lists; the backward
// takes the chunks in reverse, recomputes each through all layers (site inputs for one chunk
// only, and with keep_outputs the sublayer outputs their backwards would compute once more), runs
// the head on its rows and backpropagates, handing the KDA carries' gradients and the
// DSA caches' gradients to the chunks before. The forward leaves the last chunk to that
// recomputation, the backward's first step: no chunk after it reads what its forward would leave
// (unless the balance loss needs every chunk's statistics before any backward); likewise each
// chunk's forward stops after the last layer's attention sublayer. Device memory grows
// with the sequence only through those carries, caches and pool lists.
#include <algorithm>
#include <memory>
#include <optional>

#include "core/progress.h"
#include "kernels/cuda/balance_loss.h"
#include "kernels/cuda/embedding.h"
#include "kernels/cuda/norms.h"
#include "model/cuda/model.h"
#include "model/cuda/modules.h"
#include "model/cuda/residual.h"
#include "model/cuda/sequence.h"

namespace spindle::cuda {

LossResult CudaModel::streamed_loss_and_gradients(const std::vector<int32_t>& tokens,
                                                  const LossOptions& options) {
  const ModelConfig& c = config_;
  const ModelWeights& w = weights_.tensors();
  ModelWeights& g = grads_.tensors();
  const auto L = static_cast<int64_t>(tokens.size());
  const int64_t H = c.hc_mult, D = c.hidden_size, V = c.vocab_size, E = c.n_routed_experts;
  const int64_t chunk = options.chunk_tokens;
  check(chunk > 0 && chunk < L, "the streaming executor takes chunks of 1 to ", L - 1, " tokens, got ",
        chunk);
  const cudaStream_t s = ctx_.stream();
  const DeviceSequence sequence(tokens);
  const size_t layers = w.layers.size();
  const auto chunks = static_cast<size_t>((L + chunk - 1) / chunk);
  const auto first_token = [&](size_t k) { return static_cast<int64_t>(k) * chunk; };
  const auto chunk_length = [&](size_t k) { return std::min(chunk, L - first_token(k)); };
  LossResult result;
  result.expert_load.resize(layers);
  const bool balance = options.aux_loss_coef > 0;
  DeviceBuffer<double> balance_stats(balance ? static_cast<size_t>(2 * E) : 0, MemoryCategory::Workspace);
  if (balance) SPINDLE_CUDA(cudaMemsetAsync(balance_stats.data(), 0, 2 * E * sizeof(double), s));
  double balance_rows = 0;

  // Each MoE layer's tokens per expert, summed over the chunks.
  const auto add_load = [&](size_t i, const std::vector<int64_t>& load) {
    auto& total = result.expert_load[i];
    total.resize(load.size(), 0);
    for (size_t e = 0; e < load.size(); ++e) total[e] += load[e];
  };

  // Forward, chunk by chunk: keep the KDA carries at each chunk's start, grow the DSA caches, keep
  // each chunk's selections as pool lists (the recomputation before its backward reuses them
  // instead of running the indexer again), pool the balance loss's statistics over every chunk.
  // The last chunk only with the balance loss; else its recomputation is its forward. Without it,
  // each chunk's forward also stops after the last layer's attention sublayer (nothing later moves
  // a carry on), and the last layer's feed-forward counts its loads in the recomputation.
  const size_t forward_chunks = balance ? chunks : chunks - 1;
  // The indexer's rows of the last chunk alone where no pool straddles two chunks and the KL
  // training does not read them back (DsaCache).
  const bool indexer_trained = options.indexer_kl_coef > 0;
  std::vector<LayerCarry> carries =
      start_carries(L, !indexer_trained && chunk % c.index_kpool == 0 ? chunk : 0);
  std::vector<std::vector<std::optional<KdaCarry>>> kda_starts(chunks);
  std::vector<std::vector<PoolLists>> kept_pools(chunks);
  Progress progress("streamed step (GPU, chunks queued)");
  for (size_t k = 0; k < chunks; ++k) {
    const int64_t start = first_token(k), n = chunk_length(k);
    kda_starts[k].resize(layers);
    kept_pools[k].resize(layers);
    for (size_t i = 0; i < layers; ++i)
      if (carries[i].kda) kda_starts[k][i].emplace(*carries[i].kda, s);
    if (k == forward_chunks) break;
    progress.update("forward chunk", k, forward_chunks);
    const auto keep = [&](size_t i, int64_t first, const DeviceBuffer<int32_t>& selection) {
      kept_pools[k][i] = keep_selection(ctx_, c, selection, first, n);
    };
    const SelectionSeen seen = options.keep_selections ? SelectionSeen(keep) : SelectionSeen();
    const auto ffn = [&](size_t i, const bf16* x, bf16* y) {
      const LayerWeights& layer = w.layers[i];
      if (layer.mlp == MlpKind::Dense) {
        ffn_forward(layer, x, n, y);
        return;
      }
      std::vector<int64_t> load;
      DeviceBuffer<float> logits = activations_f32(balance ? n * E : 0);
      ffn_forward(layer, x, n, y, &load, balance ? logits.data() : nullptr);
      if (balance) {
        balance_statistics(logits.data(), n, E, c.num_experts_per_tok, balance_stats.data(),
                           balance_stats.data() + E, s);
        balance_rows += static_cast<double>(n);
      }
      add_load(i, load);
    };
    forward_chunk(sequence, start, n, carries, ffn, seen, !balance);
  }
  BalanceLoss balance_loss{options.aux_loss_coef * options.scale, balance_stats.data(), balance_rows};
  if (balance) {
    const std::vector<double> stats = balance_stats.download();
    result.aux_loss = balance_loss_value(stats.data(), stats.data() + E, E, balance_rows);
  }

  // With kept outputs, the last options.kda_projections_kept KDA layers keep their input projections.
  const std::vector<bool> keeps_projections = last_layers_of_kind(
      c.layer_types, AttentionKind::Kda, options.keep_outputs ? options.kda_projections_kept : 0);

  // Backward, last chunk first. Across chunks flow only the KDA carries' gradients and the DSA
  // caches' gradients; everything else is per token.
  std::vector<std::optional<KdaCarry>> kda_grad(layers);
  std::vector<std::optional<DsaCacheGrad>> cache_grad(layers);
  for (size_t i = 0; i < layers; ++i) {
    if (carries[i].kda) kda_grad[i].emplace(c, s);
    if (carries[i].dsa)
      cache_grad[i].emplace(c, *carries[i].dsa, L, chunk, indexer_trained && w.layers[i].dsa.has_indexer, s);
  }
  IndexerLoss indexer_loss(options.indexer_kl_coef * options.scale, s);
  DeviceBuffer<float> log_prob = activations_f32(L);
  const auto scale = static_cast<float>(options.scale / static_cast<double>(L - 1));
  for (size_t k = chunks; k-- > 0;) {
    progress.update("backward chunk", chunks - 1 - k, chunks);
    const int64_t start = first_token(k), n = chunk_length(k);
    const bool forward_here = k >= forward_chunks;  // this recomputation is the chunk's only forward

    // The chunk's attention from the carries it started from: a copy of the KDA carry (the
    // forward moves it on), the DSA cache as it stood before the chunk (the chunk rewrites its rows).
    // With keep_outputs, each sublayer's forward output its backward would compute a third time
    // (and a MoE's routing) is kept from the recomputation until that backward
    // (LossOptions::keep_outputs).
    // With rebuild_ffn_inputs, the feed-forward sites' inputs are not kept: each is made again
    // before its backward from the attention site's input, output and combine coefficients, and the
    // memory that frees keeps every attention site's output (no output projection again) and each
    // MoE's [gate | up] products (no expert products again) (LossOptions::rebuild_ffn_inputs).
    const bool rebuild = options.keep_outputs && options.rebuild_ffn_inputs;
    std::vector<AttentionKept> attention_kept(layers);
    std::vector<DeviceBuffer<bf16>> attention_y(layers), ffn_kept(layers);
    std::vector<SiteCombine> combines(layers);
    std::vector<MoeRouting> routing_kept(layers);
    std::vector<SiteMix> mixes(2 * layers);  // each site's, with keep_outputs
    const auto attention = [&](size_t i, const bf16* x, bf16* y, DeviceBuffer<int32_t>& selection,
                               bool reuse) {
      const LayerWeights& layer = w.layers[i];
      AttentionKept* keep = options.keep_outputs ? &attention_kept[i] : nullptr;
      if (keep != nullptr) {
        keep->keep_matrices = options.keep_kda_matrices;
        keep->keep_projections = keeps_projections[i];
      }
      if (layer.attention == AttentionKind::Kda) {
        KdaCarry carry(*kda_starts[k][i], s);
        attention_forward(layer, x, n, selection, y, reuse, &carry, nullptr, keep);
      } else {
        carries[i].dsa->tokens = start;
        attention_forward(layer, x, n, selection, y, reuse, nullptr, &*carries[i].dsa, keep);
      }
    };

    // Recompute the chunk through all layers, keeping each site's input and each DSA selection.
    std::vector<DeviceBuffer<bf16>> site_inputs(2 * layers);
    std::vector<std::shared_ptr<DeviceBuffer<int32_t>>> selections(layers);
    std::shared_ptr<DeviceBuffer<int32_t>> selection;
    DeviceBuffer<bf16> streams = activations(n * H * D);
    embed_streams(sequence.ids.data() + start, bf16_data(w.embed_tokens), streams.data(), n, H, D, s);
    SiteChain chain;  // as forward_chunk hands each site's mix on, so that both passes compute alike
    const auto run_site = [&](size_t index, const HyperConnectionWeights& hc, const Tensor& norm,
                              const SublayerForward& sublayer, DeviceBuffer<bf16>* keep_y,
                              SiteCombine* keep_combine) {
      DeviceBuffer<bf16> next = activations(n * H * D);
      const size_t following = index + 1;  // the next site: layer following / 2's, attention if even
      chain.next = following == 2 * layers ? nullptr
                   : following % 2 == 0    ? &w.layers[following / 2].attn_hc
                                           : &w.layers[following / 2].ffn_hc;
      residual_site_forward(ctx_, c, hc, norm, n, streams.data(), next.data(), sublayer, keep_y,
                            options.keep_outputs ? &mixes[index] : nullptr, &chain, keep_combine);
      if (!rebuild || index % 2 == 0) site_inputs[index] = std::move(streams);
      streams = std::move(next);
    };
    for (size_t i = 0; i < layers; ++i) {
      const LayerWeights& layer = w.layers[i];
      run_site(
          2 * i, layer.attn_hc, layer.input_layernorm,
          [&](const bf16* x, bf16* y) {
            const bool dsa = layer.attention == AttentionKind::Dsa;
            const bool kept = dsa && layer.dsa.has_indexer && options.keep_selections && !forward_here;
            if (dsa && (layer.dsa.has_indexer || !selection))
              selection = std::make_shared<DeviceBuffer<int32_t>>();
            if (kept) restore_selection(ctx_, c, kept_pools[k][i], start, n, *selection);
            DeviceBuffer<int32_t> unused;
            attention(i, x, y, dsa ? *selection : unused, kept);
            if (dsa) selections[i] = selection;
          },
          rebuild ? &attention_y[i] : nullptr, rebuild ? &combines[i] : nullptr);
      run_site(
          2 * i + 1, layer.ffn_hc, layer.post_attention_layernorm,
          [&](const bf16* x, bf16* y) {
            // Counted here only where the chunk's forward did not run this sublayer.
            const bool count = forward_here || (!balance && i + 1 == layers);
            std::vector<int64_t> load;
            routing_kept[i].keep_products = rebuild;
            ffn_forward(layer, x, n, y, count ? &load : nullptr, nullptr,
                        options.keep_outputs ? &routing_kept[i] : nullptr);
            if (count) add_load(i, load);
          },
          options.keep_outputs ? &ffn_kept[i] : nullptr, nullptr);
    }

    // The head over this chunk's rows: row r predicts token start + r + 1 (the sequence's last
    // row predicts nothing).
    begin("head");
    DeviceBuffer<bf16> mean = activations(n * D), hidden = activations(n * D);
    head_input(streams.data(), n, mean.data(), hidden.data());
    streams = DeviceBuffer<bf16>();
    const int32_t* targets = sequence.targets.data() + start;
    DeviceBuffer<bf16> dhidden = activations(n * D), dmean = activations(n * D);
    ctx_.head.forward_backward(hidden.data(), bf16_data(w.lm_head), targets, log_prob.data() + start, nullptr,
                               nullptr, scale, dhidden.data(), f32_data(g.lm_head), n, D, V, s);
    rms_norm_backward(mean.data(), bf16_data(w.norm), dhidden.data(), dmean.data(), f32_data(g.norm), n, D,
                      static_cast<float>(c.rms_norm_eps), s);
    DeviceBuffer<bf16> dstreams = activations(n * H * D);
    stream_mean_backward(dmean.data(), dstreams.data(), n, H, D, s);
    end();

    // Layers in reverse: the feed-forward site, then the attention site.
    for (size_t i = layers; i-- > 0;) {
      const LayerWeights& layer = w.layers[i];
      LayerWeights& grad = g.layers[i];
      if (rebuild) {
        site_inputs[2 * i + 1] = activations(n * H * D);
        residual_site_output(ctx_, c, n, site_inputs[2 * i].data(), attention_y[i].data(), combines[i],
                             site_inputs[2 * i + 1].data());
        combines[i] = SiteCombine();
      }
      ffn_site_backward(layer, grad, site_inputs[2 * i + 1].data(), n, dstreams,
                        balance ? &balance_loss : nullptr, &ffn_kept[i], &mixes[2 * i + 1], &routing_kept[i]);
      site_inputs[2 * i + 1] = DeviceBuffer<bf16>();
      DeviceBuffer<int32_t> unused;
      DeviceBuffer<int32_t>& chosen = selections[i] ? *selections[i] : unused;
      residual_site_backward(
          ctx_, c, layer.attn_hc, layer.input_layernorm, n, site_inputs[2 * i].data(), dstreams, grad.attn_hc,
          grad.input_layernorm, {},
          [&](const bf16* x, const bf16* dy, float* dx, bf16* y) {
            begin(attention_kind(layer));
            if (layer.attention == AttentionKind::Kda)
              kda_backward(ctx_, c, layer.kda, x, n, dy, dx, grad.kda, *kda_starts[k][i], *kda_grad[i], y,
                           &attention_kept[i]);
            else
              dsa_backward(ctx_, c, layer.dsa, x, n, chosen.data(), dy, dx, grad.dsa, &indexer_loss,
                           *carries[i].dsa, start, *cache_grad[i], y, &attention_kept[i]);
            end();
          },
          &attention_y[i], &mixes[2 * i]);
      site_inputs[2 * i] = DeviceBuffer<bf16>();
    }

    embed_backward(sequence.ids.data() + start, dstreams.data(), f32_data(g.embed_tokens), n, H, D,
                   c.pad_token_id && *c.pad_token_id < V ? static_cast<int32_t>(*c.pad_token_id) : -1, s);
    kda_starts[k].clear();  // this chunk's carries and selections are spent
    kept_pools[k].clear();
  }
  ctx_.record.note("head", "cuda chunked lm_head + cross-entropy");

  // The mean next-token loss over the whole sequence (the last position predicts nothing).
  const std::vector<float> values = log_prob.download();
  double log_prob_sum = 0;
  for (int64_t t = 0; t + 1 < L; ++t) log_prob_sum += values[static_cast<size_t>(t)];
  result.loss = -log_prob_sum / static_cast<double>(L - 1);
  indexer_loss.read(L, result);
  return result;
}

}  // namespace spindle::cuda
