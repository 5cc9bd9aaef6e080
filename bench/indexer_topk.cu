// The DSA indexer's top-k alone (indexer_topk) at long context, GLM's indexer shape (32 heads x 128,
// k-pool 16, top 2048): the last `queries` queries of a `tokens` sequence, each against every pool
// before it (65,536 at 1M), on scores the scorer made once from random inputs. Times by CUDA events
// (median of 5 launches) the top-k from the tile maxima (which the scorer writes in the model, so
// the maxima kernel that makes them from the scores is timed apart) and the radix select alone,
// with the rate at which each covers the rows' scores, and prints a digest of the selection (the
// same from both, checked), so that two builds can be compared for speed and for equal outputs.
// zero_share (0 by default, in eighths): that share of the pools get all-zero keys, so that their
// scores are exactly 0 for every query, as a trained indexer's relu leaves many pools.
//     build/bench_indexer_topk [tokens] [queries] [zero_share]
// e.g. 1048576 8192 (one query block at 1M), 262144 8192, 32768 8192.
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <utility>

#include "backend/cuda/check.h"
#include "backend/cuda/device_memory.h"
#include "indexer_inputs.cuh"
#include "kernels/cpu/dsa.h"
#include "kernels/cuda/indexer.h"

using namespace spindle;
using namespace spindle::cuda;

int main(int argc, char** argv) {
  const int64_t tokens = argc > 1 ? std::atoll(argv[1]) : 1048576;
  const int64_t queries = argc > 2 ? std::atoll(argv[2]) : 8192;
  const int zero_eighths = static_cast<int>(std::lround((argc > 3 ? std::atof(argv[3]) : 0.0) * 8));
  if (zero_eighths < 0 || zero_eighths > 8 || queries < 1 || queries > tokens) {
    std::fprintf(stderr, "expected 1 <= queries <= tokens and zero_share in [0, 1]\n");
    return 2;
  }
  IndexerBenchInputs in = indexer_bench_inputs(tokens, queries, zero_eighths);
  const cpu::IndexerShape& s = in.shape;
  const int64_t pools = in.pools, kpool = s.kpool;
  const auto &q = in.q, &keys = in.keys, &weights = in.weights;
  DeviceBuffer<float> scores(static_cast<size_t>(std::max<int64_t>(queries * pools, 1)),
                             MemoryCategory::Workspace);
  DeviceBuffer<unsigned> maxima(static_cast<size_t>(std::max<int64_t>(queries * indexer_tiles(s), 1)),
                                MemoryCategory::Workspace);
  DeviceBuffer<int32_t> selected(static_cast<size_t>(queries * s.width()), MemoryCategory::Activations);
  indexer_scores(s, q.data(), keys.data(), weights.data(), s.first_query, queries, scores.data(), nullptr,
                 nullptr);
  double bytes = 0;  // the visible scores, each read at least once
  for (int64_t t = s.first_query; t < tokens; ++t)
    bytes += 4.0 * static_cast<double>(std::min(pools, (t + 1) / kpool));
  const double maxima_ms = median_ms(
      [&] { indexer_tile_maxima(s, scores.data(), s.first_query, queries, maxima.data(), nullptr); }, 5);
  const auto topk = [&](const unsigned* m) {
    const double ms = median_ms(
        [&] { indexer_topk(s, scores.data(), m, s.first_query, queries, selected.data(), nullptr); }, 5);
    return std::make_pair(ms, bits_digest(selected.data(), queries * s.width()));
  };
  const auto [radix_ms, radix_digest] = topk(nullptr);
  const auto [ms, digest] = topk(maxima.data());
  std::printf(
      "indexer top-k at %lld tokens (%lld pools, %d/8 of them zero), queries %lld .. %lld: %.3f ms from the "
      "tile maxima, %.0f GB/s of visible scores (maxima from the scores %.3f ms); radix select alone %.3f "
      "ms, %.0f GB/s; selection digest %016llx\n",
      static_cast<long long>(tokens), static_cast<long long>(pools), zero_eighths,
      static_cast<long long>(s.first_query), static_cast<long long>(tokens), ms, bytes / ms / 1e6, maxima_ms,
      radix_ms, bytes / radix_ms / 1e6, static_cast<unsigned long long>(digest));
  if (digest != radix_digest) {
    std::fprintf(stderr,
                 "the selections differ: %016llx from the tile maxima, %016llx from the radix select\n",
                 static_cast<unsigned long long>(digest), static_cast<unsigned long long>(radix_digest));
    return 1;
  }
  return 0;
}
