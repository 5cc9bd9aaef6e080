// The gated delta rule's backward in chunk form: the CPU statement of what a tensor-core GPU
// backward computes. Within a chunk every step is a small dense product (C x C, C x dk, C x dv,
// dk x dv); only the [dk, dv] state gradient passes from one chunk to the one before it.
// docs/KDA.md has the equations.
#pragma once

#include <cstdint>

#include "kernels/cpu/kda.h"

namespace spindle::cpu {

// Backward of kda_recurrence with the contract of kda_recurrence_backward (same inputs, outputs
// and KdaChunkStates), computed in chunks of `chunk_size` tokens: the chunks' entry states first
// (the chunked forward), then the chunks in reverse, each from its entry state, its dout and the
// gradient of the state leaving it.
template <class T>
void kda_chunked_backward(const KdaShape& s, const T* q, const T* k, const T* v, const T* g, const T* beta,
                          const T* dout, T* dq, T* dk, T* dv, T* dg, T* dbeta, int64_t chunk_size = 64,
                          const KdaChunkStates<T>& chunk = {});

}  // namespace spindle::cpu
