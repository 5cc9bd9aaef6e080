#include "model/forward.h"

#include <algorithm>

#include "kernels/cpu/linear.h"
#include "kernels/cpu/loss.h"
#include "kernels/cpu/norms.h"
#include "model/modules.h"
#include "model/residual.h"

namespace spindle {

template <class T>
std::vector<T> sequence_log_probs(const ModelConfig& c, const ModelWeights& w,
                                  const std::vector<int32_t>& tokens, const ForwardOptions& options) {
  check(w.dtype == dtype_of<T>(), "forward pass in ", dtype_name(dtype_of<T>()), " over weights stored in ",
        dtype_name(w.dtype));
  const auto L = static_cast<int64_t>(tokens.size());
  const int64_t D = c.hidden_size, V = c.vocab_size;
  check_sequence(tokens, V);
  check(options.chunk_tokens >= 0, "chunk_tokens must be >= 0, got ", options.chunk_tokens);
  const int64_t chunk = options.chunk_tokens > 0 ? options.chunk_tokens : L;
  const size_t layers = w.layers.size();
  std::vector<KdaCarry<T>> kda_carry(layers, KdaCarry<T>(c));
  std::vector<DsaCarry<T>> dsa_carry(layers);

  std::vector<T> log_probs(static_cast<size_t>(L - 1));
  const int64_t block = std::max<int64_t>(1, options.head_block);
  std::vector<T> logits(static_cast<size_t>(std::min(block, L - 1) * V));
  for (int64_t start = 0; start < L; start += chunk) {
    const int64_t n = std::min(chunk, L - start);
    const std::vector<int32_t> piece(tokens.begin() + start, tokens.begin() + start + n);
    std::vector<T> streams = embedded_streams<T>(c, w, piece);
    std::vector<int32_t> selection;  // the last DSA selection, for a following shared layer
    std::vector<int64_t> load;       // the last MoE layer's rows per expert, when asked for
    std::vector<int64_t>* const load_out = options.on_expert_load ? &load : nullptr;
    for (size_t i = 0; i < layers; ++i) {
      const LayerWeights& layer = w.layers[i];
      residual_site_forward<T>(c, layer.attn_hc, layer.input_layernorm, n, streams, [&](const T* x, T* y) {
        if (layer.attention == AttentionKind::Kda)
          kda_forward(c, layer.kda, x, n, y, kda_carry[i]);
        else
          dsa_forward(c, layer.dsa, x, n, selection, y, dsa_carry[i]);
      });
      if (options.on_selection && layer.attention == AttentionKind::Dsa)
        options.on_selection(static_cast<int64_t>(i), start, selection);
      residual_site_forward<T>(c, layer.ffn_hc, layer.post_attention_layernorm, n, streams,
                               [&](const T* x, T* y) {
                                 if (layer.mlp == MlpKind::Dense)
                                   mlp_forward(layer.dense, c.swiglu_limit, x, n, y);
                                 else
                                   moe_forward(c, layer.moe, x, n, y, load_out);
                               });
      if (load_out != nullptr && layer.mlp == MlpKind::Sparse)
        options.on_expert_load(static_cast<int64_t>(i), load);
      if (options.on_layer) options.on_layer(static_cast<int64_t>(i));
    }

    // Exit: mean over streams, final norm, then the head block by block. Row r predicts token
    // start + r + 1, when there is one.
    const std::vector<T> mean = streams_mean(c, streams, n);
    std::vector<T> hidden(mean.size());
    streams.clear();
    cpu::rms_norm(mean.data(), w.norm.data<T>(), hidden.data(), n, D, c.rms_norm_eps);
    const int64_t predictions = std::min(n, L - 1 - start);
    for (int64_t first = 0; first < predictions; first += block) {
      const int64_t rows = std::min(block, predictions - first);
      cpu::linear(hidden.data() + first * D, w.lm_head.data<T>(), logits.data(), rows, D, V);
      cpu::target_log_probs(logits.data(), tokens.data() + start + first + 1,
                            log_probs.data() + start + first, rows, V);
    }
  }
  return log_probs;
}

template std::vector<float> sequence_log_probs<float>(const ModelConfig&, const ModelWeights&,
                                                      const std::vector<int32_t>&, const ForwardOptions&);
template std::vector<double> sequence_log_probs<double>(const ModelConfig&, const ModelWeights&,
                                                        const std::vector<int32_t>&, const ForwardOptions&);

}  // namespace spindle
