// The mHC residual around each sublayer, shared by the forward pass and the backward pass:
//   pre, post, comb, collapsed = hc(streams);  y = sublayer(rms_norm(collapsed));
//   streams' = post * y + comb^T streams
#pragma once

#include <algorithm>
#include <cstdint>
#include <vector>

#include "kernels/cpu/mhc.h"
#include "kernels/cpu/norms.h"
#include "model/config.h"
#include "model/weights.h"

namespace spindle {

// Token ids must index the vocabulary; a sequence needs two tokens for one prediction.
inline void check_sequence(const std::vector<int32_t>& tokens, int64_t vocab) {
  check(tokens.size() >= 2, "a sequence needs at least 2 tokens to have a next-token loss, got ",
        tokens.size());
  for (size_t i = 0; i < tokens.size(); ++i) {
    check(tokens[i] >= 0 && tokens[i] < vocab, "token id ", tokens[i], " at position ", i,
          " is outside the vocabulary [0, ", vocab, ")");
  }
}

// The residual streams at the model's entry: every stream is the token's embedding row.
template <class T>
std::vector<T> embedded_streams(const ModelConfig& c, const ModelWeights& w,
                                const std::vector<int32_t>& tokens) {
  const int64_t H = c.hc_mult, D = c.hidden_size;
  std::vector<T> streams(tokens.size() * static_cast<size_t>(H * D));
  const T* embed = w.embed_tokens.data<T>();
  for (size_t t = 0; t < tokens.size(); ++t)
    for (int64_t h = 0; h < H; ++h)
      std::copy(embed + tokens[t] * D, embed + (tokens[t] + 1) * D,
                streams.begin() + (static_cast<int64_t>(t) * H + h) * D);
  return streams;
}

// The model's exit: each token's mean over its H streams, [tokens, hidden].
template <class T>
std::vector<T> streams_mean(const ModelConfig& c, const std::vector<T>& streams, int64_t L) {
  const int64_t H = c.hc_mult, D = c.hidden_size;
  std::vector<T> mean(static_cast<size_t>(L * D), T(0));
  for (int64_t t = 0; t < L; ++t)
    for (int64_t h = 0; h < H; ++h)
      for (int64_t d = 0; d < D; ++d)
        mean[static_cast<size_t>(t * D + d)] += streams[static_cast<size_t>((t * H + h) * D + d)] / T(H);
  return mean;
}

// Its backward: every stream gets dmean / H.
template <class T>
std::vector<T> streams_mean_backward(const ModelConfig& c, const std::vector<T>& dmean, int64_t L) {
  const int64_t H = c.hc_mult, D = c.hidden_size;
  std::vector<T> dstreams(static_cast<size_t>(L * H * D));
  for (int64_t t = 0; t < L; ++t)
    for (int64_t h = 0; h < H; ++h)
      for (int64_t d = 0; d < D; ++d)
        dstreams[static_cast<size_t>((t * H + h) * D + d)] = dmean[static_cast<size_t>(t * D + d)] / T(H);
  return dstreams;
}

// The embedding's gradient (accumulated): every stream started as the token's row. The padding
// token's row gets none, as in torch's nn.Embedding(padding_idx).
template <class T>
void embedding_backward(const ModelConfig& c, const std::vector<int32_t>& tokens,
                        const std::vector<T>& dstreams, ModelWeights& g) {
  const int64_t H = c.hc_mult, D = c.hidden_size;
  T* dembed = g.embed_tokens.data<T>();
  for (size_t t = 0; t < tokens.size(); ++t) {
    const int32_t id = tokens[t];
    if (c.pad_token_id && id == *c.pad_token_id) continue;
    for (int64_t h = 0; h < H; ++h)
      for (int64_t d = 0; d < D; ++d)
        dembed[id * D + d] +=
            dstreams[(t * static_cast<size_t>(H) + static_cast<size_t>(h)) * static_cast<size_t>(D) +
                     static_cast<size_t>(d)];
  }
}

inline cpu::HcShape hc_shape(const ModelConfig& c, int64_t tokens) {
  return {tokens, c.hc_mult, c.hidden_size, c.rms_norm_eps, c.hc_eps, c.hc_sinkhorn_iters};
}

// Runs one site in place on `streams` [tokens, H, D]. sublayer(normed, out) writes out [tokens, D].
template <class T, class Sublayer>
void residual_site_forward(const ModelConfig& c, const HyperConnectionWeights& hc, const Tensor& norm,
                           int64_t L, std::vector<T>& streams, Sublayer sublayer) {
  const int64_t H = c.hc_mult, D = c.hidden_size;
  const cpu::HcShape shape = hc_shape(c, L);
  std::vector<T> pre(static_cast<size_t>(L * H)), post(static_cast<size_t>(L * H));
  std::vector<T> comb(static_cast<size_t>(L * H * H)), collapsed(static_cast<size_t>(L * D));
  std::vector<T> normed(static_cast<size_t>(L * D));
  cpu::hc_coefficients(shape, streams.data(), hc.fn.data<T>(), hc.base.data<T>(), hc.scale.data<T>(),
                       pre.data(), post.data(), comb.data(), collapsed.data());
  cpu::rms_norm(collapsed.data(), norm.data<T>(), normed.data(), L, D, c.rms_norm_eps);
  sublayer(normed.data(), collapsed.data());  // the sublayer output reuses `collapsed`
  std::vector<T> next(streams.size());
  cpu::hc_combine(shape, streams.data(), collapsed.data(), post.data(), comb.data(), next.data());
  streams.swap(next);
}

// Backward of one site. `streams` is the site's input; `dstreams` holds the gradient of its
// output on entry and of its input on return. sublayer(normed, out) recomputes the sublayer;
// sublayer_backward(normed, dy, dnormed) accumulates into dnormed and the sublayer's gradients.
template <class T, class Sublayer, class SublayerBackward>
void residual_site_backward(const ModelConfig& c, const HyperConnectionWeights& hc, const Tensor& norm,
                            int64_t L, const std::vector<T>& streams, std::vector<T>& dstreams,
                            HyperConnectionWeights& ghc, Tensor& gnorm, Sublayer sublayer,
                            SublayerBackward sublayer_backward) {
  const int64_t H = c.hc_mult, D = c.hidden_size;
  const cpu::HcShape shape = hc_shape(c, L);
  auto buffer = [](int64_t n) { return std::vector<T>(static_cast<size_t>(n), T(0)); };
  std::vector<T> pre = buffer(L * H), post = buffer(L * H), comb = buffer(L * H * H),
                 collapsed = buffer(L * D);
  std::vector<T> normed = buffer(L * D), y = buffer(L * D);
  cpu::hc_coefficients(shape, streams.data(), hc.fn.data<T>(), hc.base.data<T>(), hc.scale.data<T>(),
                       pre.data(), post.data(), comb.data(), collapsed.data());
  cpu::rms_norm(collapsed.data(), norm.data<T>(), normed.data(), L, D, c.rms_norm_eps);
  sublayer(normed.data(), y.data());

  std::vector<T> d_in = buffer(L * H * D), dy = buffer(L * D), d_post = buffer(L * H),
                 d_comb = buffer(L * H * H);
  cpu::hc_combine_backward(shape, streams.data(), y.data(), post.data(), comb.data(), dstreams.data(),
                           d_in.data(), dy.data(), d_post.data(), d_comb.data());
  std::vector<T> d_normed = buffer(L * D), d_collapsed = buffer(L * D), d_pre = buffer(L * H);
  sublayer_backward(normed.data(), dy.data(), d_normed.data());
  cpu::rms_norm_backward(collapsed.data(), norm.data<T>(), d_normed.data(), d_collapsed.data(),
                         gnorm.data<T>(), L, D, c.rms_norm_eps);
  cpu::hc_coefficients_backward(shape, streams.data(), hc.fn.data<T>(), hc.base.data<T>(), hc.scale.data<T>(),
                                d_pre.data(), d_post.data(), d_comb.data(), d_collapsed.data(), d_in.data(),
                                ghc.fn.data<T>(), ghc.base.data<T>(), ghc.scale.data<T>());
  dstreams.swap(d_in);
}

}  // namespace spindle
