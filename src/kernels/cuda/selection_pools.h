// A DSA layer's selection kept as its pool list. indexer_select writes, per query, the chosen pools
// in ascending order expanded to their kpool tokens, then the tail of the query's own pool, -1
// elsewhere (kernels/cuda/indexer.h); the pools alone, topk / kpool per query (-1 past the chosen
// ones), give it back exactly. The streaming executor keeps them from the forward, 1/16 of
// the selection's size at kpool 16, so that its backward's recomputation of a chunk needs no
// indexer. CPU reference: cpu::selection_to_pools and cpu::pools_to_selection (kernels/cpu/dsa.h).
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "kernels/cpu/dsa.h"

namespace spindle::cuda {

// Pools kept per query: topk / kpool.
int64_t selection_pools_per_query(const cpu::IndexerShape& s);

// Whether the pool lists of the queries up to s.tokens fit 16 bits: every pool below 65535, the
// value that stands for none (-1 as uint16_t); at kpool 16, up to 1,048,560 tokens. The streaming
// executor keeps them so, half the bytes of int32 (2.7 GiB less at 1M for the 4B config).
bool pool_lists_fit_16_bits(const cpu::IndexerShape& s);

// The queries s.first_query .. s.tokens: selected [queries, width] -> pools [queries, pools per
// query] (written). Pool: int32_t, or uint16_t where pool_lists_fit_16_bits.
template <class Pool>
void selection_to_pools(const cpu::IndexerShape& s, const int32_t* selected, Pool* pools,
                        cudaStream_t stream);

// The inverse: pools -> selected [queries, width] (written), the tail from each query's position.
template <class Pool>
void pools_to_selection(const cpu::IndexerShape& s, const Pool* pools, int32_t* selected,
                        cudaStream_t stream);

}  // namespace spindle::cuda
