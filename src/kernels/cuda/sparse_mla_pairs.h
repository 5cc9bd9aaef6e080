// The first pass of the sparse MLA kernels that take neighbouring queries in pairs (the wgmma
// forward, sparse_mla_hopper.h, and backward, sparse_mla_backward_hopper.h): for each pair (queries
// 2p, 2p + 1) whether it walks the union of its selections together and, where it does, that list,
// each slot marked with the queries that chose its row.
//
// Together needs both selections in the indexer's layout (valid rows first, strictly ascending),
// and the union at most `share_limit` times the wider selection: a tile of it then serves both
// queries, where apart each would gather and compute its own. The list is the union in ascending
// order, so that the slot of a row in either selection is the number of that query's marks before
// it. Apart, the kernels read each query's selection itself.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "backend/cuda/device_memory.h"

namespace spindle::cuda {

// A list slot: the row, and the bits of the queries that selected it (-1: unused).
constexpr int32_t kInFirst = 1 << 30, kInSecond = 1 << 29, kRowMask = kInSecond - 1;

// What the kernels read of a call's lists.
struct PairListView {
  const int32_t* lists = nullptr;     // [pairs][stride]
  const int32_t* lengths = nullptr;   // [pairs]: 0 for a pair apart
  const int32_t* together = nullptr;  // [pairs]: 1 where the pair walks its list together
  int64_t stride = 0;
};

struct PairLists {
  DeviceBuffer<int32_t> workspace;  // the lists, then the lengths, then the flags
  PairListView view;
};

// Bytes of a call's lists for `tokens` queries of `width` slots (the planner counts the same:
// plan/sublayer_memory.cpp).
int64_t pair_list_bytes(int64_t tokens, int64_t width);

// The lists of every pair of selected ([tokens][width] int32), on `stream`. share_limit: the
// largest union, in units of the wider selection, that a pair walks together. Where the lists
// cannot be built (a width over 16,384, rows past the marks' bits) every pair goes apart.
PairLists pair_lists(const int32_t* selected, int64_t width, int64_t tokens, double share_limit,
                     cudaStream_t stream);

}  // namespace spindle::cuda
