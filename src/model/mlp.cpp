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

template void mlp_forward<float>(const MlpWeights&, double, const float*, int64_t, float*);
template void mlp_forward<double>(const MlpWeights&, double, const double*, int64_t, double*);

}  // namespace spindle
