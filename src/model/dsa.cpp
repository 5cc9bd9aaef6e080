#include "kernels/cpu/dsa.h"

#include <cmath>

#include "kernels/cpu/linear.h"
#include "kernels/cpu/norms.h"
#include "model/modules.h"

namespace spindle {

namespace {

// The indexer over a chunk of L queries that continues `carry`: this chunk's keys and gates join
// the carried ones, the complete pools of everything so far are pooled, and each query selects
// among the pools it can see.
template <class T>
void run_indexer(const ModelConfig& c, const IndexerWeights& w, const T* x, const T* q_resid, int64_t L,
                 DsaCarry<T>& carry, std::vector<int32_t>& selection) {
  using namespace cpu;
  const int64_t D = c.hidden_size, Hi = c.index_n_heads, d = c.index_head_dim;
  const int64_t total = carry.tokens + L;
  const IndexerShape shape{total,       Hi, d, c.index_kpool, c.index_topk, c.index_kpool_always_select_tail,
                           carry.tokens};
  std::vector<T> q(static_cast<size_t>(L * Hi * d)), raw(static_cast<size_t>(L * d));
  linear(q_resid, w.wq_b.data<T>(), q.data(), L, c.q_lora_rank, Hi * d);
  linear(x, w.wk.data<T>(), raw.data(), L, D, d);
  carry.index_keys.resize(static_cast<size_t>(total * d));
  carry.index_gate.resize(static_cast<size_t>(total * d));
  layer_norm(raw.data(), w.k_norm_weight.data<T>(), w.k_norm_bias.data<T>(),
             carry.index_keys.data() + carry.tokens * d, L, d, 1e-6);
  linear(x, w.compress_gate.data<T>(), carry.index_gate.data() + carry.tokens * d, L, D, d);
  std::vector<T> pool_keys(static_cast<size_t>(shape.complete_pools() * d));
  indexer_pool_keys(shape, carry.index_keys.data(), carry.index_gate.data(), w.compress_ape.data<T>(),
                    pool_keys.data());
  std::vector<T> head_weights(static_cast<size_t>(L * Hi));
  linear(x, w.weights_proj.data<T>(), head_weights.data(), L, D, Hi);
  const T head_scale = T(1) / std::sqrt(T(Hi));
  for (T& hw : head_weights) hw *= head_scale;
  selection.assign(static_cast<size_t>(L * shape.width()), -1);
  indexer_select(shape, q.data(), pool_keys.data(), head_weights.data(), selection.data());
}

// The indexer learns from KL(attention || indexer) on its own selection; its inputs are
// detached, so nothing flows back into the model from here.
template <class T>
void train_indexer(const ModelConfig& c, const IndexerWeights& w, const T* x, const T* q_resid, int64_t L,
                   const std::vector<int32_t>& selection, const T* mass, IndexerLoss& loss,
                   IndexerWeights& grad) {
  using namespace cpu;
  const int64_t D = c.hidden_size, Hi = c.index_n_heads, d = c.index_head_dim;
  const IndexerShape shape{L, Hi, d, c.index_kpool, c.index_topk, c.index_kpool_always_select_tail};
  auto buffer = [](int64_t n) { return std::vector<T>(static_cast<size_t>(n), T(0)); };
  std::vector<T> q = buffer(L * Hi * d), raw = buffer(L * d), keys = buffer(L * d), gate = buffer(L * d);
  linear(q_resid, w.wq_b.data<T>(), q.data(), L, c.q_lora_rank, Hi * d);
  linear(x, w.wk.data<T>(), raw.data(), L, D, d);
  layer_norm(raw.data(), w.k_norm_weight.data<T>(), w.k_norm_bias.data<T>(), keys.data(), L, d, 1e-6);
  linear(x, w.compress_gate.data<T>(), gate.data(), L, D, d);
  std::vector<T> pool_keys = buffer(shape.complete_pools() * d), head_weights = buffer(L * Hi);
  indexer_pool_keys(shape, keys.data(), gate.data(), w.compress_ape.data<T>(), pool_keys.data());
  linear(x, w.weights_proj.data<T>(), head_weights.data(), L, D, Hi);
  const T head_scale = T(1) / std::sqrt(T(Hi));
  for (T& hw : head_weights) hw *= head_scale;

  std::vector<T> dq = buffer(L * Hi * d), dpool = buffer(shape.complete_pools() * d), dhw = buffer(L * Hi);
  const double kl =
      indexer_kl_backward(shape, q.data(), pool_keys.data(), head_weights.data(), selection.data(), mass,
                          loss.coef / static_cast<double>(L), dq.data(), dpool.data(), dhw.data());
  loss.kl_sum += kl / static_cast<double>(L);
  loss.layers += 1;

  for (T& g : dhw) g *= head_scale;
  linear_backward<T>(x, w.weights_proj.data<T>(), dhw.data(), nullptr, grad.weights_proj.data<T>(), L, D, Hi);
  linear_backward<T>(q_resid, w.wq_b.data<T>(), dq.data(), nullptr, grad.wq_b.data<T>(), L, c.q_lora_rank,
                     Hi * d);
  std::vector<T> dkeys = buffer(L * d), dgate = buffer(L * d), draw = buffer(L * d);
  indexer_pool_keys_backward(shape, keys.data(), gate.data(), w.compress_ape.data<T>(), dpool.data(),
                             dkeys.data(), dgate.data(), grad.compress_ape.data<T>());
  linear_backward<T>(x, w.compress_gate.data<T>(), dgate.data(), nullptr, grad.compress_gate.data<T>(), L, D,
                     d);
  layer_norm_backward(raw.data(), w.k_norm_weight.data<T>(), dkeys.data(), draw.data(),
                      grad.k_norm_weight.data<T>(), grad.k_norm_bias.data<T>(), L, d, 1e-6);
  linear_backward<T>(x, w.wk.data<T>(), draw.data(), nullptr, grad.wk.data<T>(), L, D, d);
}

}  // namespace

template <class T>
void dsa_forward(const ModelConfig& c, const DsaWeights& w, const T* x, int64_t L,
                 std::vector<int32_t>& selection, T* y) {
  DsaCarry<T> carry;
  dsa_forward(c, w, x, L, selection, y, carry);
}

template <class T>
void dsa_forward(const ModelConfig& c, const DsaWeights& w, const T* x, int64_t L,
                 std::vector<int32_t>& selection, T* y, DsaCarry<T>& carry) {
  using namespace cpu;
  const int64_t D = c.hidden_size, H = c.num_attention_heads, dqk = c.qk_head_dim(), dv = c.v_head_dim;
  const int64_t qr = c.q_lora_rank, kr = c.kv_lora_rank, row = H * (dqk + dv);

  std::vector<T> q_low(static_cast<size_t>(L * qr)), q_resid(static_cast<size_t>(L * qr));
  linear(x, w.q_a_proj.data<T>(), q_low.data(), L, D, qr);
  rms_norm(q_low.data(), w.q_a_layernorm.data<T>(), q_resid.data(), L, qr, c.rms_norm_eps);
  std::vector<T> q(static_cast<size_t>(L * H * dqk));
  linear(q_resid.data(), w.q_b_proj.data<T>(), q.data(), L, qr, H * dqk);

  // This chunk's keys and values join the earlier tokens'.
  std::vector<T> kv_low(static_cast<size_t>(L * kr)), kv_normed(static_cast<size_t>(L * kr));
  linear(x, w.kv_a_proj.data<T>(), kv_low.data(), L, D, kr);
  rms_norm(kv_low.data(), w.kv_a_layernorm.data<T>(), kv_normed.data(), L, kr, c.rms_norm_eps);
  carry.kv.resize(static_cast<size_t>((carry.tokens + L) * row));
  linear(kv_normed.data(), w.kv_b_proj.data<T>(), carry.kv.data() + carry.tokens * row, L, kr, row);

  if (w.has_indexer) run_indexer(c, w.indexer, x, q_resid.data(), L, carry, selection);
  const int64_t width = c.index_topk + (c.index_kpool_always_select_tail ? c.index_kpool - 1 : 0);
  check(static_cast<int64_t>(selection.size()) == L * width, "DSA layer without a selection to share");

  // Queries are this chunk's rows; the selection's absolute positions index all keys so far.
  std::vector<T> attended(static_cast<size_t>(L * H * dv));
  sparse_attention<T>({L, H, dqk, dv, width, 1.0 / std::sqrt(static_cast<double>(dqk))}, q.data(),
                      carry.kv.data(), selection.data(), attended.data());
  linear(attended.data(), w.o_proj.data<T>(), y, L, H * dv, D);
  carry.tokens += L;
}

template <class T>
void dsa_backward(const ModelConfig& c, const DsaWeights& w, const T* x, int64_t L,
                  const std::vector<int32_t>& selection, const T* dy, T* dx, DsaWeights& grad,
                  IndexerLoss* indexer_loss) {
  const int64_t D = c.hidden_size, H = c.num_attention_heads, kr = c.kv_lora_rank;
  const int64_t row = H * (c.qk_head_dim() + c.v_head_dim);
  std::vector<T> kv_low(static_cast<size_t>(L * kr)), kv_normed(kv_low.size()),
      kv(static_cast<size_t>(L * row));
  cpu::linear(x, w.kv_a_proj.data<T>(), kv_low.data(), L, D, kr);
  cpu::rms_norm(kv_low.data(), w.kv_a_layernorm.data<T>(), kv_normed.data(), L, kr, c.rms_norm_eps);
  cpu::linear(kv_normed.data(), w.kv_b_proj.data<T>(), kv.data(), L, kr, row);
  std::vector<T> dkv(kv.size(), T(0));
  dsa_backward(c, w, x, L, selection, dy, dx, grad, indexer_loss, kv, 0, dkv);
}

template <class T>
void dsa_backward(const ModelConfig& c, const DsaWeights& w, const T* x, int64_t L,
                  const std::vector<int32_t>& selection, const T* dy, T* dx, DsaWeights& grad,
                  IndexerLoss* indexer_loss, const std::vector<T>& kv, int64_t first, std::vector<T>& dkv) {
  using namespace cpu;
  const int64_t D = c.hidden_size, H = c.num_attention_heads, dqk = c.qk_head_dim(), dv = c.v_head_dim;
  const int64_t qr = c.q_lora_rank, kr = c.kv_lora_rank, row = H * (dqk + dv);
  const int64_t width = c.index_topk + (c.index_kpool_always_select_tail ? c.index_kpool - 1 : 0);
  check(static_cast<int64_t>(selection.size()) == L * width, "DSA backward without the forward selection");
  check(first >= 0 && (first + L) * row <= static_cast<int64_t>(kv.size()) && dkv.size() == kv.size(),
        "DSA backward: chunk [", first, ", ", first + L, ") outside the key/value cache");
  auto buffer = [](int64_t size) { return std::vector<T>(static_cast<size_t>(size), T(0)); };

  std::vector<T> q_low = buffer(L * qr), q_resid = buffer(L * qr), q = buffer(L * H * dqk);
  linear(x, w.q_a_proj.data<T>(), q_low.data(), L, D, qr);
  rms_norm(q_low.data(), w.q_a_layernorm.data<T>(), q_resid.data(), L, qr, c.rms_norm_eps);
  linear(q_resid.data(), w.q_b_proj.data<T>(), q.data(), L, qr, H * dqk);
  std::vector<T> kv_low = buffer(L * kr), kv_normed = buffer(L * kr);
  linear(x, w.kv_a_proj.data<T>(), kv_low.data(), L, D, kr);
  rms_norm(kv_low.data(), w.kv_a_layernorm.data<T>(), kv_normed.data(), L, kr, c.rms_norm_eps);
  // The chunk's queries against the whole cache (selections are absolute positions).
  const SparseAttentionShape shape{L, H, dqk, dv, width, 1.0 / std::sqrt(static_cast<double>(dqk))};
  std::vector<T> attended = buffer(L * H * dv);
  sparse_attention<T>(shape, q.data(), kv.data(), selection.data(), attended.data());

  if (indexer_loss != nullptr && w.has_indexer && indexer_loss->coef > 0) {
    check(first == 0 && L * row == static_cast<int64_t>(kv.size()),
          "the indexer's KL training runs over whole sequences, not chunks (yet)");
    std::vector<T> mass = buffer(L * width);
    attention_mass<T>(shape, q.data(), kv.data(), selection.data(), mass.data());
    train_indexer(c, w.indexer, x, q_resid.data(), L, selection, mass.data(), *indexer_loss, grad.indexer);
  }

  std::vector<T> d_attended = buffer(L * H * dv), dq = buffer(L * H * dqk);
  linear_backward(attended.data(), w.o_proj.data<T>(), dy, d_attended.data(), grad.o_proj.data<T>(), L,
                  H * dv, D);
  sparse_attention_backward<T>(shape, q.data(), kv.data(), selection.data(), d_attended.data(), dq.data(),
                               dkv.data());

  // This chunk's keys and values have every gradient they will get: later chunks ran first.
  std::vector<T> d_normed = buffer(L * kr), d_low = buffer(L * kr);
  linear_backward(kv_normed.data(), w.kv_b_proj.data<T>(), dkv.data() + first * row, d_normed.data(),
                  grad.kv_b_proj.data<T>(), L, kr, row);
  rms_norm_backward(kv_low.data(), w.kv_a_layernorm.data<T>(), d_normed.data(), d_low.data(),
                    grad.kv_a_layernorm.data<T>(), L, kr, c.rms_norm_eps);
  linear_backward(x, w.kv_a_proj.data<T>(), d_low.data(), dx, grad.kv_a_proj.data<T>(), L, D, kr);

  std::vector<T> d_resid = buffer(L * qr), dq_low = buffer(L * qr);
  linear_backward(q_resid.data(), w.q_b_proj.data<T>(), dq.data(), d_resid.data(), grad.q_b_proj.data<T>(), L,
                  qr, H * dqk);
  rms_norm_backward(q_low.data(), w.q_a_layernorm.data<T>(), d_resid.data(), dq_low.data(),
                    grad.q_a_layernorm.data<T>(), L, qr, c.rms_norm_eps);
  linear_backward(x, w.q_a_proj.data<T>(), dq_low.data(), dx, grad.q_a_proj.data<T>(), L, D, qr);
}

template struct DsaCarry<float>;
template struct DsaCarry<double>;
template void dsa_forward<float>(const ModelConfig&, const DsaWeights&, const float*, int64_t,
                                 std::vector<int32_t>&, float*, DsaCarry<float>&);
template void dsa_forward<double>(const ModelConfig&, const DsaWeights&, const double*, int64_t,
                                  std::vector<int32_t>&, double*, DsaCarry<double>&);
template void dsa_forward<float>(const ModelConfig&, const DsaWeights&, const float*, int64_t,
                                 std::vector<int32_t>&, float*);
template void dsa_forward<double>(const ModelConfig&, const DsaWeights&, const double*, int64_t,
                                  std::vector<int32_t>&, double*);
template void dsa_backward<float>(const ModelConfig&, const DsaWeights&, const float*, int64_t,
                                  const std::vector<int32_t>&, const float*, float*, DsaWeights&,
                                  IndexerLoss*);
template void dsa_backward<float>(const ModelConfig&, const DsaWeights&, const float*, int64_t,
                                  const std::vector<int32_t>&, const float*, float*, DsaWeights&,
                                  IndexerLoss*, const std::vector<float>&, int64_t, std::vector<float>&);
template void dsa_backward<double>(const ModelConfig&, const DsaWeights&, const double*, int64_t,
                                   const std::vector<int32_t>&, const double*, double*, DsaWeights&,
                                   IndexerLoss*, const std::vector<double>&, int64_t, std::vector<double>&);
template void dsa_backward<double>(const ModelConfig&, const DsaWeights&, const double*, int64_t,
                                   const std::vector<int32_t>&, const double*, double*, DsaWeights&,
                                   IndexerLoss*);

}  // namespace spindle
