// Selections to pool lists and back; see selection_pools.h. One thread per output value.
#include "backend/cuda/check.h"
#include "core/error.h"
#include "kernels/cuda/launch.cuh"
#include "kernels/cuda/selection_pools.h"

namespace spindle::cuda {

namespace {

constexpr int kThreads = 256;

// None: -1, 0xffff as uint16_t.
template <class Pool>
constexpr Pool kNoPool = static_cast<Pool>(-1);

template <class Pool>
__global__ void selection_to_pools_kernel(const int32_t* __restrict__ selected, Pool* __restrict__ pools,
                                          int64_t queries, int64_t per_query, int64_t width, int64_t kp) {
  wait_for_earlier_kernels();
  const int64_t i = static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x;
  if (i >= queries * per_query) return;
  const int64_t q = i / per_query, slot = i % per_query;
  const int32_t token = selected[q * width + slot * kp];
  pools[i] = token >= 0 ? static_cast<Pool>(token / kp) : kNoPool<Pool>;
}

// Slots below per_query * kp: the pools' tokens; then -1 up to topk; then the tail, tokens
// t + 1 - tail .. t of query t's own pool (tail = (t + 1) % kp), -1 past them.
template <class Pool>
__global__ void pools_to_selection_kernel(const Pool* __restrict__ pools, int32_t* __restrict__ selected,
                                          int64_t first_query, int64_t queries, int64_t per_query,
                                          int64_t width, int64_t kp, int64_t topk) {
  wait_for_earlier_kernels();
  const int64_t i = static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x;
  if (i >= queries * width) return;
  const int64_t q = i / width, slot = i % width;
  int32_t token = -1;
  if (slot < per_query * kp) {
    const Pool pool = pools[q * per_query + slot / kp];
    if (pool != kNoPool<Pool>) token = static_cast<int32_t>(pool * kp + slot % kp);
  } else if (slot >= topk) {
    const int64_t t = first_query + q, tail = (t + 1) % kp, j = slot - topk;
    if (j < tail) token = static_cast<int32_t>(t + 1 - tail + j);
  }
  selected[i] = token;
}

unsigned blocks(int64_t n) { return static_cast<unsigned>((n + kThreads - 1) / kThreads); }

}  // namespace

int64_t selection_pools_per_query(const cpu::IndexerShape& s) { return s.topk / s.kpool; }

bool pool_lists_fit_16_bits(const cpu::IndexerShape& s) { return s.tokens / s.kpool <= kNoPool<uint16_t>; }

template <class Pool>
void selection_to_pools(const cpu::IndexerShape& s, const int32_t* selected, Pool* pools,
                        cudaStream_t stream) {
  check(s.kpool >= 1 && s.topk >= 0, "selection_to_pools: kpool ", s.kpool, ", topk ", s.topk);
  const int64_t n = s.queries() * selection_pools_per_query(s);
  if (n == 0) return;
  check(sizeof(Pool) == 4 || pool_lists_fit_16_bits(s), "selection_to_pools: ", s.tokens / s.kpool,
        " pools do not fit 16 bits");
  launch_kernel(selection_to_pools_kernel<Pool>, blocks(n), kThreads, 0, stream, selected, pools, s.queries(),
                selection_pools_per_query(s), s.width(), s.kpool);
  SPINDLE_LAUNCHED("selection_to_pools_kernel");
}

template <class Pool>
void pools_to_selection(const cpu::IndexerShape& s, const Pool* pools, int32_t* selected,
                        cudaStream_t stream) {
  check(s.kpool >= 1 && s.topk >= 0, "pools_to_selection: kpool ", s.kpool, ", topk ", s.topk);
  const int64_t n = s.queries() * s.width();
  if (n == 0) return;
  launch_kernel(pools_to_selection_kernel<Pool>, blocks(n), kThreads, 0, stream, pools, selected,
                s.first_query, s.queries(), selection_pools_per_query(s), s.width(), s.kpool, s.topk);
  SPINDLE_LAUNCHED("pools_to_selection_kernel");
}

template void selection_to_pools(const cpu::IndexerShape&, const int32_t*, int32_t*, cudaStream_t);
template void selection_to_pools(const cpu::IndexerShape&, const int32_t*, uint16_t*, cudaStream_t);
template void pools_to_selection(const cpu::IndexerShape&, const int32_t*, int32_t*, cudaStream_t);
template void pools_to_selection(const cpu::IndexerShape&, const uint16_t*, int32_t*, cudaStream_t);

}  // namespace spindle::cuda
