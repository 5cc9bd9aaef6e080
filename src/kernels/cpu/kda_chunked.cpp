#include "kernels/cpu/kda_chunked.h"

#include <algorithm>
#include <cmath>
#include <utility>
#include <vector>

#include "core/parallel.h"

namespace spindle::cpu {
namespace {

// out[m, n] += alpha * op(a) op(b), op(a) [m, p] and op(b) [p, n], all row-major. A transposed
// operand is read as it is stored ([p, m], resp. [n, p]), as the GPU's GEMMs would read it.
template <class T>
void gemm(bool ta, bool tb, int64_t m, int64_t n, int64_t p, T alpha, const T* a, const T* b, T* out) {
  for (int64_t i = 0; i < m; ++i)
    for (int64_t r = 0; r < p; ++r) {
      const T x = alpha * (ta ? a[r * m + i] : a[i * p + r]);
      for (int64_t j = 0; j < n; ++j) out[i * n + j] += x * (tb ? b[j * p + r] : b[r * n + j]);
    }
}

// The products through the decay between two tokens of a chunk, exp(G_t - G_s) for s <= t, so
// that every exponent is <= 0: out[t][s] = sum_i x_t,i exp(G_t,i - G_s,i) y_s,i for s < t (s <= t
// with `diagonal`), zero elsewhere. x, y, G: [n, d]; out: [n, n].
template <class T>
void decay_gram(const T* x, const T* y, const T* G, int64_t n, int64_t d, bool diagonal, T* out) {
  for (int64_t t = 0; t < n; ++t)
    for (int64_t s = 0; s < n; ++s) {
      T acc = 0;
      if (s < t || (diagonal && s == t))
        for (int64_t i = 0; i < d; ++i)
          acc += x[t * d + i] * std::exp(G[t * d + i] - G[s * d + i]) * y[s * d + i];
      out[t * n + s] = acc;
    }
}

// The two sides of decay_gram's gradient for the gradient m of its output (lower triangular):
//   rows[t, i] = sum_{s<=t} m[t][s] exp(G_t,i - G_s,i) y_s,i  (x's gradient)
//   cols[s, i] = sum_{t>=s} m[t][s] exp(G_t,i - G_s,i) x_t,i  (y's gradient)
template <class T>
void decay_gram_backward(const T* m, const T* x, const T* y, const T* G, int64_t n, int64_t d, T* rows,
                         T* cols) {
  std::fill(rows, rows + n * d, T(0));
  std::fill(cols, cols + n * d, T(0));
  for (int64_t t = 0; t < n; ++t)
    for (int64_t s = 0; s <= t; ++s)
      for (int64_t i = 0; i < d; ++i) {
        const T w = m[t * n + s] * std::exp(G[t * d + i] - G[s * d + i]);
        rows[t * d + i] += w * y[s * d + i];
        cols[s * d + i] += w * x[t * d + i];
      }
}

// One head's chunk of n <= C tokens in matrix form (see docs/KDA.md). Per chunk: G_t = sum_{s<=t}
// g_s; Qg = exp(G) q, W = exp(G) k (decayed from the chunk's entry), Kb = exp(G_last - G) k (decayed
// to its exit); A (strict) and Aq (with the diagonal) through exp(G_t - G_s); Tinv = (I + diag(beta)
// A)^-1. From the entry state S: X = V - W S - A u and u = diag(beta) X, i.e. u = Tinv diag(beta)
// (V - W S); o = Qg S + Aq u; S' = diag(exp(G_last)) S + Kb^T u.
template <class T>
class KdaChunk {
 public:
  KdaChunk(const KdaShape& s, int64_t C, const T* q, const T* k, const T* v, const T* g, const T* beta)
      : H_(s.heads), dk_(s.key_dim), dv_(s.value_dim), q_(q), k_(k), v_(v), g_(g), beta_(beta) {
    const auto keys = static_cast<size_t>(C * dk_), values = static_cast<size_t>(C * dv_),
               square = static_cast<size_t>(C * C);
    for (auto* m : {&Q_, &K_, &G_, &E_, &Eb_, &Qg_, &W_, &Kb_, &dQg_, &dW_, &dKb_, &rowA_, &colA_, &rowAq_,
                    &colAq_, &dG_})
      m->resize(keys);
    for (auto* m : {&V_, &X_, &R_, &u_, &dO_, &du_, &dR_, &dRb_}) m->resize(values);
    for (auto* m : {&A_, &Aq_, &Tinv_, &dA_, &dAq_}) m->resize(square);
    b_.resize(static_cast<size_t>(C));
    last_.resize(static_cast<size_t>(dk_));
  }

  // Everything that does not depend on the state, for tokens [t0, t0 + n) of head h.
  void load(int64_t h, int64_t t0, int64_t n) {
    n_ = n;
    const int64_t dk = dk_, dv = dv_;
    for (int64_t t = 0; t < n; ++t) {
      const int64_t row = (t0 + t) * H_ + h;
      b_[t] = beta_[row];
      for (int64_t i = 0; i < dk; ++i) {
        Q_[t * dk + i] = q_[row * dk + i];
        K_[t * dk + i] = k_[row * dk + i];
        G_[t * dk + i] = (t > 0 ? G_[(t - 1) * dk + i] : T(0)) + g_[row * dk + i];
      }
      for (int64_t j = 0; j < dv; ++j) V_[t * dv + j] = v_[row * dv + j];
    }
    const T* Glast = G_.data() + (n - 1) * dk;
    for (int64_t i = 0; i < dk; ++i) last_[i] = std::exp(Glast[i]);
    for (int64_t t = 0; t < n; ++t)
      for (int64_t i = 0; i < dk; ++i) {
        const int64_t x = t * dk + i;
        E_[x] = std::exp(G_[x]);
        Eb_[x] = std::exp(Glast[i] - G_[x]);
        Qg_[x] = E_[x] * Q_[x];
        W_[x] = E_[x] * K_[x];
        Kb_[x] = Eb_[x] * K_[x];
      }
    decay_gram(K_.data(), K_.data(), G_.data(), n, dk, false, A_.data());
    decay_gram(Q_.data(), K_.data(), G_.data(), n, dk, true, Aq_.data());
    // Tinv by rows of (I + diag(beta) A) Tinv = I: row t = e_t - beta_t sum_{r<t} A[t][r] row r.
    for (int64_t t = 0; t < n; ++t) {
      T* row = Tinv_.data() + t * n;
      std::fill(row, row + n, T(0));
      row[t] = 1;
      for (int64_t r = 0; r < t; ++r) {
        const T c = b_[t] * A_[t * n + r];
        for (int64_t s = 0; s <= r; ++s) row[s] -= c * Tinv_[r * n + s];
      }
    }
  }

  // u and X from the chunk's entry state S [dk, dv].
  void solve(const T* S) {
    const int64_t n = n_, dk = dk_, dv = dv_;
    std::copy(V_.begin(), V_.begin() + n * dv, X_.begin());
    gemm(false, false, n, dv, dk, T(-1), W_.data(), S, X_.data());  // X = V - W S
    for (int64_t t = 0; t < n; ++t)
      for (int64_t j = 0; j < dv; ++j) R_[t * dv + j] = b_[t] * X_[t * dv + j];
    std::fill(u_.begin(), u_.begin() + n * dv, T(0));
    gemm(false, false, n, dv, n, T(1), Tinv_.data(), R_.data(), u_.data());  // u = Tinv diag(beta) X
    gemm(false, false, n, dv, n, T(-1), A_.data(), u_.data(), X_.data());    // X -= A u
  }

  // S = diag(exp(G_last)) S + Kb^T u: the state leaving the chunk.
  void advance(T* S) const {
    for (int64_t i = 0; i < dk_; ++i)
      for (int64_t j = 0; j < dv_; ++j) S[i * dv_ + j] *= last_[i];
    gemm(true, false, dk_, dv_, n_, T(1), Kb_.data(), u_.data(), S);
  }

  // The chunk's backward after solve(S): from its dout rows and dS_next, the gradient of the state
  // leaving it, writes the gradients of its tokens' inputs and dS_entry, that of the state entering.
  void backward(const T* S, const T* dS_next, const T* dout, int64_t h, int64_t t0, T* dS_entry, T* dq, T* dk,
                T* dv, T* dg, T* dbeta) {
    const int64_t n = n_, dk_n = dk_, dv_n = dv_;
    for (int64_t t = 0; t < n; ++t)
      for (int64_t j = 0; j < dv_n; ++j) dO_[t * dv_n + j] = dout[((t0 + t) * H_ + h) * dv_n + j];
    // u reaches the outputs through Aq and the exit state through Kb.
    std::fill(du_.begin(), du_.begin() + n * dv_n, T(0));
    gemm(false, false, n, dv_n, dk_n, T(1), Kb_.data(), dS_next, du_.data());
    gemm(true, false, n, dv_n, n, T(1), Aq_.data(), dO_.data(), du_.data());
    // The transposed solve: dR = Tinv^T du is the gradient of the right-hand side R = diag(beta)
    // (V - W S), dRb = diag(beta) dR that of V - W S. Through the matrix I + diag(beta) A they give
    // dA = -dRb u^T and dbeta_t = dR_t . (v_t - W_t S - (A u)_t) = dR_t . X_t.
    std::fill(dR_.begin(), dR_.begin() + n * dv_n, T(0));
    gemm(true, false, n, dv_n, n, T(1), Tinv_.data(), du_.data(), dR_.data());
    for (int64_t t = 0; t < n; ++t) {
      T db = 0;
      for (int64_t j = 0; j < dv_n; ++j) {
        db += dR_[t * dv_n + j] * X_[t * dv_n + j];
        dRb_[t * dv_n + j] = b_[t] * dR_[t * dv_n + j];
      }
      dbeta[(t0 + t) * H_ + h] = db;
    }
    // dA = -dRb u^T (strictly below the diagonal), dAq = dO u^T (on and below it).
    std::fill(dA_.begin(), dA_.begin() + n * n, T(0));
    std::fill(dAq_.begin(), dAq_.begin() + n * n, T(0));
    gemm(false, true, n, n, dv_n, T(-1), dRb_.data(), u_.data(), dA_.data());
    gemm(false, true, n, n, dv_n, T(1), dO_.data(), u_.data(), dAq_.data());
    for (int64_t t = 0; t < n; ++t)
      for (int64_t s = t; s < n; ++s) {
        dA_[t * n + s] = 0;
        if (s > t) dAq_[t * n + s] = 0;
      }
    // The products with the entry and exit states.
    for (auto* m : {&dQg_, &dW_, &dKb_}) std::fill(m->begin(), m->begin() + n * dk_n, T(0));
    gemm(false, true, n, dk_n, dv_n, T(1), dO_.data(), S, dQg_.data());
    gemm(false, true, n, dk_n, dv_n, T(-1), dRb_.data(), S, dW_.data());
    gemm(false, true, n, dk_n, dv_n, T(1), u_.data(), dS_next, dKb_.data());
    for (int64_t i = 0; i < dk_n; ++i)
      for (int64_t j = 0; j < dv_n; ++j) dS_entry[i * dv_n + j] = last_[i] * dS_next[i * dv_n + j];
    gemm(true, false, dk_n, dv_n, n, T(1), Qg_.data(), dO_.data(), dS_entry);
    gemm(true, false, dk_n, dv_n, n, T(-1), W_.data(), dRb_.data(), dS_entry);
    // Through A and Aq to q and k.
    decay_gram_backward(dA_.data(), K_.data(), K_.data(), G_.data(), n, dk_n, rowA_.data(), colA_.data());
    decay_gram_backward(dAq_.data(), Q_.data(), K_.data(), G_.data(), n, dk_n, rowAq_.data(), colAq_.data());
    // A token enters with exp(+G_t) where it is the later one (Qg, W, the rows of A and Aq) and
    // with exp(-G_t) where it is the earlier one (Kb, the columns): dG_t is q_t dq_t + k_t (later
    // part of dk_t) - k_t (earlier part). G_last also enters through exp(G_last) of S' and Kb.
    std::fill(dG_.begin(), dG_.begin() + n * dk_n, T(0));
    T* dG_last = dG_.data() + (n - 1) * dk_n;
    for (int64_t t = 0; t < n; ++t) {
      const int64_t row = (t0 + t) * H_ + h;
      for (int64_t i = 0; i < dk_n; ++i) {
        const int64_t x = t * dk_n + i;
        const T dq_x = E_[x] * dQg_[x] + rowAq_[x];
        const T later = E_[x] * dW_[x] + rowA_[x];
        const T kb_part = Eb_[x] * dKb_[x];
        const T earlier = kb_part + colA_[x] + colAq_[x];
        dq[row * dk_n + i] = dq_x;
        dk[row * dk_n + i] = later + earlier;
        dG_[x] += Q_[x] * dq_x + K_[x] * (later - earlier);
        dG_last[i] += K_[x] * kb_part;
      }
      for (int64_t j = 0; j < dv_n; ++j) dv[row * dv_n + j] = dRb_[t * dv_n + j];
    }
    for (int64_t i = 0; i < dk_n; ++i) {
      T acc = 0;
      for (int64_t j = 0; j < dv_n; ++j) acc += S[i * dv_n + j] * dS_next[i * dv_n + j];
      dG_last[i] += last_[i] * acc;
    }
    // G_t = sum_{s<=t} g_s within the chunk: dg_t = sum_{r>=t} dG_r.
    for (int64_t i = 0; i < dk_n; ++i) {
      T acc = 0;
      for (int64_t t = n - 1; t >= 0; --t) {
        acc += dG_[t * dk_n + i];
        dg[((t0 + t) * H_ + h) * dk_n + i] = acc;
      }
    }
  }

 private:
  int64_t H_, dk_, dv_, n_ = 0;
  const T *q_, *k_, *v_, *g_, *beta_;
  std::vector<T> Q_, K_, G_, E_, Eb_, Qg_, W_, Kb_, V_, b_, last_, A_, Aq_, Tinv_, X_, R_, u_;
  std::vector<T> dO_, du_, dR_, dRb_, dA_, dAq_, dQg_, dW_, dKb_, rowA_, colA_, rowAq_, colAq_, dG_;
};

}  // namespace

template <class T>
void kda_chunked_backward(const KdaShape& s, const T* q, const T* k, const T* v, const T* g, const T* beta,
                          const T* dout, T* dq, T* dk, T* dv, T* dg, T* dbeta, int64_t chunk_size,
                          const KdaChunkStates<T>& chunk) {
  const int64_t H = s.heads, L = s.tokens, SS = s.key_dim * s.value_dim;
  const int64_t C = std::max<int64_t>(1, chunk_size);
  const int64_t chunks = (L + C - 1) / C;
  parallel_for(H, 1, [&](int64_t h0, int64_t h1) {
    KdaChunk<T> work(s, C, q, k, v, g, beta);
    std::vector<T> entries(static_cast<size_t>(chunks * SS)), state(static_cast<size_t>(SS));
    std::vector<T> dS(static_cast<size_t>(SS)), dS_entry(static_cast<size_t>(SS));
    for (int64_t h = h0; h < h1; ++h) {
      // The chunked forward, keeping each chunk's entry state (what the GPU's forward stores).
      if (chunk.initial != nullptr)
        std::copy(chunk.initial + h * SS, chunk.initial + (h + 1) * SS, state.begin());
      else
        std::fill(state.begin(), state.end(), T(0));
      for (int64_t c = 0; c + 1 < chunks; ++c) {
        std::copy(state.begin(), state.end(), entries.begin() + c * SS);
        work.load(h, c * C, std::min(C, L - c * C));
        work.solve(state.data());
        work.advance(state.data());
      }
      if (chunks > 0) std::copy(state.begin(), state.end(), entries.begin() + (chunks - 1) * SS);
      // The chunks in reverse, carrying only the state gradient.
      if (chunk.d_final != nullptr)
        std::copy(chunk.d_final + h * SS, chunk.d_final + (h + 1) * SS, dS.begin());
      else
        std::fill(dS.begin(), dS.end(), T(0));
      for (int64_t c = chunks - 1; c >= 0; --c) {
        const T* entry = entries.data() + c * SS;
        work.load(h, c * C, std::min(C, L - c * C));
        work.solve(entry);
        work.backward(entry, dS.data(), dout, h, c * C, dS_entry.data(), dq, dk, dv, dg, dbeta);
        std::swap(dS, dS_entry);
      }
      if (chunk.d_initial != nullptr) std::copy(dS.begin(), dS.end(), chunk.d_initial + h * SS);
    }
  });
}

#define SPINDLE_INSTANTIATE(T)                                                                             \
  template void kda_chunked_backward<T>(const KdaShape&, const T*, const T*, const T*, const T*, const T*, \
                                        const T*, T*, T*, T*, T*, T*, int64_t, const KdaChunkStates<T>&);
SPINDLE_INSTANTIATE(float)
SPINDLE_INSTANTIATE(double)
#undef SPINDLE_INSTANTIATE

}  // namespace spindle::cpu
