#include "kernels/cpu/kda.h"

#include <cmath>
#include <vector>

#include "core/parallel.h"
#include "kernels/cpu/norms.h"

namespace spindle::cpu {

template <class T>
void causal_conv_silu(const T* x, const T* w, T* y, int64_t tokens, int64_t channels, int64_t kernel) {
  parallel_for(tokens, 256, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      for (int64_t c = 0; c < channels; ++c) {
        T acc = 0;
        for (int64_t j = 0; j < kernel; ++j) {
          const int64_t src = t - (kernel - 1) + j;
          if (src >= 0) acc += w[c * kernel + j] * x[src * channels + c];
        }
        y[t * channels + c] = silu(acc);
      }
    }
  });
}

template <class T>
void kda_recurrence(const KdaShape& s, const T* q, const T* k, const T* v, const T* g, const T* beta, T* out,
                    T* state) {
  const int64_t H = s.heads, dk = s.key_dim, dv = s.value_dim;
  // Heads are independent: one thread walks the whole sequence of a head.
  parallel_for(H, 1, [&](int64_t h0, int64_t h1) {
    std::vector<T> kv(static_cast<size_t>(dv));
    for (int64_t h = h0; h < h1; ++h) {
      T* S = state + h * dk * dv;
      for (int64_t t = 0; t < s.tokens; ++t) {
        const T* qt = q + (t * H + h) * dk;
        const T* kt = k + (t * H + h) * dk;
        const T* vt = v + (t * H + h) * dv;
        const T* gt = g + (t * H + h) * dk;
        const T b = beta[t * H + h];
        for (int64_t i = 0; i < dk; ++i) {
          const T decay = std::exp(gt[i]);
          for (int64_t j = 0; j < dv; ++j) S[i * dv + j] *= decay;
        }
        for (int64_t j = 0; j < dv; ++j) kv[static_cast<size_t>(j)] = 0;
        for (int64_t i = 0; i < dk; ++i)
          for (int64_t j = 0; j < dv; ++j) kv[static_cast<size_t>(j)] += S[i * dv + j] * kt[i];
        for (int64_t j = 0; j < dv; ++j)
          kv[static_cast<size_t>(j)] = (vt[j] - kv[static_cast<size_t>(j)]) * b;
        for (int64_t i = 0; i < dk; ++i)
          for (int64_t j = 0; j < dv; ++j) S[i * dv + j] += kt[i] * kv[static_cast<size_t>(j)];
        T* ot = out + (t * H + h) * dv;
        for (int64_t j = 0; j < dv; ++j) ot[j] = 0;
        for (int64_t i = 0; i < dk; ++i)
          for (int64_t j = 0; j < dv; ++j) ot[j] += S[i * dv + j] * qt[i];
      }
    }
  });
}

#define SPINDLE_INSTANTIATE(T)                                                          \
  template void causal_conv_silu<T>(const T*, const T*, T*, int64_t, int64_t, int64_t); \
  template void kda_recurrence<T>(const KdaShape&, const T*, const T*, const T*, const T*, const T*, T*, T*);
SPINDLE_INSTANTIATE(float)
SPINDLE_INSTANTIATE(double)
#undef SPINDLE_INSTANTIATE

}  // namespace spindle::cpu
