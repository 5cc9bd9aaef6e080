#include "kernels/cpu/loss.h"

#include <algorithm>
#include <cmath>
#include <limits>

#include "core/parallel.h"

namespace spindle::cpu {

template <class T>
void target_log_probs(const T* logits, const int32_t* target, T* out, int64_t rows, int64_t vocab) {
  parallel_for(rows, 64, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const T* l = logits + r * vocab;
      T mx = -std::numeric_limits<T>::infinity();
      for (int64_t v = 0; v < vocab; ++v) mx = std::max(mx, l[v]);
      T sum = 0;
      for (int64_t v = 0; v < vocab; ++v) sum += std::exp(l[v] - mx);
      out[r] = l[target[r]] - mx - std::log(sum);
    }
  });
}

template <class T>
double target_log_probs_backward(T* logits, const int32_t* target, int64_t rows, int64_t vocab, T scale) {
  double total = 0;
  for (int64_t r = 0; r < rows; ++r) {
    T* l = logits + r * vocab;
    T mx = -std::numeric_limits<T>::infinity();
    for (int64_t v = 0; v < vocab; ++v) mx = std::max(mx, l[v]);
    T sum = 0;
    for (int64_t v = 0; v < vocab; ++v) sum += std::exp(l[v] - mx);
    const T log_z = mx + std::log(sum);
    total += static_cast<double>(l[target[r]] - log_z);
    for (int64_t v = 0; v < vocab; ++v) l[v] = std::exp(l[v] - log_z) * scale;
    l[target[r]] -= scale;
  }
  return total;
}

template void target_log_probs<float>(const float*, const int32_t*, float*, int64_t, int64_t);
template void target_log_probs<double>(const double*, const int32_t*, double*, int64_t, int64_t);
template double target_log_probs_backward<float>(float*, const int32_t*, int64_t, int64_t, float);
template double target_log_probs_backward<double>(double*, const int32_t*, int64_t, int64_t, double);

}  // namespace spindle::cpu
