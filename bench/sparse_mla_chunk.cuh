// What the sparse MLA benches share: one streamed chunk of queries at the end of a long sequence,
// GLM's shape (32 heads, a 512-wide latent as key and value, 128 pools of 16 rows plus the tail:
// 2,063 selected rows a query), as the executor runs it. Query `first + i` selects 128 distinct
// complete pools before it (drawn once per group of `share` neighbouring queries, among those the
// group's first query sees), ascending, then its own incomplete pool's rows.
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <random>
#include <vector>

#include "backend/cuda/check.h"
#include "backend/cuda/device_memory.h"
#include "cuda_timing.cuh"
#include "kernels/cuda/sparse_mla.h"

namespace spindle::cuda {

struct SparseMlaChunk {
  static constexpr int64_t kHeads = 32, kDim = 512, kPool = 16, kPools = 128,
                           kWidth = kPools * kPool + kPool - 1;

  SparseMlaChunk(int64_t tokens, int64_t queries, int64_t share)
      : tokens(tokens),
        queries(queries),
        first(tokens - queries),
        // The kernels index the latent by absolute token and the queries from 0: the latent and its
        // gradient are whole, the queries' shape is `queries` long.
        shape{queries, kHeads, kDim, kDim, kWidth, kDim, 1.0f / std::sqrt(static_cast<float>(kDim))},
        latent(random_bf16(tokens * kDim, 1)),
        q(random_bf16(queries * kHeads * kDim, 2)),
        dout(random_bf16(queries * kHeads * kDim, 3)),
        out(static_cast<size_t>(queries * kHeads * kDim), MemoryCategory::Activations),
        dq(static_cast<size_t>(queries * kHeads * kDim), MemoryCategory::Activations),
        selection(static_cast<size_t>(queries * kWidth), MemoryCategory::Activations),
        lse(static_cast<size_t>(queries * kHeads), MemoryCategory::Activations),
        d_latent(static_cast<size_t>(tokens * kDim), MemoryCategory::Gradients),
        mass(static_cast<size_t>(queries * kWidth), MemoryCategory::Activations) {
    std::vector<int32_t> selected(static_cast<size_t>(queries * kWidth), -1);
    std::mt19937_64 rng(7);
    std::vector<int32_t> chosen;
    for (int64_t i = 0; i < queries; ++i) {
      const int64_t t = first + i, visible = (first + i / share * share + 1) / kPool;
      if (i % share == 0) {
        chosen.clear();
        std::uniform_int_distribution<int64_t> pick(0, visible - 1);
        while (static_cast<int64_t>(chosen.size()) < std::min(kPools, visible)) {
          const auto p = static_cast<int32_t>(pick(rng));
          if (std::find(chosen.begin(), chosen.end(), p) == chosen.end()) chosen.push_back(p);
        }
        std::sort(chosen.begin(), chosen.end());
      }
      int32_t* row = selected.data() + i * kWidth;
      for (size_t k = 0; k < chosen.size(); ++k)
        for (int64_t j = 0; j < kPool; ++j) row[k * kPool + j] = static_cast<int32_t>(chosen[k] * kPool + j);
      for (int64_t j = 0; j < (t + 1) % kPool; ++j)
        row[kPools * kPool + j] = static_cast<int32_t>(t + 1 - (t + 1) % kPool + j);
    }
    selection.upload(selected);
    SPINDLE_CUDA(cudaDeviceSynchronize());
  }

  void forward(cudaStream_t stream) {
    sparse_mla_forward(shape, q.data(), latent.data(), selection.data(), out.data(), lse.data(), stream);
  }
  // On wgmma (what sparse_mla_backward runs for this shape: pairs of queries that share their rows
  // together), with the attention mass by slot (the indexer's KL training) or without, and one query
  // a CTA on mma.sync.
  void backward(cudaStream_t stream, bool with_mass = false) {
    if (with_mass) SPINDLE_CUDA(cudaMemsetAsync(mass.data(), 0, mass.size() * sizeof(float), stream));
    sparse_mla_backward(shape, q.data(), latent.data(), selection.data(), out.data(), lse.data(), dout.data(),
                        dq.data(), d_latent.data(), with_mass ? mass.data() : nullptr, stream);
  }
  void backward_mma(cudaStream_t stream) {
    sparse_mla_backward_mma(shape, q.data(), latent.data(), selection.data(), out.data(), lse.data(),
                            dout.data(), dq.data(), d_latent.data(), nullptr, stream);
  }

  int64_t tokens, queries, first;
  SparseMlaShape shape;
  DeviceBuffer<__nv_bfloat16> latent, q, dout, out, dq;
  DeviceBuffer<int32_t> selection;
  DeviceBuffer<float> lse, d_latent, mass;
};

}  // namespace spindle::cuda
