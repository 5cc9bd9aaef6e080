// Manifold-constrained hyper-connections (mHC): H parallel residual streams per token.
// Per sublayer, coefficients come from the RMS-normalised flattened streams:
//   mix  = rms(streams) * fn^T                       [(2 + H) * H]
//   pre  = sigmoid(mix_pre * s0 + b_pre) + hc_eps    [H]     collapses streams into the sublayer input
//   post = 2 sigmoid(mix_post * s1 + b_post)         [H]     places the sublayer output on each stream
//   comb = Sinkhorn(softmax_rows(mix_comb * s2 + b_comb) + hc_eps)   [H, H]  mixes the streams
#pragma once

#include <cstdint>

namespace spindle::cpu {

struct HcShape {
  int64_t tokens;
  int64_t streams;  // H
  int64_t hidden;   // D
  double rms_eps;
  double hc_eps;
  int64_t sinkhorn_iters;
};

// streams [tokens, H, D] -> pre [tokens, H], post [tokens, H], comb [tokens, H, H],
// collapsed [tokens, D] = sum_h pre[h] * streams[h].
template <class T>
void hc_coefficients(const HcShape& s, const T* streams, const T* fn, const T* base, const T* scale, T* pre,
                     T* post, T* comb, T* collapsed);

// out[t, h, :] = post[t, h] * y[t, :] + sum_j comb[t, j, h] * streams[t, j, :]
template <class T>
void hc_combine(const HcShape& s, const T* streams, const T* y, const T* post, const T* comb, T* out);

// Backward of hc_coefficients (including the collapse): given d_pre, d_post [tokens, H], d_comb
// [tokens, H, H] and d_collapsed [tokens, D], accumulates into dstreams [tokens, H, D] and into the
// parameter gradients dfn, dbase, dscale.
template <class T>
void hc_coefficients_backward(const HcShape& s, const T* streams, const T* fn, const T* base, const T* scale,
                              const T* d_pre, const T* d_post, const T* d_comb, const T* d_collapsed,
                              T* dstreams, T* dfn, T* dbase, T* dscale);

// Backward of hc_combine: accumulates into dstreams; writes dy [tokens, D], d_post, d_comb.
template <class T>
void hc_combine_backward(const HcShape& s, const T* streams, const T* y, const T* post, const T* comb,
                         const T* dout, T* dstreams, T* dy, T* d_post, T* d_comb);

}  // namespace spindle::cpu
