#include "kernels/cpu/linear.h"

#include <algorithm>

#include "core/parallel.h"

namespace spindle::cpu {

namespace {

template <class T>
T dot(const T* a, const T* b, int64_t n) {
  // Four partial sums: vectorises and keeps the rounding of long sums small.
  T s0 = 0, s1 = 0, s2 = 0, s3 = 0;
  int64_t i = 0;
  for (; i + 4 <= n; i += 4) {
    s0 += a[i] * b[i];
    s1 += a[i + 1] * b[i + 1];
    s2 += a[i + 2] * b[i + 2];
    s3 += a[i + 3] * b[i + 3];
  }
  for (; i < n; ++i) s0 += a[i] * b[i];
  return (s0 + s1) + (s2 + s3);
}

template <class T>
void linear_impl(const T* x, const T* w, T* y, int64_t M, int64_t K, int64_t N) {
  // Blocks of rows times blocks of weight rows keep both operands in cache.
  constexpr int64_t kRows = 32, kCols = 64;
  parallel_for(M, kRows, [&](int64_t begin, int64_t end) {
    for (int64_t r0 = begin; r0 < end; r0 += kRows) {
      const int64_t r1 = std::min(end, r0 + kRows);
      for (int64_t c0 = 0; c0 < N; c0 += kCols) {
        const int64_t c1 = std::min(N, c0 + kCols);
        for (int64_t r = r0; r < r1; ++r) {
          const T* xr = x + r * K;
          T* yr = y + r * N;
          for (int64_t c = c0; c < c1; ++c) yr[c] = dot(xr, w + c * K, K);
        }
      }
    }
  });
}

}  // namespace

template <class T>
void linear(const T* x, const T* w, T* y, int64_t M, int64_t K, int64_t N) {
  linear_impl<T>(x, w, y, M, K, N);
}

template <class T>
void linear_backward(const T* x, const T* w, const T* dy, T* dx, T* dw, int64_t M, int64_t K, int64_t N) {
  if (dx != nullptr) {
    parallel_for(M, 32, [&](int64_t begin, int64_t end) {
      for (int64_t r = begin; r < end; ++r) {
        T* dxr = dx + r * K;
        const T* dyr = dy + r * N;
        for (int64_t n = 0; n < N; ++n) {
          const T g = dyr[n];
          if (g == T(0)) continue;
          const T* wn = w + n * K;
          for (int64_t k = 0; k < K; ++k) dxr[k] += g * wn[k];
        }
      }
    });
  }
  if (dw != nullptr) {
    // Each thread owns a band of weight rows, so no two threads write the same gradient.
    parallel_for(N, 8, [&](int64_t begin, int64_t end) {
      for (int64_t r = 0; r < M; ++r) {
        const T* xr = x + r * K;
        const T* dyr = dy + r * N;
        for (int64_t n = begin; n < end; ++n) {
          const T g = dyr[n];
          if (g == T(0)) continue;
          T* dwn = dw + n * K;
          for (int64_t k = 0; k < K; ++k) dwn[k] += g * xr[k];
        }
      }
    });
  }
}

template void linear<float>(const float*, const float*, float*, int64_t, int64_t, int64_t);
template void linear<double>(const double*, const double*, double*, int64_t, int64_t, int64_t);
template void linear_backward<float>(const float*, const float*, const float*, float*, float*, int64_t,
                                     int64_t, int64_t);
template void linear_backward<double>(const double*, const double*, const double*, double*, double*, int64_t,
                                      int64_t, int64_t);

}  // namespace spindle::cpu
