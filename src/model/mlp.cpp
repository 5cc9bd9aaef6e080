#include "kernels/cpu/linear.h"
#include "kernels/cpu/moe.h"
#include "model/modules.h"

namespace spindle {

template <class T>
void mlp_forward(const MlpWeights& w, double swiglu_limit, const T* x, int64_t L, T* y) {
  using namespace cpu;
  const int64_t I = w.gate_proj.dim(0), D = w.gate_proj.dim(1);
  std::vector<T> gate(static_cast<size_t>(L * I)), up(static_cast<size_t>(L * I));
  linear(x, w.gate_proj.data<T>(), gate.data(), L, D, I);
  linear(x, w.up_proj.data<T>(), up.data(), L, D, I);
  clamped_swiglu(gate.data(), up.data(), gate.data(), L * I, swiglu_limit);
  linear(gate.data(), w.down_proj.data<T>(), y, L, I, D);
}

template <class T>
void mlp_backward(const MlpWeights& w, double swiglu_limit, const T* x, int64_t L, const T* dy, T* dx,
                  MlpWeights& grad) {
  using namespace cpu;
  const int64_t I = w.gate_proj.dim(0), D = w.gate_proj.dim(1);
  const auto n = static_cast<size_t>(L * I);
  std::vector<T> gate(n), up(n), hidden(n), dhidden(n, T(0)), dgate(n), dup(n);
  linear(x, w.gate_proj.data<T>(), gate.data(), L, D, I);
  linear(x, w.up_proj.data<T>(), up.data(), L, D, I);
  clamped_swiglu(gate.data(), up.data(), hidden.data(), L * I, swiglu_limit);
  linear_backward(hidden.data(), w.down_proj.data<T>(), dy, dhidden.data(), grad.down_proj.data<T>(), L, I,
                  D);
  clamped_swiglu_backward(gate.data(), up.data(), dhidden.data(), dgate.data(), dup.data(), L * I,
                          swiglu_limit);
  linear_backward(x, w.gate_proj.data<T>(), dgate.data(), dx, grad.gate_proj.data<T>(), L, D, I);
  linear_backward(x, w.up_proj.data<T>(), dup.data(), dx, grad.up_proj.data<T>(), L, D, I);
}

template void mlp_forward<float>(const MlpWeights&, double, const float*, int64_t, float*);
template void mlp_forward<double>(const MlpWeights&, double, const double*, int64_t, double*);
template void mlp_backward<float>(const MlpWeights&, double, const float*, int64_t, const float*, float*,
                                  MlpWeights&);
template void mlp_backward<double>(const MlpWeights&, double, const double*, int64_t, const double*, double*,
                                   MlpWeights&);

}  // namespace spindle
