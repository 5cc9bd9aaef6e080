#include "kernels/cpu/dsa.h"

#include <cmath>

#include "kernels/cpu/linear.h"
#include "kernels/cpu/norms.h"
#include "model/modules.h"

namespace spindle {

namespace {

// The indexer's per-token part for L tokens: its keys (raw, then normalised) and pool gates.
template <class T>
void indexer_keys(const ModelConfig& c, const IndexerWeights& w, const T* x, int64_t L, T* raw, T* keys,
                  T* gate) {
  const int64_t D = c.hidden_size, d = c.index_head_dim;
  cpu::linear(x, w.wk.data<T>(), raw, L, D, d);
  cpu::layer_norm(raw, w.k_norm_weight.data<T>(), w.k_norm_bias.data<T>(), keys, L, d, 1e-6);
  cpu::linear(x, w.compress_gate.data<T>(), gate, L, D, d);
}

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
  carry.index_keys.resize(static_cast<size_t>(total * d));
  carry.index_gate.resize(static_cast<size_t>(total * d));
  indexer_keys(c, w, x, L, raw.data(), carry.index_keys.data() + carry.tokens * d,
               carry.index_gate.data() + carry.tokens * d);
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
// detached, so nothing flows back into the model from here. The L queries are at positions
// first .. first + L of a sequence whose indexer keys and gates are in `cache`; they add their
// gradients of the pooled keys to cache_grad.pool_keys. The pools that end inside the chunk then
// have all of theirs (later chunks ran first; earlier queries cannot see them) and go back to their
// tokens' keys and gates (a pool straddling the chunk before writes into its rows); the chunk's own
// rows, complete too, go back through the key norm, wk and compress_gate.
template <class T>
void train_indexer(const ModelConfig& c, const IndexerWeights& w, const T* x, const T* q_resid, int64_t L,
                   const std::vector<int32_t>& selection, const T* mass, const DsaCarry<T>& cache,
                   int64_t first, DsaCacheGrad<T>& cache_grad, IndexerLoss& loss, IndexerWeights& grad) {
  using namespace cpu;
  const int64_t D = c.hidden_size, Hi = c.index_n_heads, d = c.index_head_dim, kp = c.index_kpool;
  const int64_t end = first + L;
  check(static_cast<int64_t>(cache.index_keys.size()) == cache.tokens * d &&
            cache_grad.index_keys.size() == cache.index_keys.size() &&
            static_cast<int64_t>(cache_grad.pool_keys.size()) == cache.tokens / kp * d,
        "the indexer's KL training needs the whole sequence's indexer keys and their gradient buffers");
  const IndexerShape shape{end, Hi, d, kp, c.index_topk, c.index_kpool_always_select_tail, first};
  auto buffer = [](int64_t n) { return std::vector<T>(static_cast<size_t>(n), T(0)); };
  std::vector<T> q = buffer(L * Hi * d), raw = buffer(L * d);
  linear(q_resid, w.wq_b.data<T>(), q.data(), L, c.q_lora_rank, Hi * d);
  linear(x, w.wk.data<T>(), raw.data(), L, D, d);
  std::vector<T> pool_keys = buffer(shape.complete_pools() * d), head_weights = buffer(L * Hi);
  indexer_pool_keys(shape, cache.index_keys.data(), cache.index_gate.data(), w.compress_ape.data<T>(),
                    pool_keys.data());
  linear(x, w.weights_proj.data<T>(), head_weights.data(), L, D, Hi);
  const T head_scale = T(1) / std::sqrt(T(Hi));
  for (T& hw : head_weights) hw *= head_scale;

  // The mean over the whole sequence's queries, whichever chunk they are in.
  const auto total = static_cast<double>(cache.tokens);
  std::vector<T> dq = buffer(L * Hi * d), dhw = buffer(L * Hi);
  const IndexerKlSums sums =
      indexer_kl_backward(shape, q.data(), pool_keys.data(), head_weights.data(), selection.data(), mass,
                          loss.coef / total, dq.data(), cache_grad.pool_keys.data(), dhw.data());
  loss.kl_sum += sums.kl / total;
  loss.trained_queries += sums.trained;
  loss.closed_queries += sums.closed;
  if (first == 0) loss.layers += 1;  // a layer counts once, at its first chunk

  for (T& g : dhw) g *= head_scale;
  linear_backward<T>(x, w.weights_proj.data<T>(), dhw.data(), nullptr, grad.weights_proj.data<T>(), L, D, Hi);
  linear_backward<T>(q_resid, w.wq_b.data<T>(), dq.data(), nullptr, grad.wq_b.data<T>(), L, c.q_lora_rank,
                     Hi * d);
  const int64_t p0 = first / kp, p1 = end / kp;  // the pools that end inside this chunk
  if (p1 > p0) {
    const IndexerShape pools{(p1 - p0) * kp, Hi, d, kp, c.index_topk, c.index_kpool_always_select_tail};
    const int64_t at = p0 * kp * d;
    indexer_pool_keys_backward(pools, cache.index_keys.data() + at, cache.index_gate.data() + at,
                               w.compress_ape.data<T>(), cache_grad.pool_keys.data() + p0 * d,
                               cache_grad.index_keys.data() + at, cache_grad.index_gate.data() + at,
                               grad.compress_ape.data<T>());
  }
  std::vector<T> draw = buffer(L * d);
  linear_backward<T>(x, w.compress_gate.data<T>(), cache_grad.index_gate.data() + first * d, nullptr,
                     grad.compress_gate.data<T>(), L, D, d);
  layer_norm_backward(raw.data(), w.k_norm_weight.data<T>(), cache_grad.index_keys.data() + first * d,
                      draw.data(), grad.k_norm_weight.data<T>(), grad.k_norm_bias.data<T>(), L, d, 1e-6);
  linear_backward<T>(x, w.wk.data<T>(), draw.data(), nullptr, grad.wk.data<T>(), L, D, d);
}

}  // namespace

void IndexerLoss::read(LossResult& result) const {
  if (layers > 0) result.indexer_kl = kl_sum / static_cast<double>(layers);
  if (trained_queries > 0)
    result.indexer_closed = static_cast<double>(closed_queries) / static_cast<double>(trained_queries);
}

template <class T>
DsaCacheGrad<T>::DsaCacheGrad(const ModelConfig& c, const DsaCarry<T>& cache)
    : kv(cache.kv.size(), T(0)),
      pool_keys(
          cache.index_keys.empty() ? 0 : static_cast<size_t>(cache.tokens / c.index_kpool * c.index_head_dim),
          T(0)),
      index_keys(cache.index_keys.size(), T(0)),
      index_gate(cache.index_gate.size(), T(0)) {}

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
  // The whole sequence is one chunk over its own cache.
  const int64_t D = c.hidden_size, H = c.num_attention_heads, kr = c.kv_lora_rank, d = c.index_head_dim;
  const int64_t row = H * (c.qk_head_dim() + c.v_head_dim);
  DsaCarry<T> cache;
  cache.tokens = L;
  std::vector<T> kv_low(static_cast<size_t>(L * kr)), kv_normed(kv_low.size());
  cache.kv.resize(static_cast<size_t>(L * row));
  cpu::linear(x, w.kv_a_proj.data<T>(), kv_low.data(), L, D, kr);
  cpu::rms_norm(kv_low.data(), w.kv_a_layernorm.data<T>(), kv_normed.data(), L, kr, c.rms_norm_eps);
  cpu::linear(kv_normed.data(), w.kv_b_proj.data<T>(), cache.kv.data(), L, kr, row);
  if (indexer_loss != nullptr && w.has_indexer && indexer_loss->coef > 0) {
    std::vector<T> raw(static_cast<size_t>(L * d));
    cache.index_keys.resize(raw.size());
    cache.index_gate.resize(raw.size());
    indexer_keys(c, w.indexer, x, L, raw.data(), cache.index_keys.data(), cache.index_gate.data());
  }
  DsaCacheGrad<T> cache_grad(c, cache);
  dsa_backward(c, w, x, L, selection, dy, dx, grad, indexer_loss, cache, 0, cache_grad);
}

template <class T>
void dsa_backward(const ModelConfig& c, const DsaWeights& w, const T* x, int64_t L,
                  const std::vector<int32_t>& selection, const T* dy, T* dx, DsaWeights& grad,
                  IndexerLoss* indexer_loss, const DsaCarry<T>& cache, int64_t first,
                  DsaCacheGrad<T>& cache_grad) {
  using namespace cpu;
  const int64_t D = c.hidden_size, H = c.num_attention_heads, dqk = c.qk_head_dim(), dv = c.v_head_dim;
  const int64_t qr = c.q_lora_rank, kr = c.kv_lora_rank, row = H * (dqk + dv);
  const int64_t width = c.index_topk + (c.index_kpool_always_select_tail ? c.index_kpool - 1 : 0);
  check(static_cast<int64_t>(selection.size()) == L * width, "DSA backward without the forward selection");
  const std::vector<T>& kv = cache.kv;
  std::vector<T>& dkv = cache_grad.kv;
  check(first >= 0 && first + L <= cache.tokens && cache.tokens * row == static_cast<int64_t>(kv.size()) &&
            dkv.size() == kv.size(),
        "DSA backward: chunk [", first, ", ", first + L, ") outside the key/value cache of ", cache.tokens,
        " tokens");
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
    std::vector<T> mass = buffer(L * width);
    attention_mass<T>(shape, q.data(), kv.data(), selection.data(), mass.data());
    train_indexer(c, w.indexer, x, q_resid.data(), L, selection, mass.data(), cache, first, cache_grad,
                  *indexer_loss, grad.indexer);
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
template struct DsaCacheGrad<float>;
template struct DsaCacheGrad<double>;
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
                                  IndexerLoss*, const DsaCarry<float>&, int64_t, DsaCacheGrad<float>&);
template void dsa_backward<double>(const ModelConfig&, const DsaWeights&, const double*, int64_t,
                                   const std::vector<int32_t>&, const double*, double*, DsaWeights&,
                                   IndexerLoss*, const DsaCarry<double>&, int64_t, DsaCacheGrad<double>&);
template void dsa_backward<double>(const ModelConfig&, const DsaWeights&, const double*, int64_t,
                                   const std::vector<int32_t>&, const double*, double*, DsaWeights&,
                                   IndexerLoss*);

}  // namespace spindle
