// DeepSeek Sparse Attention on the CPU: the k-pool indexer that picks, for every query, which
// earlier tokens it may attend to, and attention restricted to those tokens. Nothing here is
// tokens x tokens: the indexer scores queries in blocks against pooled keys, attention visits
// only the selected indices.
#pragma once

#include <cstdint>

namespace spindle::cpu {

struct IndexerShape {
  int64_t tokens;
  int64_t heads;     // index_n_heads
  int64_t head_dim;  // index_head_dim
  int64_t kpool;     // tokens per pool
  int64_t topk;      // index_topk (tokens; topk / kpool pools are chosen)
  bool select_tail;  // index_kpool_always_select_tail
  // Queries are the tokens from here on (a chunk of a longer sequence: the streaming executor);
  // keys are all `tokens`. indexer_select and indexer_kl_backward take a chunk; the rest need 0.
  int64_t first_query = 0;
  int64_t width() const { return topk + (select_tail ? kpool - 1 : 0); }
  int64_t complete_pools() const { return tokens / kpool; }
  int64_t queries() const { return tokens - first_query; }
};

// Pooled keys of the complete pools: pool_keys[p, c] = sum_j softmax_j(gate[p*kp + j, c] + ape[j, c])
// * keys[p*kp + j, c]. keys, gate: [tokens, head_dim]; ape: [kpool, head_dim]; pool_keys:
// [complete_pools, head_dim].
template <class T>
void indexer_pool_keys(const IndexerShape& s, const T* keys, const T* gate, const T* ape, T* pool_keys);

// For each query t, the token indices it attends to, [tokens, width], -1 where unused:
// the top topk/kpool visible complete pools by score (pool p is visible when its last token is
// <= t), ties to the lower pool, expanded to their tokens; then, with select_tail, the tokens of
// the incomplete pool that ends at t. Score: sum_h w[t, h] * relu(q[t, h] . pool_key[p] / sqrt(d)).
// q: [tokens, heads, head_dim]; head_weights: [tokens, heads] (already scaled by heads^-0.5).
template <class T>
void indexer_select(const IndexerShape& s, const T* q, const T* pool_keys, const T* head_weights,
                    int32_t* selected);

// A selection as indexer_select writes it, kept as its pool list: the chosen pools in order,
// topk / kpool per query, -1 past the chosen ones; and back, exactly (the tail from each query's
// position). Rows are the queries from first_query on: selected [queries, width], pools
// [queries, topk / kpool]. What the GPU streaming executor keeps from its forward.
void selection_to_pools(const IndexerShape& s, const int32_t* selected, int32_t* pools);
void pools_to_selection(const IndexerShape& s, const int32_t* pools, int32_t* selected);

struct SparseAttentionShape {
  int64_t tokens;
  int64_t heads;
  int64_t qk_dim;  // per-head query/key width
  int64_t v_dim;   // per-head value width
  int64_t width;   // selected indices per query
  double scale;    // softmax scale
  // Heads of kv: `heads` (0 means the same), or 1 when every query head reads one shared key and
  // value per token (MLA's absorbed form: the 512-wide latent).
  int64_t kv_heads = 0;
  int64_t key_heads() const { return kv_heads == 0 ? heads : kv_heads; }
};

// out[t, h] = sum_{s in selected[t]} softmax_s(q[t, h] . k[s, h'] * scale) v[s, h'], h' = h mod
// key_heads(). q: [tokens, heads, qk_dim]; kv: [tokens, key_heads(), qk_dim + v_dim] (key then
// value per head, as kv_b_proj lays them out); selected: [tokens, width] with -1 for unused; out:
// [tokens, heads, v_dim].
template <class T>
void sparse_attention(const SparseAttentionShape& s, const T* q, const T* kv, const int32_t* selected,
                      T* out);

// Backward of sparse_attention: dq written; dkv (same layout as kv) accumulated. The selection is
// a discrete choice and gets no gradient.
template <class T>
void sparse_attention_backward(const SparseAttentionShape& s, const T* q, const T* kv,
                               const int32_t* selected, const T* dout, T* dq, T* dkv);

// The main attention's probabilities summed over heads, per selected slot: mass [tokens, width]
// (zero where the slot is unused). The indexer's training target.
template <class T>
void attention_mass(const SparseAttentionShape& s, const T* q, const T* kv, const int32_t* selected, T* mass);

// The indexer's loss as in DeepSeek-V3.2's sparse stage, adapted to k-pools: for each query, over
// the complete pools it selected, the target is the attention mass of each pool's tokens
// normalised over those pools, and the indexer's distribution is the softmax of its pool scores;
// the loss is KL(target || indexer) times `scale` (summed over queries). Writes dq and
// dhead_weights, accumulates dpool_keys; returns the sums below. Rows of q, head_weights, selected,
// mass, dq and dhead_weights are the queries from first_query on; pool_keys and dpool_keys hold
// every complete pool of the `tokens` keys.
struct IndexerKlSums {
  double kl = 0.0;      // the unscaled KL summed over the queries
  int64_t trained = 0;  // queries with two or more chosen pools and attention mass on them
  // Of those, the queries whose every relu is closed on their chosen pools: all their scores are 0,
  // so the selection is the lowest pools and the KL gives them no gradient (a dead indexer).
  int64_t closed = 0;
};
template <class T>
IndexerKlSums indexer_kl_backward(const IndexerShape& s, const T* q, const T* pool_keys,
                                  const T* head_weights, const int32_t* selected, const T* mass, double scale,
                                  T* dq, T* dpool_keys, T* dhead_weights);

// Backward of indexer_pool_keys: dkeys and dgate written, dape accumulated.
template <class T>
void indexer_pool_keys_backward(const IndexerShape& s, const T* keys, const T* gate, const T* ape,
                                const T* dpool_keys, T* dkeys, T* dgate, T* dape);

}  // namespace spindle::cpu
