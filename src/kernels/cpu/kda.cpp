#include "kernels/cpu/kda.h"

#include <algorithm>
#include <cmath>
#include <vector>

#include "core/parallel.h"
#include "kernels/cpu/norms.h"

namespace spindle::cpu {

template <class T>
void causal_conv_silu(const T* x, const T* w, T* y, int64_t tokens, int64_t channels, int64_t kernel) {
  parallel_for(tokens, 256, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      for (int64_t c = 0; c < channels; ++c) {
        T acc = 0;
        for (int64_t j = 0; j < kernel; ++j) {
          const int64_t src = t - (kernel - 1) + j;
          if (src >= 0) acc += w[c * kernel + j] * x[src * channels + c];
        }
        y[t * channels + c] = silu(acc);
      }
    }
  });
}

template <class T>
void kda_recurrence(const KdaShape& s, const T* q, const T* k, const T* v, const T* g, const T* beta, T* out,
                    T* state) {
  const int64_t H = s.heads, dk = s.key_dim, dv = s.value_dim;
  // Heads are independent: one thread walks the whole sequence of a head.
  parallel_for(H, 1, [&](int64_t h0, int64_t h1) {
    std::vector<T> kv(static_cast<size_t>(dv));
    for (int64_t h = h0; h < h1; ++h) {
      T* S = state + h * dk * dv;
      for (int64_t t = 0; t < s.tokens; ++t) {
        const T* qt = q + (t * H + h) * dk;
        const T* kt = k + (t * H + h) * dk;
        const T* vt = v + (t * H + h) * dv;
        const T* gt = g + (t * H + h) * dk;
        const T b = beta[t * H + h];
        for (int64_t i = 0; i < dk; ++i) {
          const T decay = std::exp(gt[i]);
          for (int64_t j = 0; j < dv; ++j) S[i * dv + j] *= decay;
        }
        for (int64_t j = 0; j < dv; ++j) kv[static_cast<size_t>(j)] = 0;
        for (int64_t i = 0; i < dk; ++i)
          for (int64_t j = 0; j < dv; ++j) kv[static_cast<size_t>(j)] += S[i * dv + j] * kt[i];
        for (int64_t j = 0; j < dv; ++j)
          kv[static_cast<size_t>(j)] = (vt[j] - kv[static_cast<size_t>(j)]) * b;
        for (int64_t i = 0; i < dk; ++i)
          for (int64_t j = 0; j < dv; ++j) S[i * dv + j] += kt[i] * kv[static_cast<size_t>(j)];
        T* ot = out + (t * H + h) * dv;
        for (int64_t j = 0; j < dv; ++j) ot[j] = 0;
        for (int64_t i = 0; i < dk; ++i)
          for (int64_t j = 0; j < dv; ++j) ot[j] += S[i * dv + j] * qt[i];
      }
    }
  });
}

template <class T>
void causal_conv_silu_backward(const T* x, const T* w, const T* dy, T* dx, T* dw, int64_t tokens,
                               int64_t channels, int64_t kernel) {
  // Pre-activation gradient first: da = dy * silu'(a).
  std::vector<T> da(static_cast<size_t>(tokens * channels));
  parallel_for(tokens, 256, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      for (int64_t c = 0; c < channels; ++c) {
        T a = 0;
        for (int64_t j = 0; j < kernel; ++j) {
          const int64_t src = t - (kernel - 1) + j;
          if (src >= 0) a += w[c * kernel + j] * x[src * channels + c];
        }
        const T sg = sigmoid(a);
        da[static_cast<size_t>(t * channels + c)] = dy[t * channels + c] * sg * (T(1) + a * (T(1) - sg));
      }
    }
  });
  parallel_for(channels, 16, [&](int64_t c0, int64_t c1) {
    for (int64_t c = c0; c < c1; ++c) {
      for (int64_t t = 0; t < tokens; ++t) {
        T acc = 0;
        for (int64_t j = 0; j < kernel; ++j) {
          const int64_t out = t + (kernel - 1) - j;  // the output that read x[t] through tap j
          if (out < tokens) acc += da[static_cast<size_t>(out * channels + c)] * w[c * kernel + j];
          const int64_t src = t - (kernel - 1) + j;
          if (src >= 0)
            dw[c * kernel + j] += da[static_cast<size_t>(t * channels + c)] * x[src * channels + c];
        }
        dx[t * channels + c] = acc;
      }
    }
  });
}

template <class T>
void kda_recurrence_backward(const KdaShape& s, const T* q, const T* k, const T* v, const T* g, const T* beta,
                             const T* dout, T* dq, T* dk, T* dv, T* dg, T* dbeta, int64_t checkpoint,
                             const KdaChunkStates<T>& chunk) {
  const int64_t H = s.heads, dk_ = s.key_dim, dv_ = s.value_dim, L = s.tokens, SS = dk_ * dv_;
  const int64_t C = std::max<int64_t>(1, checkpoint);
  const int64_t segments = (L + C - 1) / C;
  parallel_for(H, 1, [&](int64_t h0, int64_t h1) {
    std::vector<T> starts(static_cast<size_t>(segments * SS));  // state before each segment
    std::vector<T> states(static_cast<size_t>((C + 1) * SS)), decayed(static_cast<size_t>(SS));
    std::vector<T> dS(static_cast<size_t>(SS)), delta(static_cast<size_t>(dv_)), kv(static_cast<size_t>(dv_));
    std::vector<T> ddelta(static_cast<size_t>(dv_)), dkv(static_cast<size_t>(dv_));
    // One step of the forward rule from `prev` into `next`, also returning kv and delta.
    auto step = [&](int64_t t, int64_t h, const T* prev, T* next, T* kv_out, T* delta_out) {
      const T* kt = k + (t * H + h) * dk_;
      const T* vt = v + (t * H + h) * dv_;
      const T* gt = g + (t * H + h) * dk_;
      for (int64_t i = 0; i < dk_; ++i) {
        const T decay = std::exp(gt[i]);
        for (int64_t j = 0; j < dv_; ++j) next[i * dv_ + j] = prev[i * dv_ + j] * decay;
      }
      for (int64_t j = 0; j < dv_; ++j) kv_out[j] = 0;
      for (int64_t i = 0; i < dk_; ++i)
        for (int64_t j = 0; j < dv_; ++j) kv_out[j] += next[i * dv_ + j] * kt[i];
      for (int64_t j = 0; j < dv_; ++j) delta_out[j] = beta[t * H + h] * (vt[j] - kv_out[j]);
      for (int64_t i = 0; i < dk_; ++i)
        for (int64_t j = 0; j < dv_; ++j) next[i * dv_ + j] += kt[i] * delta_out[j];
    };
    for (int64_t h = h0; h < h1; ++h) {
      // Forward once, keeping the state at each segment start.
      if (chunk.initial != nullptr)
        std::copy(chunk.initial + h * SS, chunk.initial + (h + 1) * SS, states.begin());
      else
        std::fill(states.begin(), states.begin() + SS, T(0));
      for (int64_t seg = 0; seg < segments; ++seg) {
        std::copy(states.begin(), states.begin() + SS, starts.begin() + seg * SS);
        const int64_t t0 = seg * C, t1 = std::min(L, t0 + C);
        for (int64_t t = t0; t < t1; ++t) {
          step(t, h, states.data(), decayed.data(), kv.data(), delta.data());
          std::copy(decayed.begin(), decayed.end(), states.begin());
        }
      }
      if (chunk.d_final != nullptr)
        std::copy(chunk.d_final + h * SS, chunk.d_final + (h + 1) * SS, dS.begin());
      else
        std::fill(dS.begin(), dS.end(), T(0));
      for (int64_t seg = segments - 1; seg >= 0; --seg) {
        const int64_t t0 = seg * C, t1 = std::min(L, t0 + C);
        // Recompute the segment's states: states[n] is the state after token t0 + n - 1.
        std::copy(starts.begin() + seg * SS, starts.begin() + (seg + 1) * SS, states.begin());
        for (int64_t t = t0; t < t1; ++t)
          step(t, h, states.data() + (t - t0) * SS, states.data() + (t - t0 + 1) * SS, kv.data(),
               delta.data());
        for (int64_t t = t1 - 1; t >= t0; --t) {
          const T* prev = states.data() + (t - t0) * SS;
          const T* cur = states.data() + (t - t0 + 1) * SS;
          const T* qt = q + (t * H + h) * dk_;
          const T* kt = k + (t * H + h) * dk_;
          const T* vt = v + (t * H + h) * dv_;
          const T* gt = g + (t * H + h) * dk_;
          const T* ot = dout + (t * H + h) * dv_;
          const T b = beta[t * H + h];
          // o = S_t^T q.
          T* dqt = dq + (t * H + h) * dk_;
          for (int64_t i = 0; i < dk_; ++i) {
            T acc = 0;
            for (int64_t j = 0; j < dv_; ++j) {
              acc += cur[i * dv_ + j] * ot[j];
              dS[static_cast<size_t>(i * dv_ + j)] += qt[i] * ot[j];
            }
            dqt[i] = acc;
          }
          // Recover the decayed state, kv and delta of this step.
          for (int64_t i = 0; i < dk_; ++i) {
            const T decay = std::exp(gt[i]);
            for (int64_t j = 0; j < dv_; ++j)
              decayed[static_cast<size_t>(i * dv_ + j)] = prev[i * dv_ + j] * decay;
          }
          for (int64_t j = 0; j < dv_; ++j) {
            T acc = 0;
            for (int64_t i = 0; i < dk_; ++i) acc += decayed[static_cast<size_t>(i * dv_ + j)] * kt[i];
            kv[static_cast<size_t>(j)] = acc;
            delta[static_cast<size_t>(j)] = b * (vt[j] - acc);
          }
          // S_t = S_a + k delta^T.
          T* dkt = dk + (t * H + h) * dk_;
          for (int64_t j = 0; j < dv_; ++j) {
            T acc = 0;
            for (int64_t i = 0; i < dk_; ++i) acc += dS[static_cast<size_t>(i * dv_ + j)] * kt[i];
            ddelta[static_cast<size_t>(j)] = acc;
          }
          for (int64_t i = 0; i < dk_; ++i) {
            T acc = 0;
            for (int64_t j = 0; j < dv_; ++j)
              acc += dS[static_cast<size_t>(i * dv_ + j)] * delta[static_cast<size_t>(j)];
            dkt[i] = acc;
          }
          // delta = beta (v - kv).
          T db = 0;
          T* dvt = dv + (t * H + h) * dv_;
          for (int64_t j = 0; j < dv_; ++j) {
            dvt[j] = b * ddelta[static_cast<size_t>(j)];
            db += ddelta[static_cast<size_t>(j)] * (vt[j] - kv[static_cast<size_t>(j)]);
            dkv[static_cast<size_t>(j)] = -b * ddelta[static_cast<size_t>(j)];
          }
          dbeta[t * H + h] = db;
          // kv = S_a^T k.
          for (int64_t i = 0; i < dk_; ++i) {
            T acc = 0;
            for (int64_t j = 0; j < dv_; ++j) {
              acc += decayed[static_cast<size_t>(i * dv_ + j)] * dkv[static_cast<size_t>(j)];
              dS[static_cast<size_t>(i * dv_ + j)] += kt[i] * dkv[static_cast<size_t>(j)];
            }
            dkt[i] += acc;
          }
          // S_a = diag(exp(g)) S_{t-1}.
          T* dgt = dg + (t * H + h) * dk_;
          for (int64_t i = 0; i < dk_; ++i) {
            const T decay = std::exp(gt[i]);
            T acc = 0;
            for (int64_t j = 0; j < dv_; ++j) {
              acc += dS[static_cast<size_t>(i * dv_ + j)] * decayed[static_cast<size_t>(i * dv_ + j)];
              dS[static_cast<size_t>(i * dv_ + j)] *= decay;
            }
            dgt[i] = acc;
          }
        }
      }
      // dS is now the gradient of the state before the first token.
      if (chunk.d_initial != nullptr) std::copy(dS.begin(), dS.end(), chunk.d_initial + h * SS);
    }
  });
}

#define SPINDLE_INSTANTIATE(T)                                                                           \
  template void causal_conv_silu<T>(const T*, const T*, T*, int64_t, int64_t, int64_t);                  \
  template void kda_recurrence<T>(const KdaShape&, const T*, const T*, const T*, const T*, const T*, T*, \
                                  T*);                                                                   \
  template void causal_conv_silu_backward<T>(const T*, const T*, const T*, T*, T*, int64_t, int64_t,     \
                                             int64_t);                                                   \
  template void kda_recurrence_backward<T>(const KdaShape&, const T*, const T*, const T*, const T*,      \
                                           const T*, const T*, T*, T*, T*, T*, T*, int64_t,              \
                                           const KdaChunkStates<T>&);
SPINDLE_INSTANTIATE(float)
SPINDLE_INSTANTIATE(double)
#undef SPINDLE_INSTANTIATE

}  // namespace spindle::cpu
