// Kimi Delta Attention on the GPU: the CPU module's steps (model/kda.cpp) with bf16
// activations, fp32 gates, decays and recurrent state.
#include "kernels/cuda/kda.h"

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

// x's projections come from one product, side by side in `projected` (kernel - 1 + L rows): the q,
// k and v windows, then the gate's and the forget gate's low-rank. A window holds the carried rows
// (zeros at the start of a sequence), then this chunk's; the conv runs over the whole window and the
// chunk's outputs are its rows from kernel - 1 on. The low-rank columns use the chunk's rows only.
// The weights are stacked alike in KdaWeights::in_proj, then b_proj's (beta keeps its own fp32
// product), so that the backward's one product into dx, and one into their gradients, take them.
struct KdaActivations {
  DeviceBuffer<bf16> projected, vcw, q, k, gate, core;     // vcw: v's conv output over its window
  DeviceBuffer<float> f, g, beta, chunk_states, matrices;  // matrices: kept ones, or empty
};

// Columns of a row of `projected` (and of the backward's stacked gradients; rows of the stacked
// weights): q, k, v, the gate's low-rank, the forget gate's low-rank, then b (the backward's only).
struct KdaColumns {
  int64_t qkv, dh, H;
  int64_t gate_low() const { return 3 * qkv; }
  int64_t forget_low() const { return 3 * qkv + dh; }
  int64_t projected() const { return 3 * qkv + 2 * dh; }  // the forward's product's width
  int64_t stacked() const { return projected() + H; }     // with b
};

KdaColumns kda_columns(const ModelConfig& c) {
  return {c.linear_qkv_dim(), c.linear_head_dim, c.linear_num_heads};
}

KdaDecayShape decay_shape(const ModelConfig& c, int64_t L) {
  return {L, c.linear_num_heads, c.linear_head_dim, c.linear_lower_bound.has_value(),
          static_cast<float>(c.linear_lower_bound.value_or(0.0))};
}

// Values in the carried rows of one projection's window: (kernel - 1) * qkv.
int64_t tail_size(const ModelConfig& c) { return (c.linear_conv_kernel_dim - 1) * c.linear_qkv_dim(); }

// q's l2 norm also scales it by 1 / sqrt(head_dim).
float query_scale(const ModelConfig& c) { return 1.0f / std::sqrt(static_cast<float>(c.linear_head_dim)); }

int64_t state_size(const ModelConfig& c) {
  return c.linear_num_heads * c.linear_head_dim * c.linear_head_dim;
}

void copy_device(void* to, const void* from, size_t bytes, cudaStream_t s) {
  SPINDLE_CUDA(cudaMemcpyAsync(to, from, bytes, cudaMemcpyDeviceToDevice, s));
}

// Gemm::linear, linear_backward_input and linear_backward_weight with operands in columns of wider
// row-major buffers whose rows are `ld` (x_ld, y_ld, dy_ld) values apart.
// y = x w^T (bf16 or fp32 y, [M, N]).
void linear_strided(Gemm& gemm, const bf16* x, int64_t x_ld, const bf16* w, void* y, cudaDataType_t y_type,
                    int64_t y_ld, int64_t M, int64_t K, int64_t N, cudaStream_t s) {
  gemm.matmul(true, false, N, M, K, w, K, x, x_ld, y, y_type, y_ld, 1.0f, 0.0f, s, Gemm::Rows::N);
}

// dx = dy w (bf16 dx, [M, K]).
void backward_input_into_columns(Gemm& gemm, const bf16* dy, const bf16* w, bf16* dx, int64_t ld, int64_t M,
                                 int64_t K, int64_t N, cudaStream_t s) {
  gemm.matmul(false, false, K, M, N, w, K, dy, N, dx, CUDA_R_16BF, ld, 1.0f, 0.0f, s, Gemm::Rows::N);
}

// dx = dy w (fp32 dx, [M, K], its rows K apart).
void backward_input_from_columns(Gemm& gemm, const bf16* dy, int64_t ld, const bf16* w, float* dx, int64_t M,
                                 int64_t K, int64_t N, cudaStream_t s) {
  gemm.matmul(false, false, K, M, N, w, K, dy, ld, dx, CUDA_R_32F, K, 1.0f, 0.0f, s, Gemm::Rows::N);
}

// dw += dy^T x (fp32 dw, [N, K]).
void backward_weight_strided(Gemm& gemm, const bf16* dy, int64_t dy_ld, const bf16* x, int64_t x_ld,
                             float* dw, int64_t M, int64_t K, int64_t N, cudaStream_t s) {
  gemm.matmul(false, true, K, N, M, x, x_ld, dy, dy_ld, dw, CUDA_R_32F, K, 1.0f, 1.0f, s, Gemm::Rows::K);
}

// The forward's intermediates from x and the carry the chunk starts from (null: the start of a
// sequence); the recurrence's output, chunk states and matrices, and the projections, taken from
// `kept` where it holds them. keep_matrices: the recurrence also writes its intra-chunk matrices into
// `matrices`. Without `output`, the chunk states alone (no recurrence output, no output gate).
KdaActivations kda_activations(Context& ctx, const ModelConfig& c, const KdaWeights& w, const bf16* x,
                               int64_t L, const KdaCarry* carry, AttentionKept* kept = nullptr,
                               bool keep_matrices = false, bool output = true) {
  const int64_t D = c.hidden_size, H = c.linear_num_heads, dh = c.linear_head_dim, qkv = c.linear_qkv_dim();
  const int64_t K = c.linear_conv_kernel_dim, tail = tail_size(c), rows = K - 1 + L, carried = K - 1;
  const KdaColumns cols = kda_columns(c);
  const int64_t ld = cols.projected();
  check(dh <= kKdaMaxDim, "KDA head_dim ", dh, " exceeds the CUDA kernel's limit ", kKdaMaxDim);
  const cudaStream_t s = ctx.stream();
  const bool recurrence_kept = kept != nullptr && !kept->empty();
  KdaActivations a;
  // x's projections, kept from the forward (its carried rows too: the same carry) or made here.
  const bool projections_kept = recurrence_kept && kept->projected.size() > 0;
  if (projections_kept) {
    check(kept->projected.size() == static_cast<size_t>(rows * ld), "KDA backward: kept projections of ",
          kept->projected.size(), " values for ", rows, " rows of ", ld);
    a.projected = std::move(kept->projected);
  } else {
    a.projected = activations(rows * ld);
  }
  a.vcw = activations(rows * qkv);
  for (auto* b : {&a.q, &a.k}) *b = activations(L * qkv);
  if (output) a.gate = activations(L * qkv);
  if (recurrence_kept) {
    check(kept->out.size() == static_cast<size_t>(L * qkv), "KDA backward: a kept output of ",
          kept->out.size(), " values for ", L, " tokens");
    a.core = std::move(kept->out);
  } else if (output) {
    a.core = activations(L * qkv);
  }
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

  // The carried rows: the windows' columns from the carry (the low-rank columns' carried rows stay
  // unused).
  bf16* chunk_rows = a.projected.data() + carried * ld;  // token 0's row
  const bf16 *gate_low = chunk_rows + cols.gate_low(), *f_low = chunk_rows + cols.forget_low();
  if (!projections_kept) {
    if (carry != nullptr)
      SPINDLE_CUDA(cudaMemcpy2DAsync(a.projected.data(), ld * sizeof(bf16), carry->tails.data(),
                                     3 * qkv * sizeof(bf16), 3 * qkv * sizeof(bf16), carried,
                                     cudaMemcpyDeviceToDevice, s));
    else
      SPINDLE_CUDA(cudaMemsetAsync(a.projected.data(), 0, carried * ld * sizeof(bf16), s));
    linear_strided(ctx.gemm, x, D, bf16_data(w.in_proj), chunk_rows, CUDA_R_16BF, ld, L, D, ld, s);
  }
  // q and k are l2-normalised per head (q's scale inside) in their conv's pass, the chunk's rows; the
  // convs' outputs themselves are not stored (the backward forms their gradient in its conv's pass).
  const bool q_fused = causal_conv_silu_l2(a.projected.data(), ld, f32_data(w.q_conv), a.q.data(), carried,
                                           rows, qkv, K, dh, 1e-6f, query_scale(c), s);
  const bool k_fused = causal_conv_silu_l2(a.projected.data() + qkv, ld, f32_data(w.k_conv), a.k.data(),
                                           carried, rows, qkv, K, dh, 1e-6f, 1.0f, s);
  causal_conv_silu(a.projected.data() + 2 * qkv, ld, f32_data(w.v_conv), a.vcw.data(), rows, qkv, K, s);

  linear_strided(ctx.gemm, f_low, ld, bf16_data(w.f_b_proj), a.f.data(), CUDA_R_32F, qkv, L, dh, qkv, s);
  kda_decay_forward(decay_shape(c, L), a.f.data(), f32_data(w.dt_bias), f32_data(w.A_log), a.g.data(), s);
  ctx.gemm.linear(x, bf16_data(w.b_proj), a.beta.data(), L, D, H, s);
  sigmoid_forward(a.beta.data(), a.beta.data(), L * H, s);

  if (!recurrence_kept) {
    const TimedScope timed = ctx.timed("kda.recurrence");
    DeviceBuffer<float> workspace(static_cast<size_t>(kda_forward_workspace_floats(L, H)),
                                  MemoryCategory::Workspace);
    kda_chunked_forward(a.q.data(), a.k.data(), a.vcw.data() + tail, a.g.data(), a.beta.data(),
                        output ? a.core.data() : nullptr, a.chunk_states.data(), workspace.data(), L, H, dh,
                        dh, s, carry != nullptr ? carry->state.data() : nullptr,
                        keep_matrices ? a.matrices.data() : nullptr);
  }
  if (output)
    linear_strided(ctx.gemm, gate_low, ld, bf16_data(w.g_b_proj), a.gate.data(), CUDA_R_16BF, qkv, L, dh, qkv,
                   s);
  ctx.record.note("kda/projections", "cublaslt bf16");
  ctx.record.note("kda/conv",
                  q_fused && k_fused ? "cuda causal_conv_silu, q and k with their l2 norms"
                                     : "cuda causal_conv_silu, then q's and k's l2 norms (two passes)",
                  !(q_fused && k_fused));
  ctx.record.note("kda/recurrence", "cuda chunked (C=64, fp32 state)");
  return a;
}

void forward(Context& ctx, const ModelConfig& c, const KdaWeights& w, const bf16* x, int64_t L, bf16* y,
             KdaCarry* carry, AttentionKept* keep) {
  const int64_t D = c.hidden_size, H = c.linear_num_heads, dh = c.linear_head_dim, qkv = c.linear_qkv_dim();
  const cudaStream_t s = ctx.stream();
  check(y != nullptr || (carry != nullptr && keep == nullptr),
        "KDA forward without an output: the carry alone");
  KdaActivations a =
      kda_activations(ctx, c, w, x, L, carry, nullptr, keep != nullptr && keep->keep_matrices, y != nullptr);
  if (carry != nullptr) {  // the final state and the windows' last kernel - 1 rows move on
    const int64_t ld = kda_columns(c).projected();
    copy_device(carry->state.data(), a.chunk_states.data() + kda_chunks(L) * state_size(c),
                state_size(c) * sizeof(float), s);
    SPINDLE_CUDA(cudaMemcpy2DAsync(carry->tails.data(), 3 * qkv * sizeof(bf16), a.projected.data() + L * ld,
                                   ld * sizeof(bf16), 3 * qkv * sizeof(bf16), c.linear_conv_kernel_dim - 1,
                                   cudaMemcpyDeviceToDevice, s));
  }
  if (y == nullptr) return;
  // The gated norm's output reuses q (free once the recurrence has read it).
  gated_rms_norm_forward(a.core.data(), bf16_data(w.o_norm), a.gate.data(), a.q.data(), L * H, dh,
                         static_cast<float>(c.rms_norm_eps), s);
  ctx.gemm.linear(a.q.data(), bf16_data(w.o_proj), y, L, qkv, D, s);
  if (keep != nullptr) {
    keep->out = std::move(a.core);
    keep->stats = std::move(a.chunk_states);
    keep->matrices = std::move(a.matrices);
    if (keep->keep_projections) keep->projected = std::move(a.projected);
  }
}

void backward(Context& ctx, const ModelConfig& c, const KdaWeights& w, const bf16* x, int64_t L,
              const bf16* dy, float* dx, KdaWeights& grad, const KdaCarry* carry_in, KdaCarry* carry_grad,
              bf16* y, AttentionKept* kept) {
  const int64_t D = c.hidden_size, H = c.linear_num_heads, dh = c.linear_head_dim, qkv = c.linear_qkv_dim();
  const int64_t K = c.linear_conv_kernel_dim, tail = tail_size(c), rows = K - 1 + L, carried = K - 1;
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
  const KdaColumns cols = kda_columns(c);
  const bf16* projected_rows = a.projected.data() + carried * cols.projected();  // token 0's row
  backward_weight_strided(gemm, dgate.data(), qkv, projected_rows + cols.gate_low(), cols.projected(),
                          f32_data(grad.g_b_proj), L, dh, qkv, s);

  // The delta rule; with a carry, from the state gradient the next chunk handed back to the one
  // this chunk's initial state receives.
  DeviceBuffer<bf16> dq = activations(L * qkv), dk = activations(L * qkv);
  DeviceBuffer<float> dg = activations_f32(L * qkv), dbeta = activations_f32(L * H),
                      d_initial = activations_f32(carry_grad ? state_size(c) : 0);
  // dv in bf16 as v's conv window takes it: the carried rows (zero gradient), then the chunk's.
  DeviceBuffer<bf16> dv_window = activations(rows * qkv);
  SPINDLE_CUDA(cudaMemsetAsync(dv_window.data(), 0, tail * sizeof(bf16), s));
  {
    const TimedScope timed = ctx.timed("kda.recurrence_backward");
    const bool matrices_kept = a.matrices.size() > 0;
    DeviceBuffer<float> workspace(
        static_cast<size_t>(kda_backward_workspace_floats(L, H, dh, dh, matrices_kept)),
        MemoryCategory::Workspace);
    kda_chunked_backward(
        a.q.data(), a.k.data(), a.vcw.data() + tail, a.g.data(), a.beta.data(), dcore.data(),
        a.chunk_states.data(), dq.data(), dk.data(), dv_window.data() + tail, dg.data(), dbeta.data(),
        workspace.data(), L, H, dh, dh, s, carry_grad ? carry_grad->state.data() : nullptr,
        carry_grad ? d_initial.data() : nullptr, matrices_kept ? a.matrices.data() : nullptr);
  }
  if (carry_grad) copy_device(carry_grad->state.data(), d_initial.data(), state_size(c) * sizeof(float), s);

  // Every gradient that reaches dx through a weight, side by side in one [rows, ld] buffer: the q,
  // k and v windows' (rows of the conv's window), then the gate's and the forget gate's low-rank and
  // db (the chunk's rows), so that dx takes them all in one product against the stacked weights
  // (kda_columns' order, KdaWeights::in_proj), which writes dx, and their weights' gradients come
  // from one product into in_proj's. Each product adding into dx would read and write all of the
  // fp32 dx: six of them cost about a third more than the one.
  const int64_t ld = cols.stacked();
  DeviceBuffer<bf16> stacked = activations(rows * ld);
  bf16* chunk_rows = stacked.data() + carried * ld;  // token 0's row
  bf16 *d_low_g = chunk_rows + cols.gate_low(), *d_low_f = chunk_rows + cols.forget_low(),
       *db_cols = chunk_rows + cols.projected();
  backward_input_into_columns(gemm, dgate.data(), bf16_data(w.g_b_proj), d_low_g, ld, L, dh, qkv, s);

  // beta = sigmoid(b_proj x); g from the forget gate's low-rank branch.
  DeviceBuffer<bf16> db = activations(L * H), df = activations(L * qkv);
  sigmoid_backward(a.beta.data(), dbeta.data(), db.data(), L * H, s);
  SPINDLE_CUDA(cudaMemcpy2DAsync(db_cols, ld * sizeof(bf16), db.data(), H * sizeof(bf16), H * sizeof(bf16), L,
                                 cudaMemcpyDeviceToDevice, s));
  kda_decay_backward(decay_shape(c, L), a.f.data(), f32_data(w.dt_bias), f32_data(w.A_log), dg.data(),
                     df.data(), f32_data(grad.dt_bias), f32_data(grad.A_log), s);
  dg = {};
  backward_input_into_columns(gemm, df.data(), bf16_data(w.f_b_proj), d_low_f, ld, L, dh, qkv, s);
  backward_weight_strided(gemm, df.data(), qkv, projected_rows + cols.forget_low(), cols.projected(),
                          f32_data(grad.f_b_proj), L, dh, qkv, s);

  // Convs, each branch over its window, q's and k's through their l2 norms (the query scale inside):
  // the conv's outputs of the carried rows were not used (zero gradient); the rows this chunk handed
  // on also get the gradient the next chunk sent back; the carried rows' gradient goes to carry_grad.
  bool fused = true;
  for (int64_t b = 0; b < 3; ++b) {
    const bf16* window = a.projected.data() + b * qkv;
    bf16* dwindow = stacked.data() + b * qkv;
    const Tensor& conv = b == 0 ? w.q_conv : b == 1 ? w.k_conv : w.v_conv;
    Tensor& conv_grad = b == 0 ? grad.q_conv : b == 1 ? grad.k_conv : grad.v_conv;
    if (b < 2) {
      DeviceBuffer<bf16>& d_normed = b == 0 ? dq : dk;  // the recurrence's gradient, freed once read
      fused = causal_conv_silu_l2_backward(window, cols.projected(), f32_data(conv), d_normed.data(), carried,
                                           dwindow, ld, f32_data(conv_grad), rows, qkv, K, dh, 1e-6f,
                                           b == 0 ? query_scale(c) : 1.0f, s) &&
              fused;
      d_normed = {};
    } else {
      causal_conv_silu_backward(window, cols.projected(), f32_data(conv), dv_window.data(), dwindow, ld,
                                f32_data(conv_grad), rows, qkv, K, s);
    }
    if (carry_grad) {  // the tails: [kernel - 1, 3 qkv], the branch's columns
      bf16* tails = carry_grad->tails.data() + b * qkv;
      add_bf16_rows(tails, 3 * qkv, dwindow + L * ld, ld, carried, qkv, s);
      SPINDLE_CUDA(cudaMemcpy2DAsync(tails, 3 * qkv * sizeof(bf16), dwindow, ld * sizeof(bf16),
                                     qkv * sizeof(bf16), carried, cudaMemcpyDeviceToDevice, s));
    }
  }
  ctx.record.note("kda/conv_backward",
                  fused ? "cuda causal_conv_silu_backward, q and k through their l2 norms"
                        : "cuda causal_conv_silu_backward after q's and k's l2 norm backward (more passes)",
                  !fused);
  dv_window = {};
  backward_input_from_columns(gemm, chunk_rows, ld, bf16_data(w.in_proj), dx, L, D, ld, s);
  backward_weight_strided(gemm, chunk_rows, ld, x, D, f32_data(grad.in_proj), L, D, ld, s);
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
