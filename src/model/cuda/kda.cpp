// Kimi Delta Attention on the GPU: the CPU module's steps (model/kda.cpp) with bf16
// activations, fp32 gates, decays and recurrent state.
#include "kernels/cuda/kda.h"

#include <cmath>

#include "kernels/cuda/conv.h"
#include "kernels/cuda/convert.h"
#include "kernels/cuda/kda_gates.h"
#include "kernels/cuda/norms.h"
#include "model/cuda/device_weights.h"
#include "model/cuda/modules.h"

namespace spindle::cuda {

namespace {

// The forward's intermediates, kept for the backward pass.
struct KdaActivations {
  DeviceBuffer<bf16> qp, kp, vp, qc, kc, vc, q, k, f_low, gate_low, gate, core;
  DeviceBuffer<float> f, g, beta, chunk_states;
};

KdaDecayShape decay_shape(const ModelConfig& c, int64_t L) {
  return {L, c.linear_num_heads, c.linear_head_dim, c.linear_lower_bound.has_value(),
          static_cast<float>(c.linear_lower_bound.value_or(0.0))};
}

KdaActivations kda_activations(Context& ctx, const ModelConfig& c, const KdaWeights& w, const bf16* x,
                               int64_t L) {
  const int64_t D = c.hidden_size, H = c.linear_num_heads, dh = c.linear_head_dim, qkv = c.linear_qkv_dim();
  const int64_t K = c.linear_conv_kernel_dim;
  check(dh <= kKdaMaxDim, "KDA head_dim ", dh, " exceeds the CUDA kernel's limit ", kKdaMaxDim);
  const cudaStream_t s = ctx.stream();
  KdaActivations a;
  for (auto* b : {&a.qp, &a.kp, &a.vp, &a.qc, &a.kc, &a.vc, &a.q, &a.k, &a.gate, &a.core})
    *b = activations(L * qkv);
  a.f_low = activations(L * dh);
  a.gate_low = activations(L * dh);
  a.f = activations_f32(L * qkv);
  a.g = activations_f32(L * qkv);
  a.beta = activations_f32(L * H);
  a.chunk_states = activations_f32((kda_chunks(L) + 1) * H * dh * dh);

  ctx.gemm.linear(x, bf16_data(w.q_proj), a.qp.data(), L, D, qkv, s);
  ctx.gemm.linear(x, bf16_data(w.k_proj), a.kp.data(), L, D, qkv, s);
  ctx.gemm.linear(x, bf16_data(w.v_proj), a.vp.data(), L, D, qkv, s);
  causal_conv_silu(a.qp.data(), f32_data(w.q_conv), a.qc.data(), L, qkv, K, s);
  causal_conv_silu(a.kp.data(), f32_data(w.k_conv), a.kc.data(), L, qkv, K, s);
  causal_conv_silu(a.vp.data(), f32_data(w.v_conv), a.vc.data(), L, qkv, K, s);
  l2_normalize_forward(a.qc.data(), a.q.data(), L * H, dh, 1e-6f, 1.0f / std::sqrt(static_cast<float>(dh)),
                       s);
  l2_normalize_forward(a.kc.data(), a.k.data(), L * H, dh, 1e-6f, 1.0f, s);

  ctx.gemm.linear(x, bf16_data(w.f_a_proj), a.f_low.data(), L, D, dh, s);
  ctx.gemm.linear(a.f_low.data(), bf16_data(w.f_b_proj), a.f.data(), L, dh, qkv, s);
  kda_decay_forward(decay_shape(c, L), a.f.data(), f32_data(w.dt_bias), f32_data(w.A_log), a.g.data(), s);
  ctx.gemm.linear(x, bf16_data(w.b_proj), a.beta.data(), L, D, H, s);
  sigmoid_forward(a.beta.data(), a.beta.data(), L * H, s);

  {
    const TimedScope timed = ctx.timed("kda.recurrence");
    DeviceBuffer<float> workspace(static_cast<size_t>(kda_forward_workspace_floats(L, H)),
                                  MemoryCategory::Workspace);
    kda_chunked_forward(a.q.data(), a.k.data(), a.vc.data(), a.g.data(), a.beta.data(), a.core.data(),
                        a.chunk_states.data(), workspace.data(), L, H, dh, dh, s);
  }
  ctx.gemm.linear(x, bf16_data(w.g_a_proj), a.gate_low.data(), L, D, dh, s);
  ctx.gemm.linear(a.gate_low.data(), bf16_data(w.g_b_proj), a.gate.data(), L, dh, qkv, s);
  ctx.record.note("kda/projections", "cublaslt bf16");
  ctx.record.note("kda/conv", "cuda causal_conv_silu");
  ctx.record.note("kda/recurrence", "cuda chunked (C=64, fp32 state)");
  return a;
}

}  // namespace

void kda_forward(Context& ctx, const ModelConfig& c, const KdaWeights& w, const bf16* x, int64_t L, bf16* y) {
  const int64_t D = c.hidden_size, H = c.linear_num_heads, dh = c.linear_head_dim, qkv = c.linear_qkv_dim();
  KdaActivations a = kda_activations(ctx, c, w, x, L);
  // The gated norm's output reuses qp (free after the conv).
  gated_rms_norm_forward(a.core.data(), bf16_data(w.o_norm), a.gate.data(), a.qp.data(), L * H, dh,
                         static_cast<float>(c.rms_norm_eps), ctx.stream());
  ctx.gemm.linear(a.qp.data(), bf16_data(w.o_proj), y, L, qkv, D, ctx.stream());
}

void kda_backward(Context& ctx, const ModelConfig& c, const KdaWeights& w, const bf16* x, int64_t L,
                  const bf16* dy, float* dx, KdaWeights& grad) {
  const int64_t D = c.hidden_size, H = c.linear_num_heads, dh = c.linear_head_dim, qkv = c.linear_qkv_dim();
  const int64_t K = c.linear_conv_kernel_dim;
  const float eps = static_cast<float>(c.rms_norm_eps);
  const cudaStream_t s = ctx.stream();
  Gemm& gemm = ctx.gemm;
  KdaActivations a = kda_activations(ctx, c, w, x, L);
  DeviceBuffer<bf16> z = activations(L * qkv);
  gated_rms_norm_forward(a.core.data(), bf16_data(w.o_norm), a.gate.data(), z.data(), L * H, dh, eps, s);

  // Output projection and gated norm; then the gate's low-rank branch.
  DeviceBuffer<bf16> dz = activations(L * qkv), dcore = activations(L * qkv), dgate = activations(L * qkv);
  gemm.linear_backward_input(dy, bf16_data(w.o_proj), dz.data(), L, qkv, D, s);
  gemm.linear_backward_weight(dy, z.data(), f32_data(grad.o_proj), L, qkv, D, s);
  gated_rms_norm_backward(a.core.data(), bf16_data(w.o_norm), a.gate.data(), dz.data(), dcore.data(),
                          dgate.data(), f32_data(grad.o_norm), L * H, dh, eps, s);
  DeviceBuffer<bf16> d_low = activations(L * dh);
  gemm.linear_backward_input(dgate.data(), bf16_data(w.g_b_proj), d_low.data(), L, dh, qkv, s);
  gemm.linear_backward_weight(dgate.data(), a.gate_low.data(), f32_data(grad.g_b_proj), L, dh, qkv, s);
  gemm.linear_backward_input(d_low.data(), bf16_data(w.g_a_proj), dx, L, D, dh, 1.0f, s);
  gemm.linear_backward_weight(d_low.data(), x, f32_data(grad.g_a_proj), L, D, dh, s);

  // The delta rule.
  DeviceBuffer<float> dq = activations_f32(L * qkv), dk = activations_f32(L * qkv),
                      dv = activations_f32(L * qkv), dg = activations_f32(L * qkv),
                      dbeta = activations_f32(L * H);
  {
    const TimedScope timed = ctx.timed("kda.recurrence_backward");
    kda_chunked_backward(a.q.data(), a.k.data(), a.vc.data(), a.g.data(), a.beta.data(), dcore.data(),
                         a.chunk_states.data(), dq.data(), dk.data(), dv.data(), dg.data(), dbeta.data(), L,
                         H, dh, dh, s);
  }

  // beta = sigmoid(b_proj x); g from the forget gate's low-rank branch.
  DeviceBuffer<bf16> db = activations(L * H), df = activations(L * qkv);
  sigmoid_backward(a.beta.data(), dbeta.data(), db.data(), L * H, s);
  gemm.linear_backward_input(db.data(), bf16_data(w.b_proj), dx, L, D, H, 1.0f, s);
  gemm.linear_backward_weight(db.data(), x, f32_data(grad.b_proj), L, D, H, s);
  kda_decay_backward(decay_shape(c, L), a.f.data(), f32_data(w.dt_bias), f32_data(w.A_log), dg.data(),
                     df.data(), f32_data(grad.dt_bias), f32_data(grad.A_log), s);
  gemm.linear_backward_input(df.data(), bf16_data(w.f_b_proj), d_low.data(), L, dh, qkv, s);
  gemm.linear_backward_weight(df.data(), a.f_low.data(), f32_data(grad.f_b_proj), L, dh, qkv, s);
  gemm.linear_backward_input(d_low.data(), bf16_data(w.f_a_proj), dx, L, D, dh, 1.0f, s);
  gemm.linear_backward_weight(d_low.data(), x, f32_data(grad.f_a_proj), L, D, dh, s);

  // l2 norms (the query scale inside), convs, projections; buffers of the forward are reused.
  DeviceBuffer<bf16>& dqc = dz;
  DeviceBuffer<bf16>& dkc = dcore;
  DeviceBuffer<bf16>& dvc = dgate;
  l2_normalize_backward(a.qc.data(), dq.data(), dqc.data(), L * H, dh, 1e-6f,
                        1.0f / std::sqrt(static_cast<float>(dh)), s);
  l2_normalize_backward(a.kc.data(), dk.data(), dkc.data(), L * H, dh, 1e-6f, 1.0f, s);
  f32_to_bf16(dv.data(), dvc.data(), L * qkv, s);
  struct Branch {
    const bf16* projected;
    const bf16* dconv;
    const Tensor& conv;
    Tensor& dconv_w;
    const Tensor& proj;
    Tensor& dproj_w;
  };
  DeviceBuffer<bf16>& dproj = df;
  for (const Branch& b : {Branch{a.qp.data(), dqc.data(), w.q_conv, grad.q_conv, w.q_proj, grad.q_proj},
                          Branch{a.kp.data(), dkc.data(), w.k_conv, grad.k_conv, w.k_proj, grad.k_proj},
                          Branch{a.vp.data(), dvc.data(), w.v_conv, grad.v_conv, w.v_proj, grad.v_proj}}) {
    causal_conv_silu_backward(b.projected, f32_data(b.conv), b.dconv, dproj.data(), f32_data(b.dconv_w), L,
                              qkv, K, s);
    gemm.linear_backward_input(dproj.data(), bf16_data(b.proj), dx, L, D, qkv, 1.0f, s);
    gemm.linear_backward_weight(dproj.data(), x, f32_data(b.dproj_w), L, D, qkv, s);
  }
}

}  // namespace spindle::cuda
