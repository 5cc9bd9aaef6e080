#include "kernels/cpu/mhc.h"

#include <algorithm>
#include <cmath>
#include <mutex>
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

template <class T>
void hc_coefficients_backward(const HcShape& s, const T* streams, const T* fn, const T* base, const T* scale,
                              const T* d_pre, const T* d_post, const T* d_comb, const T* d_collapsed,
                              T* dstreams, T* dfn, T* dbase, T* dscale) {
  const int64_t H = s.streams, D = s.hidden, flat = H * D, mix = (2 + H) * H, HH = H * H;
  const T eps = T(s.hc_eps);
  const int64_t passes = 2 * s.sinkhorn_iters - 1;  // one column pass, then row + column pairs
  const int workers = worker_count();
  // Per-thread parameter gradients, summed at the end (many tokens share one fn).
  // Partials are keyed by the first token of their range and summed in token order, so the result
  // does not depend on which thread finished first (resumed runs must be bit-exact).
  std::vector<std::vector<T>> part_fn(static_cast<size_t>(workers)), part_small(static_cast<size_t>(workers));
  std::vector<int64_t> part_begin(static_cast<size_t>(workers), -1);
  std::mutex slot_mutex;
  int next_slot = 0;
  parallel_for(s.tokens, 64, [&](int64_t begin, int64_t end) {
    size_t slot;
    {
      std::lock_guard<std::mutex> lock(slot_mutex);
      slot = static_cast<size_t>(next_slot++);
      part_begin[slot] = begin;
    }
    std::vector<T>& gfn = part_fn[slot];
    std::vector<T>& gsmall = part_small[slot];  // dbase [mix] then dscale [3]
    gfn.assign(static_cast<size_t>(mix * flat), T(0));
    gsmall.assign(static_cast<size_t>(mix + 3), T(0));
    std::vector<T> normed(static_cast<size_t>(flat)), m(static_cast<size_t>(mix)),
        dm(static_cast<size_t>(mix));
    std::vector<T> stages(static_cast<size_t>((passes + 1) * HH)), sums(static_cast<size_t>(passes * H));
    std::vector<T> p(static_cast<size_t>(HH)), dc(static_cast<size_t>(HH)),
        dnormed(static_cast<size_t>(flat));
    std::vector<T> dflat(static_cast<size_t>(flat));
    for (int64_t t = begin; t < end; ++t) {
      const T* x = streams + t * flat;
      rms_norm<T>(x, nullptr, normed.data(), 1, flat, s.rms_eps);
      for (int64_t o = 0; o < mix; ++o) {
        T acc = 0;
        for (int64_t i = 0; i < flat; ++i) acc += normed[static_cast<size_t>(i)] * fn[o * flat + i];
        m[static_cast<size_t>(o)] = acc;
      }
      // Recompute the Sinkhorn stages, keeping each matrix and each pass's sums.
      for (int64_t i = 0; i < H; ++i) {
        T mx = -INFINITY;
        for (int64_t j = 0; j < H; ++j) {
          p[static_cast<size_t>(i * H + j)] =
              m[static_cast<size_t>(2 * H + i * H + j)] * scale[2] + base[2 * H + i * H + j];
          mx = std::max(mx, p[static_cast<size_t>(i * H + j)]);
        }
        T z = 0;
        for (int64_t j = 0; j < H; ++j)
          z += (p[static_cast<size_t>(i * H + j)] = std::exp(p[static_cast<size_t>(i * H + j)] - mx));
        for (int64_t j = 0; j < H; ++j) {
          p[static_cast<size_t>(i * H + j)] /= z;
          stages[static_cast<size_t>(i * H + j)] = p[static_cast<size_t>(i * H + j)] + eps;
        }
      }
      for (int64_t k = 0; k < passes; ++k) {
        const bool columns = k % 2 == 0;
        const T* c = stages.data() + k * HH;
        T* next = stages.data() + (k + 1) * HH;
        for (int64_t a = 0; a < H; ++a) {
          T sum = 0;
          for (int64_t b = 0; b < H; ++b) sum += columns ? c[b * H + a] : c[a * H + b];
          sums[static_cast<size_t>(k * H + a)] = sum + eps;
          for (int64_t b = 0; b < H; ++b) {
            const int64_t idx = columns ? b * H + a : a * H + b;
            next[idx] = c[idx] / (sum + eps);
          }
        }
      }
      // Back through the passes: c' = c / (S + eps) along rows or columns.
      for (int64_t i = 0; i < HH; ++i) dc[static_cast<size_t>(i)] = d_comb[t * HH + i];
      for (int64_t k = passes - 1; k >= 0; --k) {
        const bool columns = k % 2 == 0;
        const T* c = stages.data() + k * HH;
        for (int64_t a = 0; a < H; ++a) {
          const T S = sums[static_cast<size_t>(k * H + a)];
          T dot = 0;
          for (int64_t b = 0; b < H; ++b) {
            const int64_t idx = columns ? b * H + a : a * H + b;
            dot += dc[static_cast<size_t>(idx)] * c[idx];
          }
          for (int64_t b = 0; b < H; ++b) {
            const int64_t idx = columns ? b * H + a : a * H + b;
            dc[static_cast<size_t>(idx)] = dc[static_cast<size_t>(idx)] / S - dot / (S * S);
          }
        }
      }
      // Row softmax backward, then the affine maps to the mix logits.
      for (int64_t i = 0; i < H; ++i) {
        T dot = 0;
        for (int64_t j = 0; j < H; ++j)
          dot += p[static_cast<size_t>(i * H + j)] * dc[static_cast<size_t>(i * H + j)];
        for (int64_t j = 0; j < H; ++j) {
          const T dl = p[static_cast<size_t>(i * H + j)] * (dc[static_cast<size_t>(i * H + j)] - dot);
          const auto o = static_cast<size_t>(2 * H + i * H + j);
          dm[o] = dl * scale[2];
          gsmall[o] += dl;
          gsmall[static_cast<size_t>(mix + 2)] += dl * m[o];
        }
      }
      const T* pre_grad = d_pre + t * H;
      for (int64_t h = 0; h < H; ++h) {
        // collapsed = sum_h pre_h x_h also feeds d_pre.
        T dpre = pre_grad[h];
        const T* xh = x + h * D;
        for (int64_t d = 0; d < D; ++d) dpre += d_collapsed[t * D + d] * xh[d];
        const T a_pre = m[static_cast<size_t>(h)] * scale[0] + base[h];
        const T sp = sigmoid(a_pre);
        const T da_pre = dpre * sp * (T(1) - sp);
        dm[static_cast<size_t>(h)] = da_pre * scale[0];
        gsmall[static_cast<size_t>(h)] += da_pre;
        gsmall[static_cast<size_t>(mix)] += da_pre * m[static_cast<size_t>(h)];
        const T a_post = m[static_cast<size_t>(H + h)] * scale[1] + base[H + h];
        const T so = sigmoid(a_post);
        const T da_post = d_post[t * H + h] * T(2) * so * (T(1) - so);
        dm[static_cast<size_t>(H + h)] = da_post * scale[1];
        gsmall[static_cast<size_t>(H + h)] += da_post;
        gsmall[static_cast<size_t>(mix + 1)] += da_post * m[static_cast<size_t>(H + h)];
      }
      // pre computed again for the collapse path into the streams.
      T* dx = dstreams + t * flat;
      for (int64_t h = 0; h < H; ++h) {
        const T pre = sigmoid(m[static_cast<size_t>(h)] * scale[0] + base[h]) + eps;
        for (int64_t d = 0; d < D; ++d) dx[h * D + d] += pre * d_collapsed[t * D + d];
      }
      // m = normed fn^T.
      for (int64_t i = 0; i < flat; ++i) dnormed[static_cast<size_t>(i)] = 0;
      for (int64_t o = 0; o < mix; ++o) {
        const T g = dm[static_cast<size_t>(o)];
        const T* w = fn + o * flat;
        T* gw = gfn.data() + o * flat;
        for (int64_t i = 0; i < flat; ++i) {
          dnormed[static_cast<size_t>(i)] += g * w[i];
          gw[i] += g * normed[static_cast<size_t>(i)];
        }
      }
      rms_norm_backward<T>(x, nullptr, dnormed.data(), dflat.data(), nullptr, 1, flat, s.rms_eps);
      for (int64_t i = 0; i < flat; ++i) dx[i] += dflat[static_cast<size_t>(i)];
    }
  });
  std::vector<size_t> order;
  for (size_t w = 0; w < part_fn.size(); ++w)
    if (!part_fn[w].empty()) order.push_back(w);
  std::sort(order.begin(), order.end(), [&](size_t a, size_t b) { return part_begin[a] < part_begin[b]; });
  for (size_t w : order) {
    for (int64_t i = 0; i < mix * flat; ++i) dfn[i] += part_fn[w][static_cast<size_t>(i)];
    for (int64_t i = 0; i < mix; ++i) dbase[i] += part_small[w][static_cast<size_t>(i)];
    for (int64_t i = 0; i < 3; ++i) dscale[i] += part_small[w][static_cast<size_t>(mix + i)];
  }
}

template <class T>
void hc_combine_backward(const HcShape& s, const T* streams, const T* y, const T* post, const T* comb,
                         const T* dout, T* dstreams, T* dy, T* d_post, T* d_comb) {
  const int64_t H = s.streams, D = s.hidden;
  parallel_for(s.tokens, 256, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const T* x = streams + t * H * D;
      const T* g = dout + t * H * D;
      const T* yt = y + t * D;
      T* dyt = dy + t * D;
      for (int64_t d = 0; d < D; ++d) dyt[d] = 0;
      for (int64_t h = 0; h < H; ++h) {
        const T* gh = g + h * D;
        T dp = 0;
        for (int64_t d = 0; d < D; ++d) {
          dp += gh[d] * yt[d];
          dyt[d] += post[t * H + h] * gh[d];
        }
        d_post[t * H + h] = dp;
        for (int64_t j = 0; j < H; ++j) {
          const T* xj = x + j * D;
          const T w = comb[t * H * H + j * H + h];
          T* dxj = dstreams + (t * H + j) * D;
          T dc = 0;
          for (int64_t d = 0; d < D; ++d) {
            dc += gh[d] * xj[d];
            dxj[d] += w * gh[d];
          }
          d_comb[t * H * H + j * H + h] = dc;
        }
      }
    }
  });
}

#define SPINDLE_INSTANTIATE(T)                                                                               \
  template void hc_coefficients<T>(const HcShape&, const T*, const T*, const T*, const T*, T*, T*, T*, T*);  \
  template void hc_combine<T>(const HcShape&, const T*, const T*, const T*, const T*, T*);                   \
  template void hc_coefficients_backward<T>(const HcShape&, const T*, const T*, const T*, const T*,          \
                                            const T*, const T*, const T*, const T*, T*, T*, T*, T*);         \
  template void hc_combine_backward<T>(const HcShape&, const T*, const T*, const T*, const T*, const T*, T*, \
                                       T*, T*, T*);
SPINDLE_INSTANTIATE(float)
SPINDLE_INSTANTIATE(double)
#undef SPINDLE_INSTANTIATE

}  // namespace spindle::cpu
