// Log-probabilities of target tokens from logits, row by row (no vocabulary-wide buffers
// beyond the rows given).
#pragma once

#include <cstdint>

namespace spindle::cpu {

// out[r] = logits[r, target[r]] - logsumexp(logits[r, :]); logits: [rows, vocab].
template <class T>
void target_log_probs(const T* logits, const int32_t* target, T* out, int64_t rows, int64_t vocab);

}  // namespace spindle::cpu
