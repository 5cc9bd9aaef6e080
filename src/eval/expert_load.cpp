#include "eval/expert_load.h"

#include <algorithm>
#include <cmath>

#include "core/error.h"

namespace spindle {

LoadStats load_stats(std::span<const int64_t> counts) {
  check(!counts.empty(), "expert load: no experts");
  LoadStats s;
  int64_t idle = 0;
  for (int64_t n : counts) {
    check(n >= 0, "expert load: negative count ", n);
    s.rows += n;
    s.busiest = std::max(s.busiest, n);
    idle += n == 0 ? 1 : 0;
  }
  check(s.rows > 0, "expert load: no rows routed to any of ", counts.size(), " experts");
  const auto experts = static_cast<double>(counts.size());
  const double mean = static_cast<double>(s.rows) / experts;
  double square_sum = 0;
  for (int64_t n : counts) square_sum += (static_cast<double>(n) - mean) * (static_cast<double>(n) - mean);
  s.max_over_mean = static_cast<double>(s.busiest) / mean;
  s.cv = std::sqrt(square_sum / experts) / mean;
  s.idle_fraction = static_cast<double>(idle) / experts;
  return s;
}

LayerLoad layer_load(const std::vector<std::vector<int64_t>>& chunks) {
  check(!chunks.empty(), "expert load: no chunks");
  const size_t experts = chunks.front().size();
  std::vector<int64_t> total(experts, 0);
  LayerLoad layer;
  double ratio_sum = 0;
  for (size_t c = 0; c < chunks.size(); ++c) {
    check(chunks[c].size() == experts, "expert load: chunk ", c, " has ", chunks[c].size(),
          " experts, chunk 0 has ", experts);
    for (size_t e = 0; e < experts; ++e) total[e] += chunks[c][e];
    const LoadStats s = load_stats(chunks[c]);
    ratio_sum += s.max_over_mean;
    layer.max_chunk_idle_fraction = std::max(layer.max_chunk_idle_fraction, s.idle_fraction);
    layer.peak_chunk_rows = std::max(layer.peak_chunk_rows, s.busiest);
    if (c == 0 || s.max_over_mean > layer.worst_chunk.max_over_mean) {
      layer.worst_chunk = s;
      layer.worst_chunk_index = static_cast<int64_t>(c);
    }
  }
  layer.sequence = load_stats(total);
  layer.mean_chunk_max_over_mean = ratio_sum / static_cast<double>(chunks.size());
  return layer;
}

}  // namespace spindle
