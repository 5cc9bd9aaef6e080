#include "kernels/cpu/moe.h"

#include <algorithm>

#include "kernels/cpu/linear.h"
#include "model/modules.h"

namespace spindle {

template <class T>
void moe_forward(const ModelConfig& c, const MoeWeights& w, const T* x, int64_t L, T* y,
                 std::vector<int64_t>* load, std::vector<T>* router_logits) {
  using namespace cpu;
  const int64_t D = c.hidden_size, E = c.n_routed_experts, I = c.moe_intermediate_size,
                k = c.num_experts_per_tok;

  std::vector<T> logits(static_cast<size_t>(L * E)), weight(static_cast<size_t>(L * k));
  std::vector<int32_t> expert(static_cast<size_t>(L * k));
  linear(x, w.router.data<T>(), logits.data(), L, D, E);
  route_tokens<T>({L, E, c.n_group, c.topk_group, k, c.norm_topk_prob, c.routed_scaling_factor},
                  logits.data(), w.correction_bias.data<T>(), expert.data(), weight.data());

  if (load != nullptr) {
    load->assign(static_cast<size_t>(E), 0);
    for (int32_t e : expert) ++(*load)[static_cast<size_t>(e)];
  }
  if (router_logits != nullptr) *router_logits = logits;

  // The shared expert writes y; each routed expert adds its weighted output to its tokens.
  mlp_forward(w.shared, c.swiglu_limit, x, L, y);

  // Tokens of each expert, in token order.
  std::vector<std::vector<int64_t>> slots(static_cast<size_t>(E));
  for (int64_t i = 0; i < L * k; ++i) slots[static_cast<size_t>(expert[static_cast<size_t>(i)])].push_back(i);
  std::vector<T> gathered, gate, up, down;
  for (int64_t e = 0; e < E; ++e) {
    const auto& list = slots[static_cast<size_t>(e)];
    const auto n = static_cast<int64_t>(list.size());
    if (n == 0) continue;
    gathered.resize(static_cast<size_t>(n * D));
    for (int64_t r = 0; r < n; ++r) {
      const int64_t token = list[static_cast<size_t>(r)] / k;
      std::copy(x + token * D, x + (token + 1) * D, gathered.begin() + r * D);
    }
    gate.resize(static_cast<size_t>(n * I));
    up.resize(static_cast<size_t>(n * I));
    down.resize(static_cast<size_t>(n * D));
    const T* wg = w.experts_gate_up.data<T>() + e * 2 * I * D;
    linear(gathered.data(), wg, gate.data(), n, D, I);
    linear(gathered.data(), wg + I * D, up.data(), n, D, I);
    clamped_swiglu(gate.data(), up.data(), gate.data(), n * I, c.swiglu_limit);
    linear(gate.data(), w.experts_down.data<T>() + e * D * I, down.data(), n, I, D);
    for (int64_t r = 0; r < n; ++r) {
      const int64_t slot = list[static_cast<size_t>(r)];
      const int64_t token = slot / k;
      const T scale = weight[static_cast<size_t>(slot)];
      for (int64_t d = 0; d < D; ++d) y[token * D + d] += scale * down[static_cast<size_t>(r * D + d)];
    }
  }
}

template <class T>
void moe_backward(const ModelConfig& c, const MoeWeights& w, const T* x, int64_t L, const T* dy, T* dx,
                  MoeWeights& grad, const T* extra_dlogits) {
  using namespace cpu;
  const int64_t D = c.hidden_size, E = c.n_routed_experts, I = c.moe_intermediate_size,
                k = c.num_experts_per_tok;
  const RouterShape shape{L, E, c.n_group, c.topk_group, k, c.norm_topk_prob, c.routed_scaling_factor};
  std::vector<T> logits(static_cast<size_t>(L * E)), weight(static_cast<size_t>(L * k));
  std::vector<T> dweight(static_cast<size_t>(L * k), T(0));
  std::vector<int32_t> expert(static_cast<size_t>(L * k));
  linear(x, w.router.data<T>(), logits.data(), L, D, E);
  route_tokens<T>(shape, logits.data(), w.correction_bias.data<T>(), expert.data(), weight.data());

  mlp_backward(w.shared, c.swiglu_limit, x, L, dy, dx, grad.shared);

  std::vector<std::vector<int64_t>> slots(static_cast<size_t>(E));
  for (int64_t i = 0; i < L * k; ++i) slots[static_cast<size_t>(expert[static_cast<size_t>(i)])].push_back(i);
  std::vector<T> gathered, gate, up, hidden, out, dout, dhidden, dgate, dup, dgathered;
  for (int64_t e = 0; e < E; ++e) {
    const auto& list = slots[static_cast<size_t>(e)];
    const auto n = static_cast<int64_t>(list.size());
    if (n == 0) continue;
    auto sized = [](std::vector<T>& v, int64_t size) { v.assign(static_cast<size_t>(size), T(0)); };
    sized(gathered, n * D);
    for (int64_t r = 0; r < n; ++r) {
      const int64_t token = list[static_cast<size_t>(r)] / k;
      std::copy(x + token * D, x + (token + 1) * D, gathered.begin() + r * D);
    }
    sized(gate, n * I), sized(up, n * I), sized(hidden, n * I), sized(out, n * D);
    const T* wg = w.experts_gate_up.data<T>() + e * 2 * I * D;
    const T* wu = wg + I * D;
    const T* wd = w.experts_down.data<T>() + e * D * I;
    linear(gathered.data(), wg, gate.data(), n, D, I);
    linear(gathered.data(), wu, up.data(), n, D, I);
    clamped_swiglu(gate.data(), up.data(), hidden.data(), n * I, c.swiglu_limit);
    linear(hidden.data(), wd, out.data(), n, I, D);
    // y[token] += weight * out: the weight's gradient is dy . out, out's is weight * dy.
    sized(dout, n * D);
    for (int64_t r = 0; r < n; ++r) {
      const int64_t slot = list[static_cast<size_t>(r)], token = slot / k;
      T dot = 0;
      for (int64_t d = 0; d < D; ++d) {
        dot += dy[token * D + d] * out[static_cast<size_t>(r * D + d)];
        dout[static_cast<size_t>(r * D + d)] = weight[static_cast<size_t>(slot)] * dy[token * D + d];
      }
      dweight[static_cast<size_t>(slot)] = dot;
    }
    sized(dhidden, n * I), sized(dgate, n * I), sized(dup, n * I), sized(dgathered, n * D);
    linear_backward(hidden.data(), wd, dout.data(), dhidden.data(), grad.experts_down.data<T>() + e * D * I,
                    n, I, D);
    clamped_swiglu_backward(gate.data(), up.data(), dhidden.data(), dgate.data(), dup.data(), n * I,
                            c.swiglu_limit);
    T* dwg = grad.experts_gate_up.data<T>() + e * 2 * I * D;
    linear_backward(gathered.data(), wg, dgate.data(), dgathered.data(), dwg, n, D, I);
    linear_backward(gathered.data(), wu, dup.data(), dgathered.data(), dwg + I * D, n, D, I);
    for (int64_t r = 0; r < n; ++r) {
      const int64_t token = list[static_cast<size_t>(r)] / k;
      for (int64_t d = 0; d < D; ++d) dx[token * D + d] += dgathered[static_cast<size_t>(r * D + d)];
    }
  }
  std::vector<T> dlogits(static_cast<size_t>(L * E));
  route_weights_backward<T>(shape, logits.data(), expert.data(), dweight.data(), dlogits.data());
  if (extra_dlogits != nullptr)
    for (size_t i = 0; i < dlogits.size(); ++i) dlogits[i] += extra_dlogits[i];
  linear_backward(x, w.router.data<T>(), dlogits.data(), dx, grad.router.data<T>(), L, D, E);
}

template void moe_forward<float>(const ModelConfig&, const MoeWeights&, const float*, int64_t, float*,
                                 std::vector<int64_t>*, std::vector<float>*);
template void moe_forward<double>(const ModelConfig&, const MoeWeights&, const double*, int64_t, double*,
                                  std::vector<int64_t>*, std::vector<double>*);
template void moe_backward<float>(const ModelConfig&, const MoeWeights&, const float*, int64_t, const float*,
                                  float*, MoeWeights&, const float*);
template void moe_backward<double>(const ModelConfig&, const MoeWeights&, const double*, int64_t,
                                   const double*, double*, MoeWeights&, const double*);

}  // namespace spindle
