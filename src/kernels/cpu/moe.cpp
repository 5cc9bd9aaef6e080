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

#define SPINDLE_INSTANTIATE(T)                                                         \
  template void route_tokens<T>(const RouterShape&, const T*, const T*, int32_t*, T*); \
  template void clamped_swiglu<T>(const T*, const T*, T*, int64_t, double);
SPINDLE_INSTANTIATE(float)
SPINDLE_INSTANTIATE(double)
#undef SPINDLE_INSTANTIATE

}  // namespace spindle::cpu
