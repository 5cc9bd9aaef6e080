// Normalisations and elementwise activations of the CPU reference path.
#pragma once

#include <cmath>
#include <cstdint>

namespace spindle::cpu {

// y = weight * x / sqrt(mean(x^2) + eps), per row of D (weight may be null: unweighted).
template <class T>
void rms_norm(const T* x, const T* weight, T* y, int64_t rows, int64_t D, double eps);

// y = (x - mean) / sqrt(var + eps) * weight + bias (biased variance), per row of D.
template <class T>
void layer_norm(const T* x, const T* weight, const T* bias, T* y, int64_t rows, int64_t D, double eps);

// y = rms_norm(x, weight) * sigmoid(gate), per row of D.
template <class T>
void gated_rms_norm(const T* x, const T* weight, const T* gate, T* y, int64_t rows, int64_t D, double eps);

// x / sqrt(sum(x^2) + eps), per row of D, in place (FLA's l2norm: eps inside the root).
template <class T>
void l2_normalize(T* x, int64_t rows, int64_t D, double eps);

// Backward of rms_norm: dx (written) and, when weight is given, dw (accumulated).
template <class T>
void rms_norm_backward(const T* x, const T* weight, const T* dy, T* dx, T* dw, int64_t rows, int64_t D,
                       double eps);

// Backward of gated_rms_norm: dx and dgate (written), dw (accumulated).
template <class T>
void gated_rms_norm_backward(const T* x, const T* weight, const T* gate, const T* dy, T* dx, T* dgate, T* dw,
                             int64_t rows, int64_t D, double eps);

// Backward of layer_norm: dx written, dw and db accumulated.
template <class T>
void layer_norm_backward(const T* x, const T* weight, const T* dy, T* dx, T* dw, T* db, int64_t rows,
                         int64_t D, double eps);

// Backward of l2_normalize given the input x (before normalising): dx written.
template <class T>
void l2_normalize_backward(const T* x, const T* dy, T* dx, int64_t rows, int64_t D, double eps);

template <class T>
inline T sigmoid(T x) {
  return T(1) / (T(1) + std::exp(-x));
}

template <class T>
inline T silu(T x) {
  return x * sigmoid(x);
}

// torch's softplus as written in the model: x above 20 passes through.
template <class T>
inline T softplus_thresholded(T x) {
  return x > T(20) ? x : std::log(T(1) + std::exp(x));
}

}  // namespace spindle::cpu
