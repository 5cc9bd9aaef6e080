#include "kernels/cpu/norms.h"

#include <vector>

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

template <class T>
void rms_norm_backward(const T* x, const T* weight, const T* dy, T* dx, T* dw, int64_t rows, int64_t D,
                       double eps) {
  // dx = r (w dy) - x r^3 sum(w dy x) / D with r = 1 / sqrt(mean(x^2) + eps).
  for (int64_t r = 0; r < rows; ++r) {
    const T* xr = x + r * D;
    const T* dyr = dy + r * D;
    T sum = 0;
    for (int64_t i = 0; i < D; ++i) sum += xr[i] * xr[i];
    const T inv = T(1) / std::sqrt(sum / T(D) + T(eps));
    T dot = 0;
    for (int64_t i = 0; i < D; ++i) dot += (weight ? weight[i] : T(1)) * dyr[i] * xr[i];
    for (int64_t i = 0; i < D; ++i) {
      const T wi = weight ? weight[i] : T(1);
      dx[r * D + i] = inv * wi * dyr[i] - xr[i] * inv * inv * inv * dot / T(D);
      if (dw != nullptr) dw[i] += dyr[i] * xr[i] * inv;
    }
  }
}

template <class T>
void gated_rms_norm_backward(const T* x, const T* weight, const T* gate, const T* dy, T* dx, T* dgate, T* dw,
                             int64_t rows, int64_t D, double eps) {
  std::vector<T> normed(static_cast<size_t>(D)), dnormed(static_cast<size_t>(D));
  for (int64_t r = 0; r < rows; ++r) {
    rms_norm(x + r * D, weight, normed.data(), 1, D, eps);
    for (int64_t i = 0; i < D; ++i) {
      const T s = sigmoid(gate[r * D + i]);
      dnormed[static_cast<size_t>(i)] = dy[r * D + i] * s;
      dgate[r * D + i] = dy[r * D + i] * normed[static_cast<size_t>(i)] * s * (T(1) - s);
    }
    rms_norm_backward(x + r * D, weight, dnormed.data(), dx + r * D, dw, 1, D, eps);
  }
}

template <class T>
void layer_norm_backward(const T* x, const T* weight, const T* dy, T* dx, T* dw, T* db, int64_t rows,
                         int64_t D, double eps) {
  // With xhat = (x - mean) r: dx = r (g - mean(g) - xhat mean(g xhat)), g = w dy.
  for (int64_t r = 0; r < rows; ++r) {
    const T* xr = x + r * D;
    const T* dyr = dy + r * D;
    T mean = 0;
    for (int64_t i = 0; i < D; ++i) mean += xr[i];
    mean /= T(D);
    T var = 0;
    for (int64_t i = 0; i < D; ++i) var += (xr[i] - mean) * (xr[i] - mean);
    const T inv = T(1) / std::sqrt(var / T(D) + T(eps));
    T g_mean = 0, gx_mean = 0;
    for (int64_t i = 0; i < D; ++i) {
      const T xhat = (xr[i] - mean) * inv;
      g_mean += weight[i] * dyr[i];
      gx_mean += weight[i] * dyr[i] * xhat;
      dw[i] += dyr[i] * xhat;
      db[i] += dyr[i];
    }
    g_mean /= T(D);
    gx_mean /= T(D);
    for (int64_t i = 0; i < D; ++i) {
      const T xhat = (xr[i] - mean) * inv;
      dx[r * D + i] = inv * (weight[i] * dyr[i] - g_mean - xhat * gx_mean);
    }
  }
}

template <class T>
void l2_normalize_backward(const T* x, const T* dy, T* dx, int64_t rows, int64_t D, double eps) {
  // y = x / n with n = sqrt(sum x^2 + eps): dx = (dy - y (y . dy)) / n.
  for (int64_t r = 0; r < rows; ++r) {
    const T* xr = x + r * D;
    const T* dyr = dy + r * D;
    T sum = 0;
    for (int64_t i = 0; i < D; ++i) sum += xr[i] * xr[i];
    const T n = std::sqrt(sum + T(eps));
    T dot = 0;
    for (int64_t i = 0; i < D; ++i) dot += xr[i] / n * dyr[i];
    for (int64_t i = 0; i < D; ++i) dx[r * D + i] = (dyr[i] - xr[i] / n * dot) / n;
  }
}

#define SPINDLE_INSTANTIATE(T)                                                                          \
  template void rms_norm<T>(const T*, const T*, T*, int64_t, int64_t, double);                          \
  template void layer_norm<T>(const T*, const T*, const T*, T*, int64_t, int64_t, double);              \
  template void gated_rms_norm<T>(const T*, const T*, const T*, T*, int64_t, int64_t, double);          \
  template void l2_normalize<T>(T*, int64_t, int64_t, double);                                          \
  template void rms_norm_backward<T>(const T*, const T*, const T*, T*, T*, int64_t, int64_t, double);   \
  template void gated_rms_norm_backward<T>(const T*, const T*, const T*, const T*, T*, T*, T*, int64_t, \
                                           int64_t, double);                                            \
  template void l2_normalize_backward<T>(const T*, const T*, T*, int64_t, int64_t, double);             \
  template void layer_norm_backward<T>(const T*, const T*, const T*, T*, T*, T*, int64_t, int64_t, double);
SPINDLE_INSTANTIATE(float)
SPINDLE_INSTANTIATE(double)
#undef SPINDLE_INSTANTIATE

}  // namespace spindle::cpu
