// Dense products on the CPU reference path. Row-major everywhere; weights are [out, in]
// as in torch.nn.Linear.
#pragma once

#include <cstdint>

namespace spindle::cpu {

// y[M, N] = x[M, K] * w[N, K]^T
template <class T>
void linear(const T* x, const T* w, T* y, int64_t M, int64_t K, int64_t N);

// Backward of y = x w^T: dx[M, K] += dy[M, N] w[N, K] and dw[N, K] += dy^T x. Either output may be
// null when its gradient is not needed.
template <class T>
void linear_backward(const T* x, const T* w, const T* dy, T* dx, T* dw, int64_t M, int64_t K, int64_t N);

}  // namespace spindle::cpu
