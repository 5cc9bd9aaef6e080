// Dense products on the CPU reference path. Row-major everywhere; weights are [out, in]
// as in torch.nn.Linear.
#pragma once

#include <cstdint>

namespace spindle::cpu {

// y[M, N] = x[M, K] * w[N, K]^T
template <class T>
void linear(const T* x, const T* w, T* y, int64_t M, int64_t K, int64_t N);

// y[M, N] += x[M, K] * w[N, K]^T
template <class T>
void linear_accumulate(const T* x, const T* w, T* y, int64_t M, int64_t K, int64_t N);

}  // namespace spindle::cpu
