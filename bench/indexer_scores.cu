// The DSA indexer's scores and selection at a million tokens, GLM's indexer shape (32 heads x 128,
// k-pool 16, top 2048): a streamed chunk of queries near the end of the sequence against every
// pool before it (65536 at 1M), in query blocks as the executor runs them. Times, by CUDA events,
// the wgmma scorer (with the tile maxima, as the selection runs it), the mma.sync scorer alone and the
// whole selection (scores + top-k), each the median of a few launches, with the scores' TFLOP/s (2 x
// heads x head_dim per visible pool).
// zero_share (0 by default, in eighths): that share of the pools get all-zero keys, so that their
// scores are exactly 0 for every query, as a trained indexer's relu leaves many pools: the radix
// select's histograms then meet many equal keys in one bin, and rows with fewer positive tile
// maxima than chosen pools take it instead of the selection from the maxima.
//     build/bench_indexer_scores [tokens] [queries] [block] [zero_share]
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <vector>

#include "backend/cuda/check.h"
#include "backend/cuda/device_memory.h"
#include "indexer_inputs.cuh"
#include "kernels/cpu/dsa.h"
#include "kernels/cuda/indexer.h"

using namespace spindle;
using namespace spindle::cuda;

int main(int argc, char** argv) {
  const int64_t tokens = argc > 1 ? std::atoll(argv[1]) : 1048576;
  const int64_t queries = argc > 2 ? std::atoll(argv[2]) : 16384;
  const int64_t block = argc > 3 ? std::atoll(argv[3]) : 8192;
  const int zero_eighths = static_cast<int>(std::lround((argc > 4 ? std::atof(argv[4]) : 0.0) * 8));
  if (zero_eighths < 0 || zero_eighths > 8) {
    std::fprintf(stderr, "zero_share must be in [0, 1], got %s\n", argv[4]);
    return 2;
  }
  IndexerBenchInputs in = indexer_bench_inputs(tokens, queries, zero_eighths);
  const cpu::IndexerShape& s = in.shape;
  const int64_t pools = in.pools, heads = s.heads, dim = s.head_dim, kpool = s.kpool;
  const auto &q = in.q, &keys = in.keys, &weights = in.weights;
  // The selection's workspace: a block's scores, then its tile maxima.
  DeviceBuffer<float> scores((indexer_select_workspace_bytes(s, block) + 3) / 4, MemoryCategory::Workspace);
  unsigned* maxima = reinterpret_cast<unsigned*>(scores.data() + block * pools);
  DeviceBuffer<int32_t> selected(static_cast<size_t>(queries * s.width()), MemoryCategory::Activations);
  double flops = 0;
  for (int64_t t = s.first_query; t < s.first_query + block; ++t)
    flops += 2.0 * heads * dim * static_cast<double>(std::min(pools, (t + 1) / kpool));
  // indexer_scores with the tile maxima, as the selection runs it; the mma.sync scorer alone.
  const double wgmma = median_ms(
      [&] {
        indexer_scores(s, q.data(), keys.data(), weights.data(), s.first_query, block, scores.data(), maxima,
                       nullptr);
      },
      5);
  const double mma = median_ms(
      [&] {
        indexer_scores_mma(s, q.data(), keys.data(), weights.data(), s.first_query, block, scores.data(),
                           nullptr);
      },
      5);
  const double select = median_ms(
      [&] {
        indexer_select(s, q.data(), keys.data(), weights.data(), selected.data(), scores.data(),
                       scores.size() * sizeof(float), nullptr);
      },
      3);
  const double blocks = static_cast<double>((queries + block - 1) / block);
  std::printf(
      "indexer at %lld tokens (%lld pools, %d/8 of them zero), queries %lld .. %lld in blocks of %lld:\n"
      "  scores, one block: %s %.3f ms (%.0f TFLOP/s), mma.sync %.3f ms (%.0f TFLOP/s)\n"
      "  selection of all %lld queries (scores + top-k): %.3f ms; top-k about %.3f ms\n",
      static_cast<long long>(tokens), static_cast<long long>(pools), zero_eighths,
      static_cast<long long>(s.first_query), static_cast<long long>(tokens), static_cast<long long>(block),
      indexer_scorer(s), wgmma, flops / wgmma / 1e9, mma, flops / mma / 1e9, static_cast<long long>(queries),
      select, select - blocks * wgmma);
  return 0;
}
