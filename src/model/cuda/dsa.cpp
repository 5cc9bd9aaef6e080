// MLA + DSA on the GPU: the CPU module's steps (model/dsa.cpp) with bf16 activations, the k-pool
// indexer scored in query blocks, sparse attention over the selection, and the indexer's KL
// training with detached inputs.
#include <cmath>

#include "kernels/cuda/convert.h"
#include "kernels/cuda/indexer.h"
#include "kernels/cuda/indexer_training.h"
#include "kernels/cuda/norms.h"
#include "kernels/cuda/sparse_attention.h"
#include "model/cuda/device_weights.h"
#include "model/cuda/modules.h"

namespace spindle::cuda {

namespace {

constexpr float kIndexerNormEps = 1e-6f;
constexpr size_t kSelectWorkspaceBytes = size_t{1} << 30;  // the score tile of a query block

cpu::IndexerShape indexer_shape(const ModelConfig& c, int64_t L) {
  return {
      L, c.index_n_heads, c.index_head_dim, c.index_kpool, c.index_topk, c.index_kpool_always_select_tail};
}

int64_t selection_width(const ModelConfig& c) { return indexer_shape(c, 0).width(); }

// The indexer's inputs: per-head queries, normalised keys (and their input), the pool gate,
// pooled keys and the head weights (already scaled by heads^-0.5).
struct IndexerActivations {
  DeviceBuffer<bf16> q, raw, keys, gate, pool_keys, head_weights;
};

IndexerActivations indexer_activations(Context& ctx, const ModelConfig& c, const IndexerWeights& w,
                                       const bf16* x, const bf16* q_resid, int64_t L) {
  const int64_t D = c.hidden_size, Hi = c.index_n_heads, d = c.index_head_dim;
  const cpu::IndexerShape shape = indexer_shape(c, L);
  const cudaStream_t s = ctx.stream();
  IndexerActivations a{activations(L * Hi * d),
                       activations(L * d),
                       activations(L * d),
                       activations(L * d),
                       activations(std::max<int64_t>(1, shape.complete_pools() * d)),
                       activations(L * Hi)};
  ctx.gemm.linear(q_resid, bf16_data(w.wq_b), a.q.data(), L, c.q_lora_rank, Hi * d, s);
  ctx.gemm.linear(x, bf16_data(w.wk), a.raw.data(), L, D, d, s);
  layer_norm_forward(a.raw.data(), bf16_data(w.k_norm_weight), bf16_data(w.k_norm_bias), a.keys.data(), L, d,
                     kIndexerNormEps, s);
  ctx.gemm.linear(x, bf16_data(w.compress_gate), a.gate.data(), L, D, d, s);
  indexer_pool_keys(shape, a.keys.data(), a.gate.data(), bf16_data(w.compress_ape), a.pool_keys.data(), s);
  ctx.gemm.linear(x, bf16_data(w.weights_proj), a.head_weights.data(), L, D, Hi, s,
                  1.0f / std::sqrt(static_cast<float>(Hi)));
  return a;
}

void run_indexer(Context& ctx, const ModelConfig& c, const IndexerWeights& w, const bf16* x,
                 const bf16* q_resid, int64_t L, DeviceBuffer<int32_t>& selection) {
  const cpu::IndexerShape shape = indexer_shape(c, L);
  IndexerActivations a = indexer_activations(ctx, c, w, x, q_resid, L);
  const size_t row_bytes = indexer_select_workspace_bytes(shape, 1);
  const size_t bytes =
      std::max(row_bytes, std::min(kSelectWorkspaceBytes, row_bytes * static_cast<size_t>(L)));
  DeviceBuffer<float> workspace((bytes + 3) / 4, MemoryCategory::Workspace);
  if (selection.size() != static_cast<size_t>(L * shape.width()))
    selection = DeviceBuffer<int32_t>(static_cast<size_t>(L * shape.width()), MemoryCategory::Activations);
  indexer_select(shape, a.q.data(), a.pool_keys.data(), a.head_weights.data(), selection.data(),
                 workspace.data(), workspace.size() * 4, ctx.stream());
  ctx.record.note("dsa/indexer", "cuda k-pool radix select in query blocks");
}

// KL(attention || indexer) on the indexer's own selection; gradients reach the indexer only.
void train_indexer(Context& ctx, const ModelConfig& c, const IndexerWeights& w, const bf16* x,
                   const bf16* q_resid, int64_t L, const int32_t* selection, const float* mass,
                   IndexerLoss& loss, IndexerWeights& grad) {
  const int64_t D = c.hidden_size, Hi = c.index_n_heads, d = c.index_head_dim;
  const cpu::IndexerShape shape = indexer_shape(c, L);
  const cudaStream_t s = ctx.stream();
  IndexerActivations a = indexer_activations(ctx, c, w, x, q_resid, L);
  DeviceBuffer<bf16> dq = activations(L * Hi * d), dhw = activations(L * Hi);
  DeviceBuffer<float> dpool = activations_f32(std::max<int64_t>(1, shape.complete_pools() * d));
  SPINDLE_CUDA(cudaMemsetAsync(dpool.data(), 0, dpool.size() * sizeof(float), s));
  indexer_kl_backward(shape, a.q.data(), a.pool_keys.data(), a.head_weights.data(), selection, mass,
                      static_cast<float>(loss.coef / static_cast<double>(L)), dq.data(), dpool.data(),
                      dhw.data(), loss.kl->data(), s);
  loss.layers += 1;
  ctx.gemm.linear_backward_weight(dhw.data(), x, f32_data(grad.weights_proj), L, D, Hi, s,
                                  1.0f / std::sqrt(static_cast<float>(Hi)));
  ctx.gemm.linear_backward_weight(dq.data(), q_resid, f32_data(grad.wq_b), L, c.q_lora_rank, Hi * d, s);
  DeviceBuffer<bf16>& dkeys = a.q;  // the queries' buffer is larger than [L, d] and free now
  DeviceBuffer<bf16> dgate = activations(L * d), draw = activations(L * d);
  indexer_pool_keys_backward(shape, a.keys.data(), a.gate.data(), bf16_data(w.compress_ape), dpool.data(),
                             dkeys.data(), dgate.data(), f32_data(grad.compress_ape), s);
  ctx.gemm.linear_backward_weight(dgate.data(), x, f32_data(grad.compress_gate), L, D, d, s);
  layer_norm_backward(a.raw.data(), bf16_data(w.k_norm_weight), dkeys.data(), draw.data(),
                      f32_data(grad.k_norm_weight), f32_data(grad.k_norm_bias), L, d, kIndexerNormEps, s);
  ctx.gemm.linear_backward_weight(draw.data(), x, f32_data(grad.wk), L, D, d, s);
  ctx.record.note("dsa/indexer_kl", "cuda attention mass + KL backward");
}

struct MlaActivations {
  DeviceBuffer<bf16> q_low, q_resid, q, kv_low, kv_normed, kv, attended;
};

cpu::SparseAttentionShape attention_shape(const ModelConfig& c, int64_t L) {
  return {L,
          c.num_attention_heads,
          c.qk_head_dim(),
          c.v_head_dim,
          selection_width(c),
          1.0 / std::sqrt(static_cast<double>(c.qk_head_dim()))};
}

// Projections up to the latent queries and keys/values (the selection is made between the two).
MlaActivations mla_projections(Context& ctx, const ModelConfig& c, const DsaWeights& w, const bf16* x,
                               int64_t L) {
  const int64_t D = c.hidden_size, H = c.num_attention_heads, dqk = c.qk_head_dim(), dv = c.v_head_dim;
  const int64_t qr = c.q_lora_rank, kr = c.kv_lora_rank;
  const float eps = static_cast<float>(c.rms_norm_eps);
  const cudaStream_t s = ctx.stream();
  MlaActivations a{activations(L * qr),    activations(L * qr), activations(L * H * dqk),
                   activations(L * kr),    activations(L * kr), activations(L * H * (dqk + dv)),
                   activations(L * H * dv)};
  ctx.gemm.linear(x, bf16_data(w.q_a_proj), a.q_low.data(), L, D, qr, s);
  rms_norm_forward(a.q_low.data(), bf16_data(w.q_a_layernorm), a.q_resid.data(), L, qr, eps, s);
  ctx.gemm.linear(a.q_resid.data(), bf16_data(w.q_b_proj), a.q.data(), L, qr, H * dqk, s);
  ctx.gemm.linear(x, bf16_data(w.kv_a_proj), a.kv_low.data(), L, D, kr, s);
  rms_norm_forward(a.kv_low.data(), bf16_data(w.kv_a_layernorm), a.kv_normed.data(), L, kr, eps, s);
  ctx.gemm.linear(a.kv_normed.data(), bf16_data(w.kv_b_proj), a.kv.data(), L, kr, H * (dqk + dv), s);
  ctx.record.note("dsa/projections", "cublaslt bf16");
  return a;
}

void attend(Context& ctx, const ModelConfig& c, int64_t L, MlaActivations& a, const int32_t* selection) {
  sparse_attention_forward(attention_shape(c, L), a.q.data(), a.kv.data(), selection, a.attended.data(),
                           ctx.stream());
  ctx.record.note("dsa/attention", "cuda sparse attention (expanded heads, online softmax)");
}

}  // namespace

void dsa_forward(Context& ctx, const ModelConfig& c, const DsaWeights& w, const bf16* x, int64_t L,
                 DeviceBuffer<int32_t>& selection, bf16* y, bool reuse_selection) {
  MlaActivations a = mla_projections(ctx, c, w, x, L);
  if (w.has_indexer && !reuse_selection) run_indexer(ctx, c, w.indexer, x, a.q_resid.data(), L, selection);
  check(selection.size() == static_cast<size_t>(L * selection_width(c)),
        "DSA layer without a selection to share");
  attend(ctx, c, L, a, selection.data());
  ctx.gemm.linear(a.attended.data(), bf16_data(w.o_proj), y, L, c.num_attention_heads * c.v_head_dim,
                  c.hidden_size, ctx.stream());
}

void dsa_backward(Context& ctx, const ModelConfig& c, const DsaWeights& w, const bf16* x, int64_t L,
                  const int32_t* selection, const bf16* dy, float* dx, DsaWeights& grad,
                  IndexerLoss* indexer_loss) {
  const int64_t D = c.hidden_size, H = c.num_attention_heads, dqk = c.qk_head_dim(), dv = c.v_head_dim;
  const int64_t qr = c.q_lora_rank, kr = c.kv_lora_rank;
  const float eps = static_cast<float>(c.rms_norm_eps);
  const cudaStream_t s = ctx.stream();
  Gemm& gemm = ctx.gemm;
  MlaActivations a = mla_projections(ctx, c, w, x, L);
  attend(ctx, c, L, a, selection);
  const cpu::SparseAttentionShape shape = attention_shape(c, L);

  if (indexer_loss != nullptr && w.has_indexer && indexer_loss->coef > 0) {
    DeviceBuffer<float> mass = activations_f32(L * shape.width);
    attention_mass(shape, a.q.data(), a.kv.data(), selection, mass.data(), s);
    train_indexer(ctx, c, w.indexer, x, a.q_resid.data(), L, selection, mass.data(), *indexer_loss,
                  grad.indexer);
  }

  DeviceBuffer<bf16> d_attended = activations(L * H * dv), dq = activations(L * H * dqk);
  DeviceBuffer<float> dkv = activations_f32(L * H * (dqk + dv));
  gemm.linear_backward_input(dy, bf16_data(w.o_proj), d_attended.data(), L, H * dv, D, s);
  gemm.linear_backward_weight(dy, a.attended.data(), f32_data(grad.o_proj), L, H * dv, D, s);
  SPINDLE_CUDA(cudaMemsetAsync(dkv.data(), 0, dkv.size() * sizeof(float), s));
  sparse_attention_backward(shape, a.q.data(), a.kv.data(), selection, d_attended.data(), dq.data(),
                            dkv.data(), s);

  DeviceBuffer<bf16>& dkv16 = a.kv;  // the keys/values are not read again
  f32_to_bf16(dkv.data(), dkv16.data(), L * H * (dqk + dv), s);
  DeviceBuffer<bf16> d_normed = activations(L * kr), d_low = activations(L * kr);
  gemm.linear_backward_input(dkv16.data(), bf16_data(w.kv_b_proj), d_normed.data(), L, kr, H * (dqk + dv), s);
  gemm.linear_backward_weight(dkv16.data(), a.kv_normed.data(), f32_data(grad.kv_b_proj), L, kr,
                              H * (dqk + dv), s);
  rms_norm_backward(a.kv_low.data(), bf16_data(w.kv_a_layernorm), d_normed.data(), d_low.data(),
                    f32_data(grad.kv_a_layernorm), L, kr, eps, s);
  gemm.linear_backward_input(d_low.data(), bf16_data(w.kv_a_proj), dx, L, D, kr, 1.0f, s);
  gemm.linear_backward_weight(d_low.data(), x, f32_data(grad.kv_a_proj), L, D, kr, s);

  DeviceBuffer<bf16> d_resid = activations(L * qr), dq_low = activations(L * qr);
  gemm.linear_backward_input(dq.data(), bf16_data(w.q_b_proj), d_resid.data(), L, qr, H * dqk, s);
  gemm.linear_backward_weight(dq.data(), a.q_resid.data(), f32_data(grad.q_b_proj), L, qr, H * dqk, s);
  rms_norm_backward(a.q_low.data(), bf16_data(w.q_a_layernorm), d_resid.data(), dq_low.data(),
                    f32_data(grad.q_a_layernorm), L, qr, eps, s);
  gemm.linear_backward_input(dq_low.data(), bf16_data(w.q_a_proj), dx, L, D, qr, 1.0f, s);
  gemm.linear_backward_weight(dq_low.data(), x, f32_data(grad.q_a_proj), L, D, qr, s);
}

}  // namespace spindle::cuda
