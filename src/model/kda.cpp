#include "kernels/cpu/kda.h"

#include <cmath>

#include "kernels/cpu/linear.h"
#include "kernels/cpu/norms.h"
#include "model/modules.h"

namespace spindle {

template <class T>
void kda_forward(const ModelConfig& c, const KdaWeights& w, const T* x, int64_t L, T* y) {
  using namespace cpu;
  const int64_t D = c.hidden_size, H = c.linear_num_heads, dh = c.linear_head_dim, qkv = c.linear_qkv_dim();
  const int64_t K = c.linear_conv_kernel_dim;
  const auto n = static_cast<size_t>(L * qkv);
  std::vector<T> projected(n), q(n), k(n), v(n);

  // Projections, each followed by its own depthwise causal conv and SiLU.
  linear(x, w.q_proj.data<T>(), projected.data(), L, D, qkv);
  causal_conv_silu(projected.data(), w.q_conv.data<T>(), q.data(), L, qkv, K);
  linear(x, w.k_proj.data<T>(), projected.data(), L, D, qkv);
  causal_conv_silu(projected.data(), w.k_conv.data<T>(), k.data(), L, qkv, K);
  linear(x, w.v_proj.data<T>(), projected.data(), L, D, qkv);
  causal_conv_silu(projected.data(), w.v_conv.data<T>(), v.data(), L, qkv, K);

  // Per-channel log decay g: lb * sigmoid(exp(A_log) * (f + dt_bias)), or -exp(A_log) * softplus(...).
  std::vector<T> low(static_cast<size_t>(L * dh)), g(n);
  linear(x, w.f_a_proj.data<T>(), low.data(), L, D, dh);
  linear(low.data(), w.f_b_proj.data<T>(), g.data(), L, dh, qkv);
  const T* dt_bias = w.dt_bias.data<T>();
  const T* A_log = w.A_log.data<T>();
  for (int64_t t = 0; t < L; ++t) {
    for (int64_t h = 0; h < H; ++h) {
      const T rate = std::exp(A_log[h]);
      for (int64_t i = 0; i < dh; ++i) {
        T& gi = g[static_cast<size_t>(t * qkv + h * dh + i)];
        const T pre = gi + dt_bias[h * dh + i];
        gi = c.linear_lower_bound ? T(*c.linear_lower_bound) * sigmoid(rate * pre)
                                  : -rate * softplus_thresholded(pre);
      }
    }
  }
  std::vector<T> beta(static_cast<size_t>(L * H));
  linear(x, w.b_proj.data<T>(), beta.data(), L, D, H);
  for (T& b : beta) b = sigmoid(b);

  l2_normalize(q.data(), L * H, dh, 1e-6);
  l2_normalize(k.data(), L * H, dh, 1e-6);
  const T scale = T(1) / std::sqrt(T(dh));
  for (T& value : q) value *= scale;

  std::vector<T> state(static_cast<size_t>(H * dh * dh), T(0)), core(n);
  kda_recurrence<T>({L, H, dh, dh}, q.data(), k.data(), v.data(), g.data(), beta.data(), core.data(),
                    state.data());

  // Output: RMSNorm per head gated by sigmoid(g_b(g_a x)), then o_proj.
  std::vector<T> gate(n);
  linear(x, w.g_a_proj.data<T>(), low.data(), L, D, dh);
  linear(low.data(), w.g_b_proj.data<T>(), gate.data(), L, dh, qkv);
  gated_rms_norm(core.data(), w.o_norm.data<T>(), gate.data(), projected.data(), L * H, dh, c.rms_norm_eps);
  linear(projected.data(), w.o_proj.data<T>(), y, L, qkv, D);
}

template void kda_forward<float>(const ModelConfig&, const KdaWeights&, const float*, int64_t, float*);
template void kda_forward<double>(const ModelConfig&, const KdaWeights&, const double*, int64_t, double*);

}  // namespace spindle
