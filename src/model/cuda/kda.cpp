// Kimi Delta Attention on the GPU: the CPU module's steps (model/kda.cpp) with bf16
// activations, fp32 gates, decays and recurrent state.
#include "kernels/cuda/kda.h"

#include <array>
#include <cmath>
#include <utility>

#include "backend/cuda/check.h"
#include "kernels/cuda/conv.h"
#include "kernels/cuda/convert.h"
#include "kernels/cuda/kda_gates.h"
#include "kernels/cuda/norms.h"
#include "model/cuda/device_weights.h"
#include "model/cuda/modules.h"

namespace spindle::cuda {

namespace {

// Each projection goes into a window of kernel - 1 + L rows: the carried rows (zeros at the start
// of a sequence), then this chunk's; the conv runs over the whole window and the chunk's outputs
// are its rows from kernel - 1 on.
struct KdaActivations {
  DeviceBuffer<bf16> qp, kp, vp, qcw, kcw, vcw, q, k, f_low, gate_low, gate, core;
  DeviceBuffer<float> f, g, beta, chunk_states, matrices;  // matrices: kept ones, or empty
};

KdaDecayShape decay_shape(const ModelConfig& c, int64_t L) {
  return {L, c.linear_num_heads, c.linear_head_dim, c.linear_lower_bound.has_value(),
          static_cast<float>(c.linear_lower_bound.value_or(0.0))};
}

// Values in the carried rows of one projection's window: (kernel - 1) * qkv.
int64_t tail_size(const ModelConfig& c) { return (c.linear_conv_kernel_dim - 1) * c.linear_qkv_dim(); }

int64_t state_size(const ModelConfig& c) {
  return c.linear_num_heads * c.linear_head_dim * c.linear_head_dim;
}

void copy_device(void* to, const void* from, size_t bytes, cudaStream_t s) {
  SPINDLE_CUDA(cudaMemcpyAsync(to, from, bytes, cudaMemcpyDeviceToDevice, s));
}

// Gemm::linear_backward_input into, and linear_backward_weight from, columns of a wider row-major
// buffer whose rows are `ld` values apart.
void backward_input_into_columns(Gemm& gemm, const bf16* dy, const bf16* w, bf16* dx, int64_t ld, int64_t M,
                                 int64_t K, int64_t N, cudaStream_t s) {
  gemm.matmul(false, false, K, M, N, w, K, dy, N, dx, CUDA_R_16BF, ld, 1.0f, 0.0f, s);
}

// dx += dy w for dy in a row-major buffer whose rows are `ld` values apart (fp32 dx, [M, K]).
void backward_input_from_columns(Gemm& gemm, const bf16* dy, int64_t ld, const bf16* w, float* dx, int64_t M,
                                 int64_t K, int64_t N, cudaStream_t s) {
  gemm.matmul(false, false, K, M, N, w, K, dy, ld, dx, CUDA_R_32F, K, 1.0f, 1.0f, s);
}

void backward_weight_from_columns(Gemm& gemm, const bf16* dy, int64_t ld, const bf16* x, float* dw, int64_t M,
                                  int64_t K, int64_t N, cudaStream_t s) {
  gemm.matmul(false, true, K, N, M, x, K, dy, ld, dw, CUDA_R_32F, K, 1.0f, 1.0f, s);
}

// The forward's intermediates from x and the carry the chunk starts from (null: the start of a
// sequence); the recurrence's output, chunk states and matrices taken from `kept` where it holds
// them. keep_matrices: the recurrence also writes its intra-chunk matrices into `matrices`.
KdaActivations kda_activations(Context& ctx, const ModelConfig& c, const KdaWeights& w, const bf16* x,
                               int64_t L, const KdaCarry* carry, AttentionKept* kept = nullptr,
                               bool keep_matrices = false) {
  const int64_t D = c.hidden_size, H = c.linear_num_heads, dh = c.linear_head_dim, qkv = c.linear_qkv_dim();
  const int64_t K = c.linear_conv_kernel_dim, tail = tail_size(c), rows = K - 1 + L;
  check(dh <= kKdaMaxDim, "KDA head_dim ", dh, " exceeds the CUDA kernel's limit ", kKdaMaxDim);
  const cudaStream_t s = ctx.stream();
  const bool recurrence_kept = kept != nullptr && !kept->empty();
  KdaActivations a;
  for (auto* b : {&a.qp, &a.kp, &a.vp, &a.qcw, &a.kcw, &a.vcw}) *b = activations(rows * qkv);
  for (auto* b : {&a.q, &a.k, &a.gate}) *b = activations(L * qkv);
  if (recurrence_kept) {
    check(kept->out.size() == static_cast<size_t>(L * qkv), "KDA backward: a kept output of ",
          kept->out.size(), " values for ", L, " tokens");
    a.core = std::move(kept->out);
  } else {
    a.core = activations(L * qkv);
  }
  a.f_low = activations(L * dh);
  a.gate_low = activations(L * dh);
  a.f = activations_f32(L * qkv);
  a.g = activations_f32(L * qkv);
  a.beta = activations_f32(L * H);
  if (recurrence_kept) {
    a.chunk_states = std::move(kept->stats);
    a.matrices = std::move(kept->matrices);
  } else {
    a.chunk_states = activations_f32((kda_chunks(L) + 1) * H * dh * dh);
    if (keep_matrices) a.matrices = activations_f32(kda_kept_matrices_floats(L, H));
  }

  const std::array<DeviceBuffer<bf16>*, 3> windows{&a.qp, &a.kp, &a.vp}, convolved{&a.qcw, &a.kcw, &a.vcw};
  const std::array<const Tensor*, 3> projections{&w.q_proj, &w.k_proj, &w.v_proj},
      convs{&w.q_conv, &w.k_conv, &w.v_conv};
  for (size_t b = 0; b < 3; ++b) {
    bf16* window = windows[b]->data();
    if (carry != nullptr)
      copy_device(window, carry->tails.data() + b * tail, tail * sizeof(bf16), s);
    else
      SPINDLE_CUDA(cudaMemsetAsync(window, 0, tail * sizeof(bf16), s));
    ctx.gemm.linear(x, bf16_data(*projections[b]), window + tail, L, D, qkv, s);
    causal_conv_silu(window, f32_data(*convs[b]), convolved[b]->data(), rows, qkv, K, s);
  }
  l2_normalize_forward(a.qcw.data() + tail, a.q.data(), L * H, dh, 1e-6f,
                       1.0f / std::sqrt(static_cast<float>(dh)), s);
  l2_normalize_forward(a.kcw.data() + tail, a.k.data(), L * H, dh, 1e-6f, 1.0f, s);

  ctx.gemm.linear(x, bf16_data(w.f_a_proj), a.f_low.data(), L, D, dh, s);
  ctx.gemm.linear(a.f_low.data(), bf16_data(w.f_b_proj), a.f.data(), L, dh, qkv, s);
  kda_decay_forward(decay_shape(c, L), a.f.data(), f32_data(w.dt_bias), f32_data(w.A_log), a.g.data(), s);
  ctx.gemm.linear(x, bf16_data(w.b_proj), a.beta.data(), L, D, H, s);
  sigmoid_forward(a.beta.data(), a.beta.data(), L * H, s);

  if (!recurrence_kept) {
    const TimedScope timed = ctx.timed("kda.recurrence");
    DeviceBuffer<float> workspace(static_cast<size_t>(kda_forward_workspace_floats(L, H)),
                                  MemoryCategory::Workspace);
    kda_chunked_forward(a.q.data(), a.k.data(), a.vcw.data() + tail, a.g.data(), a.beta.data(), a.core.data(),
                        a.chunk_states.data(), workspace.data(), L, H, dh, dh, s,
                        carry != nullptr ? carry->state.data() : nullptr,
                        keep_matrices ? a.matrices.data() : nullptr);
  }
  ctx.gemm.linear(x, bf16_data(w.g_a_proj), a.gate_low.data(), L, D, dh, s);
  ctx.gemm.linear(a.gate_low.data(), bf16_data(w.g_b_proj), a.gate.data(), L, dh, qkv, s);
  ctx.record.note("kda/projections", "cublaslt bf16");
  ctx.record.note("kda/conv", "cuda causal_conv_silu");
  ctx.record.note("kda/recurrence", "cuda chunked (C=64, fp32 state)");
  return a;
}

void forward(Context& ctx, const ModelConfig& c, const KdaWeights& w, const bf16* x, int64_t L, bf16* y,
             KdaCarry* carry, AttentionKept* keep) {
  const int64_t D = c.hidden_size, H = c.linear_num_heads, dh = c.linear_head_dim, qkv = c.linear_qkv_dim();
  const cudaStream_t s = ctx.stream();
  KdaActivations a = kda_activations(ctx, c, w, x, L, carry, nullptr, keep != nullptr && keep->keep_matrices);
  if (carry != nullptr) {  // the final state and each window's last kernel - 1 rows move on
    const int64_t tail = tail_size(c);
    copy_device(carry->state.data(), a.chunk_states.data() + kda_chunks(L) * state_size(c),
                state_size(c) * sizeof(float), s);
    for (const auto& [b, window] : {std::pair{0, &a.qp}, std::pair{1, &a.kp}, std::pair{2, &a.vp}})
      copy_device(carry->tails.data() + b * tail, window->data() + L * qkv, tail * sizeof(bf16), s);
  }
  // The gated norm's output reuses qp (free after the conv and the carry).
  gated_rms_norm_forward(a.core.data(), bf16_data(w.o_norm), a.gate.data(), a.qp.data(), L * H, dh,
                         static_cast<float>(c.rms_norm_eps), s);
  ctx.gemm.linear(a.qp.data(), bf16_data(w.o_proj), y, L, qkv, D, s);
  if (keep != nullptr) {
    keep->out = std::move(a.core);
    keep->stats = std::move(a.chunk_states);
    keep->matrices = std::move(a.matrices);
  }
}

void backward(Context& ctx, const ModelConfig& c, const KdaWeights& w, const bf16* x, int64_t L,
              const bf16* dy, float* dx, KdaWeights& grad, const KdaCarry* carry_in, KdaCarry* carry_grad,
              bf16* y, AttentionKept* kept) {
  const int64_t D = c.hidden_size, H = c.linear_num_heads, dh = c.linear_head_dim, qkv = c.linear_qkv_dim();
  const int64_t K = c.linear_conv_kernel_dim, tail = tail_size(c), rows = K - 1 + L;
  const float eps = static_cast<float>(c.rms_norm_eps);
  const cudaStream_t s = ctx.stream();
  Gemm& gemm = ctx.gemm;
  KdaActivations a = kda_activations(ctx, c, w, x, L, carry_in, kept);
  DeviceBuffer<bf16> z = activations(L * qkv);
  gated_rms_norm_forward(a.core.data(), bf16_data(w.o_norm), a.gate.data(), z.data(), L * H, dh, eps, s);
  if (y != nullptr) gemm.linear(z.data(), bf16_data(w.o_proj), y, L, qkv, D, s);

  // Output projection and gated norm.
  DeviceBuffer<bf16> dz = activations(L * qkv), dcore = activations(L * qkv), dgate = activations(L * qkv);
  gemm.linear_backward_input(dy, bf16_data(w.o_proj), dz.data(), L, qkv, D, s);
  gemm.linear_backward_weight(dy, z.data(), f32_data(grad.o_proj), L, qkv, D, s);
  gated_rms_norm_backward(a.core.data(), bf16_data(w.o_norm), a.gate.data(), dz.data(), dcore.data(),
                          dgate.data(), f32_data(grad.o_norm), L * H, dh, eps, s);
  gemm.linear_backward_weight(dgate.data(), a.gate_low.data(), f32_data(grad.g_b_proj), L, dh, qkv, s);

  // The delta rule; with a carry, from the state gradient the next chunk handed back to the one
  // this chunk's initial state receives.
  DeviceBuffer<float> dq = activations_f32(L * qkv), dk = activations_f32(L * qkv),
                      dv = activations_f32(L * qkv), dg = activations_f32(L * qkv),
                      dbeta = activations_f32(L * H),
                      d_initial = activations_f32(carry_grad ? state_size(c) : 0);
  {
    const TimedScope timed = ctx.timed("kda.recurrence_backward");
    const bool matrices_kept = a.matrices.size() > 0;
    DeviceBuffer<float> workspace(
        static_cast<size_t>(kda_backward_workspace_floats(L, H, dh, dh, matrices_kept)),
        MemoryCategory::Workspace);
    kda_chunked_backward(a.q.data(), a.k.data(), a.vcw.data() + tail, a.g.data(), a.beta.data(), dcore.data(),
                         a.chunk_states.data(), dq.data(), dk.data(), dv.data(), dg.data(), dbeta.data(),
                         workspace.data(), L, H, dh, dh, s, carry_grad ? carry_grad->state.data() : nullptr,
                         carry_grad ? d_initial.data() : nullptr,
                         matrices_kept ? a.matrices.data() : nullptr);
  }
  if (carry_grad) copy_device(carry_grad->state.data(), d_initial.data(), state_size(c) * sizeof(float), s);

  // Every gradient that reaches dx through a weight, side by side in one [rows, ld] buffer: the q,
  // k and v windows' (rows of the conv's window), then the gate's low-rank, db and the forget
  // gate's low-rank (the chunk's rows), so that dx takes them all in one product against the
  // weights stacked alike. Each product into dx reads and writes all of the fp32 dx: six of them
  // cost about a third more than the one.
  const int64_t small = 2 * dh + H, ld = 3 * qkv + small, carried = K - 1;  // carried: the window's
  DeviceBuffer<bf16> stacked = activations(rows * ld);
  bf16* chunk_rows = stacked.data() + carried * ld;  // token 0's row
  bf16 *d_low_g = chunk_rows + 3 * qkv, *db_cols = d_low_g + dh, *d_low_f = db_cols + H;
  backward_input_into_columns(gemm, dgate.data(), bf16_data(w.g_b_proj), d_low_g, ld, L, dh, qkv, s);
  backward_weight_from_columns(gemm, d_low_g, ld, x, f32_data(grad.g_a_proj), L, D, dh, s);

  // beta = sigmoid(b_proj x); g from the forget gate's low-rank branch.
  DeviceBuffer<bf16> db = activations(L * H), df = activations(L * qkv);
  sigmoid_backward(a.beta.data(), dbeta.data(), db.data(), L * H, s);
  SPINDLE_CUDA(cudaMemcpy2DAsync(db_cols, ld * sizeof(bf16), db.data(), H * sizeof(bf16), H * sizeof(bf16), L,
                                 cudaMemcpyDeviceToDevice, s));
  gemm.linear_backward_weight(db.data(), x, f32_data(grad.b_proj), L, D, H, s);
  kda_decay_backward(decay_shape(c, L), a.f.data(), f32_data(w.dt_bias), f32_data(w.A_log), dg.data(),
                     df.data(), f32_data(grad.dt_bias), f32_data(grad.A_log), s);
  dg = {};
  backward_input_into_columns(gemm, df.data(), bf16_data(w.f_b_proj), d_low_f, ld, L, dh, qkv, s);
  gemm.linear_backward_weight(df.data(), a.f_low.data(), f32_data(grad.f_b_proj), L, dh, qkv, s);
  backward_weight_from_columns(gemm, d_low_f, ld, x, f32_data(grad.f_a_proj), L, D, dh, s);

  // l2 norms (the query scale inside), convs, projections' weights, each branch over its window:
  // the conv's outputs of the carried rows were not used (zero gradient); the rows this chunk
  // handed on also get the gradient the next chunk sent back; the carried rows' gradient goes to
  // carry_grad.
  DeviceBuffer<bf16> dconv = activations(rows * qkv);
  SPINDLE_CUDA(cudaMemsetAsync(dconv.data(), 0, tail * sizeof(bf16), s));
  struct Branch {
    const bf16* window;
    DeviceBuffer<float>& d_out;  // the recurrence's gradient of the branch's input, freed once read
    const Tensor& conv;
    Tensor& dconv_w;
    Tensor& dproj_w;
  };
  const std::array<Branch, 3> branches{Branch{a.qp.data(), dq, w.q_conv, grad.q_conv, grad.q_proj},
                                       Branch{a.kp.data(), dk, w.k_conv, grad.k_conv, grad.k_proj},
                                       Branch{a.vp.data(), dv, w.v_conv, grad.v_conv, grad.v_proj}};
  for (size_t b = 0; b < 3; ++b) {
    const Branch& br = branches[b];
    bf16* dconv_rows = dconv.data() + tail;
    if (b == 0)
      l2_normalize_backward(a.qcw.data() + tail, br.d_out.data(), dconv_rows, L * H, dh, 1e-6f,
                            1.0f / std::sqrt(static_cast<float>(dh)), s);
    else if (b == 1)
      l2_normalize_backward(a.kcw.data() + tail, br.d_out.data(), dconv_rows, L * H, dh, 1e-6f, 1.0f, s);
    else
      f32_to_bf16(br.d_out.data(), dconv_rows, L * qkv, s);
    br.d_out = {};
    bf16* dwindow = stacked.data() + b * qkv;
    causal_conv_silu_backward(br.window, f32_data(br.conv), dconv.data(), dwindow, ld, f32_data(br.dconv_w),
                              rows, qkv, K, s);
    if (carry_grad) {
      bf16* tails = carry_grad->tails.data() + b * tail;
      add_bf16_rows(tails, qkv, dwindow + L * ld, ld, carried, qkv, s);
      SPINDLE_CUDA(cudaMemcpy2DAsync(tails, qkv * sizeof(bf16), dwindow, ld * sizeof(bf16),
                                     qkv * sizeof(bf16), carried, cudaMemcpyDeviceToDevice, s));
    }
    backward_weight_from_columns(gemm, dwindow + carried * ld, ld, x, f32_data(br.dproj_w), L, D, qkv, s);
  }
  {  // the weights stacked as their gradients are (a copy: 2 ld D bytes, about 26 MB for the 4B model)
    DeviceBuffer<bf16> stacked_w(static_cast<size_t>(ld * D), MemoryCategory::Workspace);
    int64_t row = 0;
    for (const Tensor* t : {&w.q_proj, &w.k_proj, &w.v_proj, &w.g_a_proj, &w.b_proj, &w.f_a_proj}) {
      copy_device(stacked_w.data() + row * D, bf16_data(*t), t->dim(0) * D * sizeof(bf16), s);
      row += t->dim(0);
    }
    backward_input_from_columns(gemm, chunk_rows, ld, stacked_w.data(), dx, L, D, ld, s);
  }
}

}  // namespace

KdaCarry::KdaCarry(const ModelConfig& c, cudaStream_t stream)
    : state(static_cast<size_t>(state_size(c)), MemoryCategory::Activations),
      tails(static_cast<size_t>(3 * tail_size(c)), MemoryCategory::Activations) {
  SPINDLE_CUDA(cudaMemsetAsync(state.data(), 0, state.size() * sizeof(float), stream));
  SPINDLE_CUDA(cudaMemsetAsync(tails.data(), 0, tails.size() * sizeof(bf16), stream));
}

KdaCarry::KdaCarry(const KdaCarry& other, cudaStream_t stream)
    : state(other.state.size(), MemoryCategory::Activations),
      tails(other.tails.size(), MemoryCategory::Activations) {
  copy_device(state.data(), other.state.data(), state.size() * sizeof(float), stream);
  copy_device(tails.data(), other.tails.data(), tails.size() * sizeof(bf16), stream);
}

void kda_forward(Context& ctx, const ModelConfig& c, const KdaWeights& w, const bf16* x, int64_t L, bf16* y) {
  forward(ctx, c, w, x, L, y, nullptr, nullptr);
}

void kda_forward(Context& ctx, const ModelConfig& c, const KdaWeights& w, const bf16* x, int64_t L, bf16* y,
                 KdaCarry& carry, AttentionKept* keep) {
  forward(ctx, c, w, x, L, y, &carry, keep);
}

void kda_backward(Context& ctx, const ModelConfig& c, const KdaWeights& w, const bf16* x, int64_t L,
                  const bf16* dy, float* dx, KdaWeights& grad, bf16* y) {
  backward(ctx, c, w, x, L, dy, dx, grad, nullptr, nullptr, y, nullptr);
}

void kda_backward(Context& ctx, const ModelConfig& c, const KdaWeights& w, const bf16* x, int64_t L,
                  const bf16* dy, float* dx, KdaWeights& grad, const KdaCarry& carry_in, KdaCarry& carry_grad,
                  bf16* y, AttentionKept* kept) {
  backward(ctx, c, w, x, L, dy, dx, grad, &carry_in, &carry_grad, y, kept);
}

}  // namespace spindle::cuda
