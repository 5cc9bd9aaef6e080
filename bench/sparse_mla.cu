// MLA's absorbed sparse attention at a million tokens, GLM's shape (32 heads, a 512-wide latent as
// key and value, 2048 selected + 15 tail rows per query): a streamed chunk of queries at the end of
// the sequence, each selecting 128 random 16-row pools of the latent before it plus its tail, as
// the executor runs them. Times, by CUDA events (median of a few launches), the forward and the
// backward, with the forward's FLOP rate (2 x heads x (dk + dv) per selected row) and the
// backward's time against the forward's. `share` > 1: groups of that many neighbouring queries
// select the same pools (as a trained indexer's neighbours might), to see how much of the gather
// and of the gradient's atomics the L2 then absorbs (both kernels are DRAM-bound, docs/PERF.md).
//     build/bench_sparse_mla [tokens] [queries] [share]
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <vector>

#include "backend/cuda/check.h"
#include "backend/cuda/device_memory.h"
#include "cuda_timing.cuh"
#include "kernels/cuda/sparse_mla.h"
#include "kernels/cuda/sparse_mla_hopper.h"
#include "sparse_selection.h"

using namespace spindle;
using namespace spindle::cuda;

int main(int argc, char** argv) {
  const int64_t tokens = argc > 1 ? std::atoll(argv[1]) : 1048576;
  const int64_t queries = argc > 2 ? std::atoll(argv[2]) : 16384;
  const int64_t share = argc > 3 ? std::max<int64_t>(1, std::atoll(argv[3])) : 1;
  const int64_t heads = 32, dim = 512, kpool = 16, pools = 128, tail = kpool - 1,
                width = pools * kpool + tail;
  const int64_t first = tokens - queries;
  const std::vector<int32_t> selected = random_pool_selection(first, queries, pools, kpool, share, 7);
  // The queries' rows of the latent sit at their positions; q, dout and the outputs per query.
  auto latent = random_bf16(tokens * dim, 1), q = random_bf16(queries * heads * dim, 2),
       dout = random_bf16(queries * heads * dim, 3);
  DeviceBuffer<int32_t> selection(selected.size(), MemoryCategory::Activations);
  selection.upload(selected);
  DeviceBuffer<__nv_bfloat16> out(static_cast<size_t>(queries * heads * dim), MemoryCategory::Activations),
      dq(static_cast<size_t>(queries * heads * dim), MemoryCategory::Activations);
  DeviceBuffer<float> lse(static_cast<size_t>(queries * heads), MemoryCategory::Activations),
      d_latent(static_cast<size_t>(tokens * dim), MemoryCategory::Gradients);
  SPINDLE_CUDA(cudaDeviceSynchronize());
  // The kernels index the latent by absolute token and the queries from 0: the latent and its
  // gradient are passed whole, the queries' shape is `queries` long.
  const SparseMlaShape s{queries, heads, dim, dim, width, dim, 1.0f / std::sqrt(static_cast<float>(dim))};
  const double forward = median_ms(
      [&] {
        sparse_mla_forward(s, q.data(), latent.data(), selection.data(), out.data(), lse.data(), nullptr);
      },
      5);
  const double mma = median_ms(
      [&] {
        sparse_mla_backward(s, q.data(), latent.data(), selection.data(), out.data(), lse.data(), dout.data(),
                            dq.data(), d_latent.data(), nullptr);
      },
      5);
  const double flops =
      2.0 * static_cast<double>(heads) * 2 * dim * static_cast<double>(pools * kpool) * queries;
  std::printf(
      "sparse MLA at %lld tokens, queries %lld .. %lld (32 heads, latent 512, %lld selected rows each, "
      "the same pools for groups of %lld neighbours):\n"
      "  forward (wgmma) %.3f ms (%.0f TFLOP/s)\n"
      "  backward (mma.sync) %.3f ms (%.2fx the forward)\n",
      static_cast<long long>(tokens), static_cast<long long>(first), static_cast<long long>(tokens),
      static_cast<long long>(width), static_cast<long long>(share), forward, flops / forward / 1e9, mma,
      mma / forward);
  return 0;
}
