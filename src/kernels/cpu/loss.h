// Log-probabilities of target tokens from logits, row by row (no vocabulary-wide buffers
// beyond the rows given).
#pragma once

#include <cstdint>

namespace spindle::cpu {

// out[r] = logits[r, target[r]] - logsumexp(logits[r, :]); logits: [rows, vocab].
template <class T>
void target_log_probs(const T* logits, const int32_t* target, T* out, int64_t rows, int64_t vocab);

// Gradient of -scale * sum_r log p(target[r]) with respect to the logits: written in place of the
// logits (softmax - one-hot) * scale. Returns the sum of the rows' log-probs.
template <class T>
double target_log_probs_backward(T* logits, const int32_t* target, int64_t rows, int64_t vocab, T scale);

}  // namespace spindle::cpu
