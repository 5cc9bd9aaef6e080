// Kimi Delta Attention on the CPU: the short causal convolution and the gated delta rule,
// walked token by token with an fp32-or-better state (the chunked form computes the same
// function; this one is the plain statement of it).
#pragma once

#include <cstdint>

namespace spindle::cpu {

// y[t, c] = silu(sum_j w[c, j] * x[t - (K - 1) + j, c]), zeros before the first token.
template <class T>
void causal_conv_silu(const T* x, const T* w, T* y, int64_t tokens, int64_t channels, int64_t kernel);

struct KdaShape {
  int64_t tokens;
  int64_t heads;
  int64_t key_dim;    // dk
  int64_t value_dim;  // dv
};

// The delta rule per head with per-channel decay:
//   S = diag(exp(g_t)) S;  S += k_t (beta_t (v_t - S^T k_t))^T;  o_t = S^T q_t
// q, k: [tokens, heads, dk] (q already scaled); v: [tokens, heads, dv]; g: [tokens, heads, dk]
// (log decay); beta: [tokens, heads]; out: [tokens, heads, dv]; state: [heads, dk, dv], updated.
template <class T>
void kda_recurrence(const KdaShape& s, const T* q, const T* k, const T* v, const T* g, const T* beta, T* out,
                    T* state);

// Backward of causal_conv_silu: dx written, dw accumulated.
template <class T>
void causal_conv_silu_backward(const T* x, const T* w, const T* dy, T* dx, T* dw, int64_t tokens,
                               int64_t channels, int64_t kernel);

// A chunk of a longer sequence (the streaming executor), each [heads, dk, dv] or null: the state
// the chunk starts from (null: zero), the gradient reaching its final state from later chunks
// (null: zero), and where to write the gradient of its initial state (null: not wanted).
template <class T>
struct KdaChunkStates {
  const T* initial = nullptr;
  const T* d_final = nullptr;
  T* d_initial = nullptr;
};

// Backward of kda_recurrence: walks the sequence in reverse carrying the state gradient. States
// are kept only every `checkpoint` tokens and recomputed within each segment, so memory is
// O(tokens / checkpoint + checkpoint) states, never tokens x tokens. Writes dq, dk, dv, dg, dbeta.
template <class T>
void kda_recurrence_backward(const KdaShape& s, const T* q, const T* k, const T* v, const T* g, const T* beta,
                             const T* dout, T* dq, T* dk, T* dv, T* dg, T* dbeta, int64_t checkpoint = 64,
                             const KdaChunkStates<T>& chunk = {});

}  // namespace spindle::cpu
