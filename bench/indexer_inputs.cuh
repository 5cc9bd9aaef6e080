// The indexer benches' inputs: GLM's indexer shape (32 heads x 128, k-pool 16, top 2048), the last
// `queries` queries of a `tokens` sequence, random q, pooled keys and head weights. zero_eighths of
// every 8 pools (those with p % 8 < zero_eighths) get all-zero keys, so that their scores are
// exactly 0 for every query, as a trained indexer's relu leaves many pools.
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "backend/cuda/check.h"
#include "backend/cuda/device_memory.h"
#include "cuda_timing.cuh"
#include "kernels/cpu/dsa.h"

struct IndexerBenchInputs {
  spindle::cpu::IndexerShape shape;
  int64_t pools;
  spindle::cuda::DeviceBuffer<__nv_bfloat16> q, keys, weights;
};

inline IndexerBenchInputs indexer_bench_inputs(int64_t tokens, int64_t queries, int zero_eighths) {
  const int64_t heads = 32, dim = 128, kpool = 16, topk = 2048;
  spindle::cpu::IndexerShape s{tokens, heads, dim, kpool, topk, true};
  s.first_query = tokens - queries;
  const int64_t pools = s.complete_pools();
  using spindle::cuda::random_bf16;
  IndexerBenchInputs in{s, pools, random_bf16(queries * heads * dim, 1), random_bf16(pools * dim, 2),
                        random_bf16(queries * heads, 3)};
  if (zero_eighths > 0) {
    const size_t row = dim * sizeof(__nv_bfloat16);
    SPINDLE_CUDA(
        cudaMemset2D(in.keys.data(), 8 * row, 0, zero_eighths * row, static_cast<size_t>(pools / 8)));
  }
  return in;
}
