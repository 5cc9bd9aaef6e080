// How unevenly a MoE layer's routed experts are loaded. The streaming executor runs the MoE a
// chunk of tokens at a time, so a per-expert row buffer must hold the busiest expert of the worst
// chunk, not the mean: these statistics measure both, over a whole sequence and chunk by chunk.
#pragma once

#include <cstdint>
#include <span>
#include <vector>

namespace spindle {

// One set of per-expert counts (rows routed to each expert: tokens x top-k in all).
struct LoadStats {
  int64_t rows = 0;          // all experts' rows
  int64_t busiest = 0;       // the busiest expert's rows
  double max_over_mean = 0;  // busiest / (rows / experts); 1 when perfectly even
  double cv = 0;             // coefficient of variation: population standard deviation / mean
  double idle_fraction = 0;  // experts with no rows / experts
};

// Fails on no experts, a negative count, or no rows at all (the ratios would be undefined).
LoadStats load_stats(std::span<const int64_t> counts);

// One MoE layer over a sequence, from its counts chunk by chunk ([chunk][expert]).
struct LayerLoad {
  LoadStats sequence;     // the chunks' counts summed
  LoadStats worst_chunk;  // the chunk with the highest max_over_mean (first on a tie)
  int64_t worst_chunk_index = 0;
  double mean_chunk_max_over_mean = 0;
  double max_chunk_idle_fraction = 0;
  // The most rows one expert took in one chunk: what a chunk's per-expert buffer must hold. Not
  // always the worst chunk's busiest expert, when the last chunk is shorter.
  int64_t peak_chunk_rows = 0;
};

// Fails on no chunks or chunks of different expert counts.
LayerLoad layer_load(const std::vector<std::vector<int64_t>>& chunks);

}  // namespace spindle
