#include "kernels/cpu/moe.h"

#include <algorithm>
#include <limits>
#include <numeric>
#include <vector>

#include "core/parallel.h"
#include "kernels/cpu/norms.h"

namespace spindle::cpu {

template <class T>
void route_tokens(const RouterShape& s, const T* logits, const T* bias, int32_t* expert, T* weight) {
  const int64_t E = s.experts, per_group = E / s.groups;
  parallel_for(s.tokens, 64, [&](int64_t begin, int64_t end) {
    std::vector<T> score(static_cast<size_t>(E)), choice(static_cast<size_t>(E)),
        group_score(static_cast<size_t>(s.groups));
    std::vector<int64_t> order(static_cast<size_t>(std::max(E, s.groups)));
    for (int64_t t = begin; t < end; ++t) {
      for (int64_t e = 0; e < E; ++e) {
        score[static_cast<size_t>(e)] = sigmoid(logits[t * E + e]);
        choice[static_cast<size_t>(e)] = score[static_cast<size_t>(e)] + bias[e];
      }
      for (int64_t g = 0; g < s.groups; ++g) {
        // Sum of the two best choices of the group.
        T best = -std::numeric_limits<T>::infinity(), second = best;
        for (int64_t e = g * per_group; e < (g + 1) * per_group; ++e) {
          const T c = choice[static_cast<size_t>(e)];
          if (c > best) {
            second = best;
            best = c;
          } else if (c > second) {
            second = c;
          }
        }
        group_score[static_cast<size_t>(g)] = best + second;
      }
      std::iota(order.begin(), order.begin() + s.groups, int64_t{0});
      std::stable_sort(order.begin(), order.begin() + s.groups, [&](int64_t a, int64_t b) {
        return group_score[static_cast<size_t>(a)] > group_score[static_cast<size_t>(b)];
      });
      for (int64_t i = s.topk_groups; i < s.groups; ++i) {
        const int64_t g = order[static_cast<size_t>(i)];
        for (int64_t e = g * per_group; e < (g + 1) * per_group; ++e)
          choice[static_cast<size_t>(e)] = -std::numeric_limits<T>::infinity();
      }
      std::iota(order.begin(), order.begin() + E, int64_t{0});
      std::stable_sort(order.begin(), order.begin() + E, [&](int64_t a, int64_t b) {
        return choice[static_cast<size_t>(a)] > choice[static_cast<size_t>(b)];
      });
      T sum = 0;
      for (int64_t i = 0; i < s.topk; ++i) {
        const int64_t e = order[static_cast<size_t>(i)];
        expert[t * s.topk + i] = static_cast<int32_t>(e);
        weight[t * s.topk + i] = score[static_cast<size_t>(e)];
        sum += score[static_cast<size_t>(e)];
      }
      const T denominator = s.normalize ? sum + T(1e-20) : T(1);
      for (int64_t i = 0; i < s.topk; ++i)
        weight[t * s.topk + i] = weight[t * s.topk + i] / denominator * T(s.scaling);
    }
  });
}

template <class T>
void clamped_swiglu(const T* gate, const T* up, T* out, int64_t n, double limit) {
  const T lim = T(limit);
  for (int64_t i = 0; i < n; ++i) out[i] = silu(std::min(gate[i], lim)) * std::clamp(up[i], -lim, lim);
}

template <class T>
void clamped_swiglu_backward(const T* gate, const T* up, const T* dout, T* dgate, T* dup, int64_t n,
                             double limit) {
  const T lim = T(limit);
  for (int64_t i = 0; i < n; ++i) {
    const T g = std::min(gate[i], lim), u = std::clamp(up[i], -lim, lim);
    const T sg = sigmoid(g);
    // torch.clamp passes the gradient where the input lies inside [min, max], bounds included.
    dgate[i] = gate[i] <= lim ? dout[i] * u * sg * (T(1) + g * (T(1) - sg)) : T(0);
    dup[i] = (up[i] >= -lim && up[i] <= lim) ? dout[i] * g * sg : T(0);
  }
}

template <class T>
void route_weights_backward(const RouterShape& s, const T* logits, const int32_t* expert, const T* dweight,
                            T* dlogits) {
  const int64_t E = s.experts, K = s.topk;
  for (int64_t i = 0; i < s.tokens * E; ++i) dlogits[i] = 0;
  for (int64_t t = 0; t < s.tokens; ++t) {
    T sum = 0, dot = 0;
    for (int64_t i = 0; i < K; ++i) {
      const T sc = sigmoid(logits[t * E + expert[t * K + i]]);
      sum += sc;
      dot += dweight[t * K + i] * sc;
    }
    const T z = s.normalize ? sum + T(1e-20) : T(1);
    for (int64_t i = 0; i < K; ++i) {
      const int64_t e = expert[t * K + i];
      const T sc = sigmoid(logits[t * E + e]);
      // weight_i = scaling * s_i / z: ds_i = scaling * (dw_i / z - sum_j dw_j s_j / z^2) when normalised.
      T ds = T(s.scaling) * dweight[t * K + i] / z;
      if (s.normalize) ds -= T(s.scaling) * dot / (z * z);
      dlogits[t * E + e] += ds * sc * (T(1) - sc);
    }
  }
}

#define SPINDLE_INSTANTIATE(T)                                                                     \
  template void route_tokens<T>(const RouterShape&, const T*, const T*, int32_t*, T*);             \
  template void clamped_swiglu<T>(const T*, const T*, T*, int64_t, double);                        \
  template void clamped_swiglu_backward<T>(const T*, const T*, const T*, T*, T*, int64_t, double); \
  template void route_weights_backward<T>(const RouterShape&, const T*, const int32_t*, const T*, T*);
SPINDLE_INSTANTIATE(float)
SPINDLE_INSTANTIATE(double)
#undef SPINDLE_INSTANTIATE

}  // namespace spindle::cpu
