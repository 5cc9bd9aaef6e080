// The indexer scorer's split of its pool tiles over blockIdx.y (kernels/cuda/wave_splits.h), checked
// on the launches the streamed executor makes: GLM's indexer (k-pool 16, tiles of 64 pools, CTAs of
// 16 queries) over a million tokens in chunks of 16,384, in query blocks that fill a 1 GiB score
// tile (model/cuda/dsa.cpp), on the H100's and H200's 132 multiprocessors.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>

#include "kernels/cuda/wave_splits.h"

namespace {

using spindle::cuda::wave_filling_splits;

constexpr int64_t kSlots = 132, kSetup = 4;

int64_t tile_times(int64_t ctas, int64_t tiles, int64_t splits) {
  return spindle::cuda::wave_tile_times(ctas, tiles, splits, kSlots, kSetup);
}

// The share of the layer's launches' capacity (slots x tile-times) that its CTAs' tiles fill,
// with the splits chosen by `choose`.
template <class Choose>
double layer_fill(Choose choose) {
  const int64_t tokens = int64_t{1} << 20, chunk = 16384, tile_bytes = int64_t{1} << 30;
  double work = 0, capacity = 0;
  for (int64_t c0 = 0; c0 < tokens; c0 += chunk) {
    const int64_t end = c0 + chunk, pools = end / 16;
    const int64_t block = std::min(chunk, tile_bytes / (pools * 4));
    for (int64_t t0 = c0; t0 < end; t0 += block) {
      const int64_t rows = std::min(block, end - t0), ctas = (rows + 15) / 16;
      const int64_t tiles = (std::min(pools, (t0 + rows) / 16) + 63) / 64;
      work += static_cast<double>(ctas * tiles);
      capacity += static_cast<double>(kSlots * tile_times(ctas, tiles, choose(ctas, tiles)));
    }
  }
  return work / capacity;
}

TEST(WaveSplits, TheExecutorsScorerLaunchesFillTheirWaves) {
  const double split = layer_fill(
      [](int64_t ctas, int64_t tiles) { return wave_filling_splits(ctas, tiles, kSlots, kSetup); });
  const double unsplit = layer_fill([](int64_t, int64_t) { return int64_t{1}; });
  EXPECT_GT(split, 0.95);
  EXPECT_GT(split, unsplit + 0.1) << "unsplit " << unsplit;
}

TEST(WaveSplits, NoSplitChosenIsSlowerThanAnother) {
  for (const int64_t tiles : {1, 7, 64, 300, 1024})
    for (int64_t ctas = 1; ctas <= 600; ++ctas) {
      const int64_t chosen = wave_filling_splits(ctas, tiles, kSlots, kSetup);
      ASSERT_GE(chosen, 1);
      ASSERT_LE(chosen, std::max<int64_t>(1, std::min(kSlots, tiles)));
      for (int64_t other = 1; other <= std::min(kSlots, tiles); ++other)
        ASSERT_LE(tile_times(ctas, tiles, chosen), tile_times(ctas, tiles, other))
            << ctas << " CTAs of " << tiles << " tiles: " << chosen << " splits against " << other;
    }
}

TEST(WaveSplits, WholeWavesStayUnsplit) {
  EXPECT_EQ(wave_filling_splits(2 * kSlots, 1024, kSlots, kSetup), 1);
  EXPECT_EQ(wave_filling_splits(4 * kSlots, 880, kSlots, kSetup), 1);
}

}  // namespace
