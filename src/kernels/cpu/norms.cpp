#include "kernels/cpu/norms.h"

#include "core/parallel.h"

namespace spindle::cpu {

template <class T>
void rms_norm(const T* x, const T* weight, T* y, int64_t rows, int64_t D, double eps) {
  parallel_for(rows, 256, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const T* xr = x + r * D;
      T* yr = y + r * D;
      T sum = 0;
      for (int64_t i = 0; i < D; ++i) sum += xr[i] * xr[i];
      const T inv = T(1) / std::sqrt(sum / T(D) + T(eps));
      for (int64_t i = 0; i < D; ++i) yr[i] = (weight ? weight[i] : T(1)) * (xr[i] * inv);
    }
  });
}

template <class T>
void layer_norm(const T* x, const T* weight, const T* bias, T* y, int64_t rows, int64_t D, double eps) {
  parallel_for(rows, 256, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const T* xr = x + r * D;
      T* yr = y + r * D;
      T mean = 0;
      for (int64_t i = 0; i < D; ++i) mean += xr[i];
      mean /= T(D);
      T var = 0;
      for (int64_t i = 0; i < D; ++i) var += (xr[i] - mean) * (xr[i] - mean);
      var /= T(D);
      const T inv = T(1) / std::sqrt(var + T(eps));
      for (int64_t i = 0; i < D; ++i) yr[i] = (xr[i] - mean) * inv * weight[i] + bias[i];
    }
  });
}

template <class T>
void gated_rms_norm(const T* x, const T* weight, const T* gate, T* y, int64_t rows, int64_t D, double eps) {
  rms_norm(x, weight, y, rows, D, eps);
  const int64_t n = rows * D;
  for (int64_t i = 0; i < n; ++i) y[i] *= sigmoid(gate[i]);
}

template <class T>
void l2_normalize(T* x, int64_t rows, int64_t D, double eps) {
  for (int64_t r = 0; r < rows; ++r) {
    T* xr = x + r * D;
    T sum = 0;
    for (int64_t i = 0; i < D; ++i) sum += xr[i] * xr[i];
    const T norm = std::sqrt(sum + T(eps));
    for (int64_t i = 0; i < D; ++i) xr[i] /= norm;
  }
}

#define SPINDLE_INSTANTIATE(T)                                                                 \
  template void rms_norm<T>(const T*, const T*, T*, int64_t, int64_t, double);                 \
  template void layer_norm<T>(const T*, const T*, const T*, T*, int64_t, int64_t, double);     \
  template void gated_rms_norm<T>(const T*, const T*, const T*, T*, int64_t, int64_t, double); \
  template void l2_normalize<T>(T*, int64_t, int64_t, double);
SPINDLE_INSTANTIATE(float)
SPINDLE_INSTANTIATE(double)
#undef SPINDLE_INSTANTIATE

}  // namespace spindle::cpu
