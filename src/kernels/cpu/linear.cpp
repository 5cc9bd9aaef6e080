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

template <class T, bool kAccumulate>
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
          for (int64_t c = c0; c < c1; ++c) {
            const T v = dot(xr, w + c * K, K);
            if constexpr (kAccumulate)
              yr[c] += v;
            else
              yr[c] = v;
          }
        }
      }
    }
  });
}

}  // namespace

template <class T>
void linear(const T* x, const T* w, T* y, int64_t M, int64_t K, int64_t N) {
  linear_impl<T, false>(x, w, y, M, K, N);
}

template <class T>
void linear_accumulate(const T* x, const T* w, T* y, int64_t M, int64_t K, int64_t N) {
  linear_impl<T, true>(x, w, y, M, K, N);
}

template void linear<float>(const float*, const float*, float*, int64_t, int64_t, int64_t);
template void linear<double>(const double*, const double*, double*, int64_t, int64_t, int64_t);
template void linear_accumulate<float>(const float*, const float*, float*, int64_t, int64_t, int64_t);
template void linear_accumulate<double>(const double*, const double*, double*, int64_t, int64_t, int64_t);

}  // namespace spindle::cpu
