#include "kernels/cpu/kda.h"

#include <algorithm>
#include <cmath>

#include "kernels/cpu/linear.h"
#include "kernels/cpu/norms.h"
#include "model/modules.h"

namespace spindle {

template <class T>
KdaCarry<T>::KdaCarry(const ModelConfig& c)
    : state(static_cast<size_t>(c.linear_num_heads * c.linear_head_dim * c.linear_head_dim), T(0)),
      q_tail(static_cast<size_t>((c.linear_conv_kernel_dim - 1) * c.linear_qkv_dim()), T(0)),
      k_tail(q_tail),
      v_tail(q_tail) {}

namespace {

// Projection, then the depthwise causal conv + SiLU over the carried window followed by this
// chunk's rows; the window moves on to this chunk's last kernel - 1 rows.
template <class T>
void project_and_convolve(const ModelConfig& c, const T* x, int64_t L, const Tensor& proj, const Tensor& conv,
                          std::vector<T>& tail, T* out) {
  const int64_t D = c.hidden_size, qkv = c.linear_qkv_dim(), K = c.linear_conv_kernel_dim;
  const int64_t rows = K - 1 + L;
  std::vector<T> window(static_cast<size_t>(rows * qkv)), convolved(window.size());
  std::copy(tail.begin(), tail.end(), window.begin());
  cpu::linear(x, proj.data<T>(), window.data() + (K - 1) * qkv, L, D, qkv);
  cpu::causal_conv_silu(window.data(), conv.data<T>(), convolved.data(), rows, qkv, K);
  std::copy(convolved.begin() + (K - 1) * qkv, convolved.end(), out);
  std::copy(window.end() - static_cast<std::ptrdiff_t>(tail.size()), window.end(), tail.begin());
}

}  // namespace

template <class T>
void kda_forward(const ModelConfig& c, const KdaWeights& w, const T* x, int64_t L, T* y) {
  KdaCarry<T> carry(c);
  kda_forward(c, w, x, L, y, carry);
}

template <class T>
void kda_forward(const ModelConfig& c, const KdaWeights& w, const T* x, int64_t L, T* y, KdaCarry<T>& carry) {
  using namespace cpu;
  const int64_t D = c.hidden_size, H = c.linear_num_heads, dh = c.linear_head_dim, qkv = c.linear_qkv_dim();
  const auto n = static_cast<size_t>(L * qkv);
  std::vector<T> projected(n), q(n), k(n), v(n);

  // Projections, each followed by its own depthwise causal conv and SiLU (zeros before the
  // sequence: the initial window).
  project_and_convolve(c, x, L, w.q_proj, w.q_conv, carry.q_tail, q.data());
  project_and_convolve(c, x, L, w.k_proj, w.k_conv, carry.k_tail, k.data());
  project_and_convolve(c, x, L, w.v_proj, w.v_conv, carry.v_tail, v.data());

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

  std::vector<T> core(n);
  kda_recurrence<T>({L, H, dh, dh}, q.data(), k.data(), v.data(), g.data(), beta.data(), core.data(),
                    carry.state.data());

  // Output: RMSNorm per head gated by sigmoid(g_b(g_a x)), then o_proj.
  std::vector<T> gate(n);
  linear(x, w.g_a_proj.data<T>(), low.data(), L, D, dh);
  linear(low.data(), w.g_b_proj.data<T>(), gate.data(), L, dh, qkv);
  gated_rms_norm(core.data(), w.o_norm.data<T>(), gate.data(), projected.data(), L * H, dh, c.rms_norm_eps);
  linear(projected.data(), w.o_proj.data<T>(), y, L, qkv, D);
}

template <class T>
void kda_backward(const ModelConfig& c, const KdaWeights& w, const T* x, int64_t L, const T* dy, T* dx,
                  KdaWeights& grad) {
  const KdaCarry<T> start(c);
  KdaCarry<T> carry_grad(c);
  kda_backward(c, w, x, L, dy, dx, grad, start, carry_grad);
}

template <class T>
void kda_backward(const ModelConfig& c, const KdaWeights& w, const T* x, int64_t L, const T* dy, T* dx,
                  KdaWeights& grad, const KdaCarry<T>& carry_in, KdaCarry<T>& carry_grad) {
  using namespace cpu;
  const int64_t D = c.hidden_size, H = c.linear_num_heads, dh = c.linear_head_dim, qkv = c.linear_qkv_dim();
  const int64_t K = c.linear_conv_kernel_dim;
  const auto n = static_cast<size_t>(L * qkv);
  auto buffer = [](size_t size) { return std::vector<T>(size, T(0)); };

  // Recompute the forward pass, keeping what the backward pass reads.
  // Each projection's window: the carried rows, then this chunk's (the conv reads both).
  const int64_t rows = K - 1 + L;
  std::vector<T> qw = carry_in.q_tail, kw = carry_in.k_tail, vw = carry_in.v_tail, qc = buffer(n),
                 kc = buffer(n), vc = buffer(n);
  for (auto* window : {&qw, &kw, &vw}) window->resize(static_cast<size_t>(rows * qkv));
  linear(x, w.q_proj.data<T>(), qw.data() + (K - 1) * qkv, L, D, qkv);
  linear(x, w.k_proj.data<T>(), kw.data() + (K - 1) * qkv, L, D, qkv);
  linear(x, w.v_proj.data<T>(), vw.data() + (K - 1) * qkv, L, D, qkv);
  std::vector<T> convolved = buffer(static_cast<size_t>(rows * qkv));
  for (auto [window, out] : {std::pair{&qw, &qc}, std::pair{&kw, &kc}, std::pair{&vw, &vc}}) {
    const Tensor& conv = window == &qw ? w.q_conv : window == &kw ? w.k_conv : w.v_conv;
    causal_conv_silu(window->data(), conv.data<T>(), convolved.data(), rows, qkv, K);
    std::copy(convolved.begin() + (K - 1) * qkv, convolved.end(), out->begin());
  }
  std::vector<T> f_low = buffer(static_cast<size_t>(L * dh)), pre = buffer(n), g = buffer(n);
  linear(x, w.f_a_proj.data<T>(), f_low.data(), L, D, dh);
  linear(f_low.data(), w.f_b_proj.data<T>(), pre.data(), L, dh, qkv);
  const T* dt_bias = w.dt_bias.data<T>();
  const T* A_log = w.A_log.data<T>();
  for (int64_t t = 0; t < L; ++t)
    for (int64_t i = 0; i < qkv; ++i) {
      const auto at = static_cast<size_t>(t * qkv + i);
      pre[at] += dt_bias[i];
      const T rate = std::exp(A_log[i / dh]);
      g[at] = c.linear_lower_bound ? T(*c.linear_lower_bound) * sigmoid(rate * pre[at])
                                   : -rate * softplus_thresholded(pre[at]);
    }
  std::vector<T> beta = buffer(static_cast<size_t>(L * H));
  linear(x, w.b_proj.data<T>(), beta.data(), L, D, H);
  for (T& b : beta) b = sigmoid(b);
  std::vector<T> qn = qc, kn = kc;
  l2_normalize(qn.data(), L * H, dh, 1e-6);
  l2_normalize(kn.data(), L * H, dh, 1e-6);
  const T scale = T(1) / std::sqrt(T(dh));
  for (T& value : qn) value *= scale;
  std::vector<T> core = buffer(n), state = carry_in.state;
  kda_recurrence<T>({L, H, dh, dh}, qn.data(), kn.data(), vc.data(), g.data(), beta.data(), core.data(),
                    state.data());
  std::vector<T> gate_low = buffer(static_cast<size_t>(L * dh)), gate = buffer(n), z = buffer(n);
  linear(x, w.g_a_proj.data<T>(), gate_low.data(), L, D, dh);
  linear(gate_low.data(), w.g_b_proj.data<T>(), gate.data(), L, dh, qkv);
  gated_rms_norm(core.data(), w.o_norm.data<T>(), gate.data(), z.data(), L * H, dh, c.rms_norm_eps);

  // Output projection and gated norm.
  std::vector<T> dz = buffer(n), dcore = buffer(n), dgate = buffer(n);
  linear_backward(z.data(), w.o_proj.data<T>(), dy, dz.data(), grad.o_proj.data<T>(), L, qkv, D);
  gated_rms_norm_backward(core.data(), w.o_norm.data<T>(), gate.data(), dz.data(), dcore.data(), dgate.data(),
                          grad.o_norm.data<T>(), L * H, dh, c.rms_norm_eps);
  std::vector<T> d_low = buffer(static_cast<size_t>(L * dh));
  linear_backward(gate_low.data(), w.g_b_proj.data<T>(), dgate.data(), d_low.data(), grad.g_b_proj.data<T>(),
                  L, dh, qkv);
  linear_backward(x, w.g_a_proj.data<T>(), d_low.data(), dx, grad.g_a_proj.data<T>(), L, D, dh);

  // The delta rule, walked in reverse.
  std::vector<T> dqn = buffer(n), dkn = buffer(n), dvc = buffer(n), dg = buffer(n),
                 dbeta = buffer(static_cast<size_t>(L * H));
  std::vector<T> d_initial_state = buffer(carry_grad.state.size());
  kda_recurrence_backward<T>({L, H, dh, dh}, qn.data(), kn.data(), vc.data(), g.data(), beta.data(),
                             dcore.data(), dqn.data(), dkn.data(), dvc.data(), dg.data(), dbeta.data(), 64,
                             {carry_in.state.data(), carry_grad.state.data(), d_initial_state.data()});
  carry_grad.state = d_initial_state;

  // Gates: beta = sigmoid(b_proj x); g from the forget gate.
  for (size_t i = 0; i < dbeta.size(); ++i) dbeta[i] *= beta[i] * (T(1) - beta[i]);
  linear_backward(x, w.b_proj.data<T>(), dbeta.data(), dx, grad.b_proj.data<T>(), L, D, H);
  T* d_dt_bias = grad.dt_bias.data<T>();
  T* d_A_log = grad.A_log.data<T>();
  for (int64_t t = 0; t < L; ++t)
    for (int64_t i = 0; i < qkv; ++i) {
      const auto at = static_cast<size_t>(t * qkv + i);
      const T rate = std::exp(A_log[i / dh]);
      T dpre, drate;
      if (c.linear_lower_bound) {
        const T s = sigmoid(rate * pre[at]);
        const T du = dg[at] * T(*c.linear_lower_bound) * s * (T(1) - s);
        dpre = du * rate;
        drate = du * pre[at];
      } else {
        const T slope = pre[at] > T(20) ? T(1) : sigmoid(pre[at]);
        dpre = -rate * slope * dg[at];
        drate = -softplus_thresholded(pre[at]) * dg[at];
      }
      d_A_log[i / dh] += drate * rate;
      d_dt_bias[i] += dpre;
      dg[at] = dpre;  // reused as the gradient of f_b's output
    }
  std::fill(d_low.begin(), d_low.end(), T(0));
  linear_backward(f_low.data(), w.f_b_proj.data<T>(), dg.data(), d_low.data(), grad.f_b_proj.data<T>(), L, dh,
                  qkv);
  linear_backward(x, w.f_a_proj.data<T>(), d_low.data(), dx, grad.f_a_proj.data<T>(), L, D, dh);

  // l2 norms (with the query scale), convs, projections.
  for (T& value : dqn) value *= scale;
  std::vector<T> dqc = buffer(n), dkc = buffer(n);
  l2_normalize_backward(qc.data(), dqn.data(), dqc.data(), L * H, dh, 1e-6);
  l2_normalize_backward(kc.data(), dkn.data(), dkc.data(), L * H, dh, 1e-6);
  struct Branch {
    const std::vector<T>& window;
    const std::vector<T>& dconv;
    const Tensor& conv;
    Tensor& dconv_w;
    const Tensor& proj;
    Tensor& dproj_w;
    std::vector<T>& dtail;  // in: the handed-on window's gradient; out: the carried-in window's
  };
  // The conv's gradient over the whole window, plus what later chunks sent back for the rows this
  // chunk handed on; the chunk's own rows go to the projection, the carried rows back to the carry.
  std::vector<T> dconv_window = buffer(static_cast<size_t>(rows * qkv)),
                 dwindow = buffer(static_cast<size_t>(rows * qkv));
  for (const Branch& b : {Branch{qw, dqc, w.q_conv, grad.q_conv, w.q_proj, grad.q_proj, carry_grad.q_tail},
                          Branch{kw, dkc, w.k_conv, grad.k_conv, w.k_proj, grad.k_proj, carry_grad.k_tail},
                          Branch{vw, dvc, w.v_conv, grad.v_conv, w.v_proj, grad.v_proj, carry_grad.v_tail}}) {
    std::copy(b.dconv.begin(), b.dconv.end(), dconv_window.begin() + (K - 1) * qkv);
    causal_conv_silu_backward(b.window.data(), b.conv.template data<T>(), dconv_window.data(), dwindow.data(),
                              b.dconv_w.template data<T>(), rows, qkv, K);
    const auto handed_on = static_cast<std::ptrdiff_t>(dwindow.size() - b.dtail.size());
    for (size_t i = 0; i < b.dtail.size(); ++i) dwindow[static_cast<size_t>(handed_on) + i] += b.dtail[i];
    linear_backward(x, b.proj.template data<T>(), dwindow.data() + (K - 1) * qkv, dx,
                    b.dproj_w.template data<T>(), L, D, qkv);
    std::copy(dwindow.begin(), dwindow.begin() + static_cast<std::ptrdiff_t>(b.dtail.size()),
              b.dtail.begin());
  }
}

template struct KdaCarry<float>;
template struct KdaCarry<double>;
template void kda_forward<float>(const ModelConfig&, const KdaWeights&, const float*, int64_t, float*);
template void kda_forward<double>(const ModelConfig&, const KdaWeights&, const double*, int64_t, double*);
template void kda_forward<float>(const ModelConfig&, const KdaWeights&, const float*, int64_t, float*,
                                 KdaCarry<float>&);
template void kda_forward<double>(const ModelConfig&, const KdaWeights&, const double*, int64_t, double*,
                                  KdaCarry<double>&);
template void kda_backward<float>(const ModelConfig&, const KdaWeights&, const float*, int64_t, const float*,
                                  float*, KdaWeights&, const KdaCarry<float>&, KdaCarry<float>&);
template void kda_backward<double>(const ModelConfig&, const KdaWeights&, const double*, int64_t,
                                   const double*, double*, KdaWeights&, const KdaCarry<double>&,
                                   KdaCarry<double>&);
template void kda_backward<float>(const ModelConfig&, const KdaWeights&, const float*, int64_t, const float*,
                                  float*, KdaWeights&);
template void kda_backward<double>(const ModelConfig&, const KdaWeights&, const double*, int64_t,
                                   const double*, double*, KdaWeights&);

}  // namespace spindle
