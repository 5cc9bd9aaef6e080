// How many ways a launch splits each CTA's walk over its tiles (over blockIdx.y), for kernels that
// fit one CTA per multiprocessor and give every CTA about the same tiles: the indexer's scorer.
// Host-only arithmetic, so that a CPU test checks it.
#pragma once

#include <algorithm>
#include <cstdint>

namespace spindle::cuda {

// The tile-times a launch of `ctas` CTAs of `tiles` tiles each takes with each CTA's walk split
// `splits` ways, `slots` CTAs resident at a time: its waves, ceil(ctas * splits / slots), each as
// long as a CTA's share, ceil(tiles / splits), plus its setup (about `setup_tiles`: its own operands
// loaded and its pipeline filled).
constexpr int64_t wave_tile_times(int64_t ctas, int64_t tiles, int64_t splits, int64_t slots,
                                  int64_t setup_tiles) {
  return (ctas * splits + slots - 1) / slots * ((tiles + splits - 1) / splits + setup_tiles);
}

// The splits (1 .. min(slots, tiles)) whose wave_tile_times are fewest; ties go to fewer splits.
// Unsplit, a block of the executor's at 900k tokens (299 CTAs of 880 tiles over 132
// multiprocessors: 2.26 waves) would leave three quarters of its last wave idle.
constexpr int64_t wave_filling_splits(int64_t ctas, int64_t tiles, int64_t slots, int64_t setup_tiles) {
  const auto time = [&](int64_t splits) { return wave_tile_times(ctas, tiles, splits, slots, setup_tiles); };
  int64_t best = 1;
  for (int64_t splits = 2; splits <= std::min(slots, tiles); ++splits)
    if (time(splits) < time(best)) best = splits;
  return best;
}

}  // namespace spindle::cuda
