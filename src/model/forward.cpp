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
  const int64_t H = c.hc_mult, D = c.hidden_size, V = c.vocab_size;
  check_sequence(tokens, V);
  std::vector<T> streams = embedded_streams<T>(c, w, tokens);

  std::vector<int32_t> selection;  // the last DSA selection, for a following shared layer
  for (size_t i = 0; i < w.layers.size(); ++i) {
    const LayerWeights& layer = w.layers[i];
    residual_site_forward<T>(c, layer.attn_hc, layer.input_layernorm, L, streams, [&](const T* x, T* y) {
      if (layer.attention == AttentionKind::Kda)
        kda_forward(c, layer.kda, x, L, y);
      else
        dsa_forward(c, layer.dsa, x, L, selection, y);
    });
    residual_site_forward<T>(c, layer.ffn_hc, layer.post_attention_layernorm, L, streams,
                             [&](const T* x, T* y) {
                               if (layer.mlp == MlpKind::Dense)
                                 mlp_forward(layer.dense, c.swiglu_limit, x, L, y);
                               else
                                 moe_forward(c, layer.moe, x, L, y);
                             });
    if (options.on_layer) options.on_layer(static_cast<int64_t>(i));
  }

  // Exit: mean over streams, final norm, then the head block by block.
  std::vector<T> mean(static_cast<size_t>(L * D), T(0)), hidden(static_cast<size_t>(L * D));
  for (int64_t t = 0; t < L; ++t)
    for (int64_t h = 0; h < H; ++h)
      for (int64_t d = 0; d < D; ++d)
        mean[static_cast<size_t>(t * D + d)] += streams[static_cast<size_t>((t * H + h) * D + d)];
  for (T& m : mean) m /= T(H);
  streams.clear();
  streams.shrink_to_fit();
  cpu::rms_norm(mean.data(), w.norm.data<T>(), hidden.data(), L, D, c.rms_norm_eps);

  std::vector<T> log_probs(static_cast<size_t>(L - 1));
  const int64_t block = std::max<int64_t>(1, options.head_block);
  std::vector<T> logits(static_cast<size_t>(std::min(block, L - 1) * V));
  for (int64_t start = 0; start < L - 1; start += block) {
    const int64_t rows = std::min(block, L - 1 - start);
    cpu::linear(hidden.data() + start * D, w.lm_head.data<T>(), logits.data(), rows, D, V);
    cpu::target_log_probs(logits.data(), tokens.data() + start + 1, log_probs.data() + start, rows, V);
  }
  return log_probs;
}

template std::vector<float> sequence_log_probs<float>(const ModelConfig&, const ModelWeights&,
                                                      const std::vector<int32_t>&, const ForwardOptions&);
template std::vector<double> sequence_log_probs<double>(const ModelConfig&, const ModelWeights&,
                                                        const std::vector<int32_t>&, const ForwardOptions&);

}  // namespace spindle
