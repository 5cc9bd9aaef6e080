#include "kernels/cpu/mhc.h"

#include <cmath>
#include <vector>

#include "core/parallel.h"
#include "kernels/cpu/norms.h"

namespace spindle::cpu {

template <class T>
void hc_coefficients(const HcShape& s, const T* streams, const T* fn, const T* base, const T* scale, T* pre,
                     T* post, T* comb, T* collapsed) {
  const int64_t H = s.streams, D = s.hidden, flat = H * D, mix = (2 + H) * H;
  const T eps = T(s.hc_eps);
  parallel_for(s.tokens, 64, [&](int64_t begin, int64_t end) {
    std::vector<T> normed(static_cast<size_t>(flat)), m(static_cast<size_t>(mix));
    for (int64_t t = begin; t < end; ++t) {
      const T* x = streams + t * flat;
      rms_norm<T>(x, nullptr, normed.data(), 1, flat, s.rms_eps);
      for (int64_t o = 0; o < mix; ++o) {
        const T* w = fn + o * flat;
        T acc = 0;
        for (int64_t i = 0; i < flat; ++i) acc += normed[static_cast<size_t>(i)] * w[i];
        m[static_cast<size_t>(o)] = acc;
      }
      T* pr = pre + t * H;
      T* po = post + t * H;
      T* c = comb + t * H * H;
      for (int64_t h = 0; h < H; ++h) {
        pr[h] = sigmoid(m[static_cast<size_t>(h)] * scale[0] + base[h]) + eps;
        po[h] = T(2) * sigmoid(m[static_cast<size_t>(H + h)] * scale[1] + base[H + h]);
      }
      // Row softmax of the comb logits, then eps.
      for (int64_t i = 0; i < H; ++i) {
        T* row = c + i * H;
        T mx = -INFINITY;
        for (int64_t j = 0; j < H; ++j) {
          row[j] = m[static_cast<size_t>(2 * H + i * H + j)] * scale[2] + base[2 * H + i * H + j];
          mx = std::max(mx, row[j]);
        }
        T sum = 0;
        for (int64_t j = 0; j < H; ++j) sum += (row[j] = std::exp(row[j] - mx));
        for (int64_t j = 0; j < H; ++j) row[j] = row[j] / sum + eps;
      }
      // Sinkhorn as transformers writes it: one column pass, then (iters - 1) row + column passes.
      auto normalize_columns = [&] {
        for (int64_t j = 0; j < H; ++j) {
          T sum = 0;
          for (int64_t i = 0; i < H; ++i) sum += c[i * H + j];
          for (int64_t i = 0; i < H; ++i) c[i * H + j] /= (sum + eps);
        }
      };
      normalize_columns();
      for (int64_t it = 0; it + 1 < s.sinkhorn_iters; ++it) {
        for (int64_t i = 0; i < H; ++i) {
          T sum = 0;
          for (int64_t j = 0; j < H; ++j) sum += c[i * H + j];
          for (int64_t j = 0; j < H; ++j) c[i * H + j] /= (sum + eps);
        }
        normalize_columns();
      }
      T* out = collapsed + t * D;
      for (int64_t d = 0; d < D; ++d) out[d] = 0;
      for (int64_t h = 0; h < H; ++h) {
        const T* xh = x + h * D;
        for (int64_t d = 0; d < D; ++d) out[d] += pr[h] * xh[d];
      }
    }
  });
}

template <class T>
void hc_combine(const HcShape& s, const T* streams, const T* y, const T* post, const T* comb, T* out) {
  const int64_t H = s.streams, D = s.hidden;
  parallel_for(s.tokens, 256, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const T* x = streams + t * H * D;
      const T* yt = y + t * D;
      const T* c = comb + t * H * H;
      T* o = out + t * H * D;
      for (int64_t h = 0; h < H; ++h) {
        T* oh = o + h * D;
        const T p = post[t * H + h];
        for (int64_t d = 0; d < D; ++d) oh[d] = p * yt[d];
        for (int64_t j = 0; j < H; ++j) {
          const T w = c[j * H + h];
          const T* xj = x + j * D;
          for (int64_t d = 0; d < D; ++d) oh[d] += w * xj[d];
        }
      }
    }
  });
}

#define SPINDLE_INSTANTIATE(T)                                                                              \
  template void hc_coefficients<T>(const HcShape&, const T*, const T*, const T*, const T*, T*, T*, T*, T*); \
  template void hc_combine<T>(const HcShape&, const T*, const T*, const T*, const T*, T*);
SPINDLE_INSTANTIATE(float)
SPINDLE_INSTANTIATE(double)
#undef SPINDLE_INSTANTIATE

}  // namespace spindle::cpu
