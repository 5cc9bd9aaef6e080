// MLA + DSA on the GPU: the CPU module's steps (model/dsa.cpp) with bf16 activations, the k-pool
// indexer scored in query blocks, sparse attention over the selection, and the indexer's KL
// training with detached inputs.
#include <cmath>

#include "kernels/cuda/convert.h"
#include "kernels/cuda/indexer.h"
#include "kernels/cuda/indexer_training.h"
#include "kernels/cuda/norms.h"
#include "kernels/cuda/sparse_attention.h"
#include "kernels/cuda/sparse_mla.h"
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

// MLA's activations. In the absorbed form every head attends over the 512-wide
// latent c itself: the query is absorbed into it (q_lat_h = q_h W_k,h), keys and values are c
// (kv holds [c | c] per token, one key head), and the head's output is o_lat_h W_v,h^T. In the
// expanded form kv_b_proj expands c into per-head keys and values first. Same function.
struct MlaActivations {
  DeviceBuffer<bf16> q_low, q_resid, q, kv_low, kv_normed, kv, q_lat, o_lat, attended;
  DeviceBuffer<float> lse;  // absorbed form on the tensor cores: each query head's log-sum-exp
  const bf16* attention_query() const { return q_lat.size() ? q_lat.data() : q.data(); }
};

cpu::SparseAttentionShape attention_shape(const ModelConfig& c, int64_t L, bool absorbed) {
  const double scale = 1.0 / std::sqrt(static_cast<double>(c.qk_head_dim()));
  if (absorbed)
    return {L, c.num_attention_heads, c.kv_lora_rank, c.kv_lora_rank, selection_width(c), scale, 1};
  return {L, c.num_attention_heads, c.qk_head_dim(), c.v_head_dim, selection_width(c), scale};
}

// The absorbed form on the tensor cores: keys and values are the normalised latent itself.
SparseMlaShape mla_shape(const ModelConfig& c, int64_t L) {
  const cpu::SparseAttentionShape a = attention_shape(c, L, true);
  return {L, a.heads, a.qk_dim, a.v_dim, a.width, c.kv_lora_rank, static_cast<float>(a.scale)};
}

// kv_b_proj's rows for head h: W_k,h ([qk_head_dim, kv_lora_rank]) then W_v,h ([v, kv_lora_rank]).
int64_t key_rows(const ModelConfig& c, int64_t h) { return h * (c.qk_head_dim() + c.v_head_dim); }
int64_t value_rows(const ModelConfig& c, int64_t h) { return key_rows(c, h) + c.qk_head_dim(); }

// Projections up to the latent queries and keys/values (the selection is made between the two).
MlaActivations mla_projections(Context& ctx, const ModelConfig& c, const DsaWeights& w, const bf16* x,
                               int64_t L) {
  const int64_t D = c.hidden_size, H = c.num_attention_heads, dqk = c.qk_head_dim(), dv = c.v_head_dim;
  const int64_t qr = c.q_lora_rank, kr = c.kv_lora_rank;
  const float eps = static_cast<float>(c.rms_norm_eps);
  const cudaStream_t s = ctx.stream();
  MlaActivations a;
  a.q_low = activations(L * qr);
  a.q_resid = activations(L * qr);
  a.q = activations(L * H * dqk);
  a.kv_low = activations(L * kr);
  a.kv_normed = activations(L * kr);
  a.attended = activations(L * H * dv);
  ctx.gemm.linear(x, bf16_data(w.q_a_proj), a.q_low.data(), L, D, qr, s);
  rms_norm_forward(a.q_low.data(), bf16_data(w.q_a_layernorm), a.q_resid.data(), L, qr, eps, s);
  ctx.gemm.linear(a.q_resid.data(), bf16_data(w.q_b_proj), a.q.data(), L, qr, H * dqk, s);
  ctx.gemm.linear(x, bf16_data(w.kv_a_proj), a.kv_low.data(), L, D, kr, s);
  rms_norm_forward(a.kv_low.data(), bf16_data(w.kv_a_layernorm), a.kv_normed.data(), L, kr, eps, s);
  if (!ctx.absorbed_mla) {
    a.kv = activations(L * H * (dqk + dv));
    ctx.gemm.linear(a.kv_normed.data(), bf16_data(w.kv_b_proj), a.kv.data(), L, kr, H * (dqk + dv), s);
    ctx.record.note("dsa/projections", "cublaslt bf16 (expanded keys and values)");
    return a;
  }
  a.q_lat = activations(L * H * kr);
  a.o_lat = activations(L * H * kr);
  a.kv = activations(L * 2 * kr);
  const bf16* wkv = bf16_data(w.kv_b_proj);
  for (int64_t h = 0; h < H; ++h)  // q_lat_h [L, kr] = q_h [L, dqk] W_k,h [dqk, kr]
    ctx.gemm.matmul(false, false, kr, L, dqk, wkv + key_rows(c, h) * kr, kr, a.q.data() + h * dqk, H * dqk,
                    a.q_lat.data() + h * kr, CUDA_R_16BF, H * kr, 1.0f, 0.0f, s);
  for (int64_t half = 0; half < 2; ++half)
    SPINDLE_CUDA(cudaMemcpy2DAsync(a.kv.data() + half * kr, 2 * kr * sizeof(bf16), a.kv_normed.data(),
                                   kr * sizeof(bf16), kr * sizeof(bf16), static_cast<size_t>(L),
                                   cudaMemcpyDeviceToDevice, s));
  ctx.record.note("dsa/projections", "cublaslt bf16 (queries absorbed into the latent)");
  return a;
}

void attend(Context& ctx, const ModelConfig& c, const DsaWeights& w, int64_t L, MlaActivations& a,
            const int32_t* selection) {
  const cudaStream_t s = ctx.stream();
  if (!ctx.absorbed_mla) {
    sparse_attention_forward(attention_shape(c, L, false), a.q.data(), a.kv.data(), selection,
                             a.attended.data(), s);
    ctx.record.note("dsa/attention", "cuda sparse attention, expanded heads");
    return;
  }
  const int64_t H = c.num_attention_heads, kr = c.kv_lora_rank, dv = c.v_head_dim;
  const SparseMlaShape mla = mla_shape(c, L);
  const std::string unsupported = sparse_mla_unsupported(mla);
  if (unsupported.empty()) {
    a.lse = activations_f32(L * H);
    sparse_mla_forward(mla, a.q_lat.data(), a.kv_normed.data(), selection, a.o_lat.data(), a.lse.data(), s);
  } else {
    sparse_attention_forward(attention_shape(c, L, true), a.q_lat.data(), a.kv.data(), selection,
                             a.o_lat.data(), s);
  }
  const bf16* wkv = bf16_data(w.kv_b_proj);
  for (int64_t h = 0; h < H; ++h)  // attended_h [L, dv] = o_lat_h [L, kr] W_v,h^T
    ctx.gemm.matmul(true, false, dv, L, kr, wkv + value_rows(c, h) * kr, kr, a.o_lat.data() + h * kr, H * kr,
                    a.attended.data() + h * dv, CUDA_R_16BF, H * dv, 1.0f, 0.0f, s);
  if (unsupported.empty())
    ctx.record.note("dsa/attention", "sparse MLA on the tensor cores (absorbed)");
  else
    ctx.record.note("dsa/attention",
                    "cuda-core sparse attention over [c | c] (tensor cores: " + unsupported + ")", true);
}

// From the attention output's gradient to the gradient of the normalised latent c (bf16,
// written), accumulating kv_b_proj's gradient and writing dq ([L, H, qk_head_dim], bf16).
void attention_backward(Context& ctx, const ModelConfig& c, const DsaWeights& w, int64_t L, MlaActivations& a,
                        const int32_t* selection, const bf16* d_attended, bf16* dq, bf16* d_normed,
                        DsaWeights& grad) {
  const int64_t H = c.num_attention_heads, dqk = c.qk_head_dim(), dv = c.v_head_dim, kr = c.kv_lora_rank;
  const cudaStream_t s = ctx.stream();
  const bool absorbed = ctx.absorbed_mla;
  const cpu::SparseAttentionShape shape = attention_shape(c, L, absorbed);
  const bool tensor_cores = a.lse.size() != 0;  // the absorbed forward ran on the tensor cores
  // The keys' and values' gradient ([c | c] in the absorbed form), or the latent's.
  DeviceBuffer<float> dkv =
      activations_f32(tensor_cores ? L * kr : L * shape.key_heads() * (shape.qk_dim + shape.v_dim));
  SPINDLE_CUDA(cudaMemsetAsync(dkv.data(), 0, dkv.size() * sizeof(float), s));
  if (!absorbed) {
    sparse_attention_backward(shape, a.q.data(), a.kv.data(), selection, d_attended, dq, dkv.data(), s);
    DeviceBuffer<bf16>& dkv16 = a.kv;  // the keys/values are not read again
    f32_to_bf16(dkv.data(), dkv16.data(), L * H * (dqk + dv), s);
    ctx.gemm.linear_backward_input(dkv16.data(), bf16_data(w.kv_b_proj), d_normed, L, kr, H * (dqk + dv), s);
    ctx.gemm.linear_backward_weight(dkv16.data(), a.kv_normed.data(), f32_data(grad.kv_b_proj), L, kr,
                                    H * (dqk + dv), s);
    return;
  }
  const bf16* wkv = bf16_data(w.kv_b_proj);
  float* gkv = f32_data(grad.kv_b_proj);
  DeviceBuffer<bf16> d_o_lat = activations(L * H * kr), dq_lat = activations(L * H * kr);
  for (int64_t h = 0; h < H; ++h) {
    // d_o_lat_h = d_attended_h W_v,h; dW_v,h += d_attended_h^T o_lat_h.
    ctx.gemm.matmul(false, false, kr, L, dv, wkv + value_rows(c, h) * kr, kr, d_attended + h * dv, H * dv,
                    d_o_lat.data() + h * kr, CUDA_R_16BF, H * kr, 1.0f, 0.0f, s);
    ctx.gemm.matmul(false, true, kr, dv, L, a.o_lat.data() + h * kr, H * kr, d_attended + h * dv, H * dv,
                    gkv + value_rows(c, h) * kr, CUDA_R_32F, kr, 1.0f, 1.0f, s);
  }
  if (tensor_cores) {
    sparse_mla_backward(mla_shape(c, L), a.q_lat.data(), a.kv_normed.data(), selection, a.o_lat.data(),
                        a.lse.data(), d_o_lat.data(), dq_lat.data(), dkv.data(), s);
  } else {
    sparse_attention_backward(shape, a.q_lat.data(), a.kv.data(), selection, d_o_lat.data(), dq_lat.data(),
                              dkv.data(), s);
  }
  for (int64_t h = 0; h < H; ++h) {
    // dq_h = dq_lat_h W_k,h^T; dW_k,h += q_h^T dq_lat_h.
    ctx.gemm.matmul(true, false, dqk, L, kr, wkv + key_rows(c, h) * kr, kr, dq_lat.data() + h * kr, H * kr,
                    dq + h * dqk, CUDA_R_16BF, H * dqk, 1.0f, 0.0f, s);
    ctx.gemm.matmul(false, true, kr, dqk, L, dq_lat.data() + h * kr, H * kr, a.q.data() + h * dqk, H * dqk,
                    gkv + key_rows(c, h) * kr, CUDA_R_32F, kr, 1.0f, 1.0f, s);
  }
  if (tensor_cores)
    f32_to_bf16(dkv.data(), d_normed, L * kr, s);
  else
    sum_row_halves_to_bf16(dkv.data(), L, kr, d_normed, s);  // c was both the keys and the values
}

}  // namespace

void dsa_forward(Context& ctx, const ModelConfig& c, const DsaWeights& w, const bf16* x, int64_t L,
                 DeviceBuffer<int32_t>& selection, bf16* y, bool reuse_selection) {
  MlaActivations a = mla_projections(ctx, c, w, x, L);
  if (w.has_indexer && !reuse_selection) {
    const TimedScope timed = ctx.timed("dsa.indexer");
    run_indexer(ctx, c, w.indexer, x, a.q_resid.data(), L, selection);
  }
  check(selection.size() == static_cast<size_t>(L * selection_width(c)),
        "DSA layer without a selection to share");
  {
    const TimedScope timed = ctx.timed("dsa.attention");
    attend(ctx, c, w, L, a, selection.data());
  }
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
  {
    const TimedScope timed = ctx.timed("dsa.attention");
    attend(ctx, c, w, L, a, selection);
  }

  if (indexer_loss != nullptr && w.has_indexer && indexer_loss->coef > 0) {
    const TimedScope timed = ctx.timed("dsa.indexer_kl");
    const cpu::SparseAttentionShape shape = attention_shape(c, L, ctx.absorbed_mla);
    DeviceBuffer<float> mass = activations_f32(L * shape.width);
    attention_mass(shape, a.attention_query(), a.kv.data(), selection, mass.data(), s);
    train_indexer(ctx, c, w.indexer, x, a.q_resid.data(), L, selection, mass.data(), *indexer_loss,
                  grad.indexer);
  }

  DeviceBuffer<bf16> d_attended = activations(L * H * dv), dq = activations(L * H * dqk);
  gemm.linear_backward_input(dy, bf16_data(w.o_proj), d_attended.data(), L, H * dv, D, s);
  gemm.linear_backward_weight(dy, a.attended.data(), f32_data(grad.o_proj), L, H * dv, D, s);
  DeviceBuffer<bf16> d_normed = activations(L * kr), d_low = activations(L * kr);
  {
    const TimedScope timed = ctx.timed("dsa.attention_backward");
    attention_backward(ctx, c, w, L, a, selection, d_attended.data(), dq.data(), d_normed.data(), grad);
  }
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
