#include "kernels/cpu/dsa.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <utility>
#include <vector>

#include "core/error.h"
#include "core/parallel.h"

namespace spindle::cpu {

template <class T>
void indexer_pool_keys(const IndexerShape& s, const T* keys, const T* gate, const T* ape, T* pool_keys) {
  const int64_t d = s.head_dim, kp = s.kpool;
  parallel_for(s.complete_pools(), 64, [&](int64_t begin, int64_t end) {
    std::vector<T> logits(static_cast<size_t>(kp));
    for (int64_t p = begin; p < end; ++p) {
      for (int64_t c = 0; c < d; ++c) {
        T mx = -std::numeric_limits<T>::infinity();
        for (int64_t j = 0; j < kp; ++j) {
          const T l = gate[(p * kp + j) * d + c] + ape[j * d + c];
          logits[static_cast<size_t>(j)] = l;
          mx = std::max(mx, l);
        }
        T sum = 0;
        for (int64_t j = 0; j < kp; ++j)
          sum += (logits[static_cast<size_t>(j)] = std::exp(logits[static_cast<size_t>(j)] - mx));
        T acc = 0;
        for (int64_t j = 0; j < kp; ++j)
          acc += logits[static_cast<size_t>(j)] / sum * keys[(p * kp + j) * d + c];
        pool_keys[p * d + c] = acc;
      }
    }
  });
}

template <class T>
void indexer_select(const IndexerShape& s, const T* q, const T* pool_keys, const T* head_weights,
                    int32_t* selected) {
  const int64_t H = s.heads, d = s.head_dim, kp = s.kpool, width = s.width();
  const int64_t pools = s.complete_pools();
  const int64_t select_pools = std::min(s.topk / kp, pools);
  const T scale = T(1) / std::sqrt(T(d));
  check(s.first_query >= 0 && s.first_query <= s.tokens, "indexer_select: first query ", s.first_query,
        " outside ", s.tokens, " tokens");
  // Each thread scores one query at a time against its visible pools: memory is O(pools). Row r of
  // q, head_weights and selected is the query at position t = first_query + r.
  parallel_for(s.queries(), 16, [&](int64_t begin, int64_t end) {
    std::vector<std::pair<T, int64_t>> scored(static_cast<size_t>(pools));
    for (int64_t r = begin; r < end; ++r) {
      const int64_t t = s.first_query + r;
      int32_t* out = selected + r * width;
      std::fill(out, out + width, -1);
      const int64_t visible = std::min(pools, (t + 1) / kp);
      for (int64_t p = 0; p < visible; ++p) {
        T score = 0;
        for (int64_t h = 0; h < H; ++h) {
          const T* qh = q + (r * H + h) * d;
          const T* k = pool_keys + p * d;
          T dot = 0;
          for (int64_t c = 0; c < d; ++c) dot += qh[c] * k[c];
          score += head_weights[r * H + h] * std::max(T(0), dot * scale);
        }
        scored[static_cast<size_t>(p)] = {score, p};
      }
      const int64_t chosen = std::min(select_pools, visible);
      auto higher = [](const std::pair<T, int64_t>& a, const std::pair<T, int64_t>& b) {
        return a.first > b.first || (a.first == b.first && a.second < b.second);
      };
      if (chosen < visible) {
        std::nth_element(scored.begin(), scored.begin() + chosen, scored.begin() + visible, higher);
      }
      std::sort(scored.begin(), scored.begin() + chosen,
                [](const auto& a, const auto& b) { return a.second < b.second; });
      int64_t n = 0;
      for (int64_t i = 0; i < chosen; ++i) {
        const int64_t first = scored[static_cast<size_t>(i)].second * kp;
        for (int64_t j = 0; j < kp; ++j) out[n++] = static_cast<int32_t>(first + j);
      }
      if (s.select_tail && kp > 1) {
        const int64_t tail = (t + 1) % kp;
        for (int64_t j = 0; j < tail; ++j) out[s.topk + j] = static_cast<int32_t>(t + 1 - tail + j);
      }
    }
  });
}

namespace {

// Attention probabilities of query head (t, h) over its selected slots, normalised, into p
// (unused slots untouched). The one softmax the forward, the backward and the indexer target share.
template <class T>
void selected_softmax(const SparseAttentionShape& s, const T* q, const T* kv, const int32_t* idx, int64_t t,
                      int64_t h, T* p) {
  const int64_t H = s.heads, KH = s.key_heads(), dq = s.qk_dim, stride = s.qk_dim + s.v_dim;
  const T* qh = q + (t * H + h) * dq;
  T mx = -std::numeric_limits<T>::infinity();
  for (int64_t i = 0; i < s.width; ++i) {
    if (idx[i] < 0) continue;
    const T* k = kv + (idx[i] * KH + h % KH) * stride;
    T dot = 0;
    for (int64_t c = 0; c < dq; ++c) dot += qh[c] * k[c];
    p[i] = dot * T(s.scale);
    mx = std::max(mx, p[i]);
  }
  T sum = 0;
  for (int64_t i = 0; i < s.width; ++i)
    if (idx[i] >= 0) sum += (p[i] = std::exp(p[i] - mx));
  for (int64_t i = 0; i < s.width; ++i)
    if (idx[i] >= 0) p[i] /= sum;
}

}  // namespace

template <class T>
void sparse_attention(const SparseAttentionShape& s, const T* q, const T* kv, const int32_t* selected,
                      T* out) {
  const int64_t H = s.heads, KH = s.key_heads(), dq = s.qk_dim, dv = s.v_dim, stride = dq + dv;
  parallel_for(s.tokens, 16, [&](int64_t begin, int64_t end) {
    std::vector<T> p(static_cast<size_t>(s.width));
    for (int64_t t = begin; t < end; ++t) {
      const int32_t* idx = selected + t * s.width;
      for (int64_t h = 0; h < H; ++h) {
        selected_softmax(s, q, kv, idx, t, h, p.data());
        T* o = out + (t * H + h) * dv;
        for (int64_t c = 0; c < dv; ++c) o[c] = 0;
        for (int64_t i = 0; i < s.width; ++i) {
          if (idx[i] < 0) continue;
          const T w = p[static_cast<size_t>(i)];
          const T* v = kv + (idx[i] * KH + h % KH) * stride + dq;
          for (int64_t c = 0; c < dv; ++c) o[c] += w * v[c];
        }
      }
    }
  });
}

template <class T>
void sparse_attention_backward(const SparseAttentionShape& s, const T* q, const T* kv,
                               const int32_t* selected, const T* dout, T* dq, T* dkv) {
  const int64_t H = s.heads, KH = s.key_heads(), dqk = s.qk_dim, dv = s.v_dim, stride = dqk + dv;
  // Key heads own disjoint slices of dkv, so threads split the key heads (each takes the query
  // heads that read it).
  parallel_for(KH, 1, [&](int64_t k0, int64_t k1) {
    std::vector<T> p(static_cast<size_t>(s.width)), dp(static_cast<size_t>(s.width));
    for (int64_t h = 0; h < H; ++h) {
      if (h % KH < k0 || h % KH >= k1) continue;
      for (int64_t t = 0; t < s.tokens; ++t) {
        const int32_t* idx = selected + t * s.width;
        const T* qh = q + (t * H + h) * dqk;
        const T* go = dout + (t * H + h) * dv;
        selected_softmax(s, q, kv, idx, t, h, p.data());
        T weighted = 0;  // sum_s p_s dp_s
        for (int64_t i = 0; i < s.width; ++i) {
          if (idx[i] < 0) continue;
          const T* v = kv + (idx[i] * KH + h % KH) * stride + dqk;
          T d = 0;
          for (int64_t c = 0; c < dv; ++c) d += go[c] * v[c];
          dp[static_cast<size_t>(i)] = d;
          weighted += p[static_cast<size_t>(i)] * d;
        }
        T* dqh = dq + (t * H + h) * dqk;
        for (int64_t c = 0; c < dqk; ++c) dqh[c] = 0;
        for (int64_t i = 0; i < s.width; ++i) {
          if (idx[i] < 0) continue;
          const T pi = p[static_cast<size_t>(i)];
          const T ds = pi * (dp[static_cast<size_t>(i)] - weighted) * T(s.scale);
          const T* k = kv + (idx[i] * KH + h % KH) * stride;
          T* dk = dkv + (idx[i] * KH + h % KH) * stride;
          for (int64_t c = 0; c < dqk; ++c) {
            dqh[c] += ds * k[c];
            dk[c] += ds * qh[c];
          }
          for (int64_t c = 0; c < dv; ++c) dk[dqk + c] += pi * go[c];
        }
      }
    }
  });
}

template <class T>
void attention_mass(const SparseAttentionShape& s, const T* q, const T* kv, const int32_t* selected,
                    T* mass) {
  parallel_for(s.tokens, 16, [&](int64_t begin, int64_t end) {
    std::vector<T> p(static_cast<size_t>(s.width));
    for (int64_t t = begin; t < end; ++t) {
      const int32_t* idx = selected + t * s.width;
      T* m = mass + t * s.width;
      std::fill(m, m + s.width, T(0));
      for (int64_t h = 0; h < s.heads; ++h) {
        selected_softmax(s, q, kv, idx, t, h, p.data());
        for (int64_t i = 0; i < s.width; ++i)
          if (idx[i] >= 0) m[i] += p[static_cast<size_t>(i)];
      }
    }
  });
}

template <class T>
IndexerKlSums indexer_kl_backward(const IndexerShape& s, const T* q, const T* pool_keys,
                                  const T* head_weights, const int32_t* selected, const T* mass, double scale,
                                  T* dq, T* dpool_keys, T* dhead_weights) {
  const int64_t H = s.heads, d = s.head_dim, kp = s.kpool, width = s.width();
  check(s.first_query >= 0 && s.first_query <= s.tokens, "indexer_kl_backward: first query ", s.first_query,
        " outside ", s.tokens, " tokens");
  const T score_scale = T(1) / std::sqrt(T(d));
  IndexerKlSums sums;
  std::vector<int64_t> pools;
  std::vector<T> target, score;
  // Row t of q, head_weights, selected, mass, dq and dhead_weights is the query at position
  // first_query + t; pools are absolute (they come from the selection).
  for (int64_t t = 0; t < s.queries(); ++t) {
    std::fill(dq + t * H * d, dq + (t + 1) * H * d, T(0));
    std::fill(dhead_weights + t * H, dhead_weights + (t + 1) * H, T(0));
    // The chosen complete pools: runs of kpool slots at the front of the selection.
    pools.clear();
    target.clear();
    T target_sum = 0;
    for (int64_t i = 0; i + kp <= s.topk; i += kp) {
      const int32_t first = selected[t * width + i];
      if (first < 0) continue;
      T m = 0;
      for (int64_t j = 0; j < kp; ++j) m += mass[t * width + i + j];
      pools.push_back(first / kp);
      target.push_back(m);
      target_sum += m;
    }
    if (pools.size() < 2 || target_sum <= T(0)) continue;  // one pool: nothing to learn
    ++sums.trained;
    score.assign(pools.size(), T(0));
    T mx = -std::numeric_limits<T>::infinity();
    bool open = false;
    for (size_t p = 0; p < pools.size(); ++p) {
      for (int64_t h = 0; h < H; ++h) {
        T z = 0;
        for (int64_t c = 0; c < d; ++c) z += q[(t * H + h) * d + c] * pool_keys[pools[p] * d + c];
        open = open || z > T(0);
        score[p] += head_weights[t * H + h] * std::max(T(0), z * score_scale);
      }
      mx = std::max(mx, score[p]);
    }
    if (!open) ++sums.closed;
    T z_sum = 0;
    for (T& v : score) z_sum += (v = std::exp(v - mx));
    for (size_t p = 0; p < pools.size(); ++p) {
      const T rho = score[p] / z_sum, pi = target[p] / target_sum;
      if (pi > T(0)) sums.kl += static_cast<double>(pi * (std::log(pi) - std::log(rho)));
      const T dscore = (rho - pi) * T(scale);
      for (int64_t h = 0; h < H; ++h) {
        const T* qh = q + (t * H + h) * d;
        const T* k = pool_keys + pools[p] * d;
        T z = 0;
        for (int64_t c = 0; c < d; ++c) z += qh[c] * k[c];
        z *= score_scale;
        if (z <= T(0)) continue;
        dhead_weights[t * H + h] += dscore * z;
        const T g = dscore * head_weights[t * H + h] * score_scale;
        for (int64_t c = 0; c < d; ++c) {
          dq[(t * H + h) * d + c] += g * k[c];
          dpool_keys[pools[p] * d + c] += g * qh[c];
        }
      }
    }
  }
  return sums;
}

template <class T>
void indexer_pool_keys_backward(const IndexerShape& s, const T* keys, const T* gate, const T* ape,
                                const T* dpool_keys, T* dkeys, T* dgate, T* dape) {
  const int64_t d = s.head_dim, kp = s.kpool;
  std::fill(dkeys, dkeys + s.tokens * d, T(0));
  std::fill(dgate, dgate + s.tokens * d, T(0));
  std::vector<T> alpha(static_cast<size_t>(kp));
  for (int64_t p = 0; p < s.complete_pools(); ++p) {
    for (int64_t c = 0; c < d; ++c) {
      T mx = -std::numeric_limits<T>::infinity();
      for (int64_t j = 0; j < kp; ++j) {
        alpha[static_cast<size_t>(j)] = gate[(p * kp + j) * d + c] + ape[j * d + c];
        mx = std::max(mx, alpha[static_cast<size_t>(j)]);
      }
      T sum = 0;
      for (T& a : alpha) sum += (a = std::exp(a - mx));
      const T g = dpool_keys[p * d + c];
      T weighted = 0;  // sum_j alpha_j * dalpha_j with dalpha_j = g * k_j
      for (int64_t j = 0; j < kp; ++j) {
        alpha[static_cast<size_t>(j)] /= sum;
        weighted += alpha[static_cast<size_t>(j)] * g * keys[(p * kp + j) * d + c];
      }
      for (int64_t j = 0; j < kp; ++j) {
        const T a = alpha[static_cast<size_t>(j)];
        const int64_t at = (p * kp + j) * d + c;
        dkeys[at] = g * a;
        const T dlogit = a * (g * keys[at] - weighted);
        dgate[at] = dlogit;
        dape[j * d + c] += dlogit;
      }
    }
  }
}

void selection_to_pools(const IndexerShape& s, const int32_t* selected, int32_t* pools) {
  const int64_t per_query = s.topk / s.kpool, width = s.width();
  for (int64_t r = 0; r < s.queries(); ++r)
    for (int64_t i = 0; i < per_query; ++i) {
      const int32_t token = selected[r * width + i * s.kpool];
      pools[r * per_query + i] = token >= 0 ? static_cast<int32_t>(token / s.kpool) : -1;
    }
}

void pools_to_selection(const IndexerShape& s, const int32_t* pools, int32_t* selected) {
  const int64_t kp = s.kpool, per_query = s.topk / kp, width = s.width();
  for (int64_t r = 0; r < s.queries(); ++r) {
    int32_t* out = selected + r * width;
    std::fill(out, out + width, -1);
    for (int64_t i = 0; i < per_query; ++i) {
      const int32_t pool = pools[r * per_query + i];
      if (pool < 0) continue;
      for (int64_t j = 0; j < kp; ++j) out[i * kp + j] = static_cast<int32_t>(pool * kp + j);
    }
    if (width > s.topk) {  // the tail: the query's own incomplete pool up to it
      const int64_t t = s.first_query + r, tail = (t + 1) % kp;
      for (int64_t j = 0; j < tail; ++j) out[s.topk + j] = static_cast<int32_t>(t + 1 - tail + j);
    }
  }
}

#define SPINDLE_INSTANTIATE(T)                                                                             \
  template void indexer_pool_keys<T>(const IndexerShape&, const T*, const T*, const T*, T*);               \
  template void indexer_select<T>(const IndexerShape&, const T*, const T*, const T*, int32_t*);            \
  template void sparse_attention<T>(const SparseAttentionShape&, const T*, const T*, const int32_t*, T*);  \
  template void sparse_attention_backward<T>(const SparseAttentionShape&, const T*, const T*,              \
                                             const int32_t*, const T*, T*, T*);                            \
  template void attention_mass<T>(const SparseAttentionShape&, const T*, const T*, const int32_t*, T*);    \
  template IndexerKlSums indexer_kl_backward<T>(const IndexerShape&, const T*, const T*, const T*,         \
                                                const int32_t*, const T*, double, T*, T*, T*);             \
  template void indexer_pool_keys_backward<T>(const IndexerShape&, const T*, const T*, const T*, const T*, \
                                              T*, T*, T*);
SPINDLE_INSTANTIATE(float)
SPINDLE_INSTANTIATE(double)
#undef SPINDLE_INSTANTIATE

}  // namespace spindle::cpu
