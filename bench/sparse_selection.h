// The benches' sparse attention selections, as the streaming executor runs them at the end of a long
// sequence: query `first + i` selects `pools` distinct complete pools of `kpool` rows before it
// (drawn once per group of `share` neighbouring queries, among those the group's first query
// sees), ascending, then its own incomplete pool's rows (the tail). Rows past a query's selection
// are -1. GLM's shape: 128 pools of 16, 2,063 rows a query.
#pragma once

#include <algorithm>
#include <cstdint>
#include <random>
#include <vector>

namespace spindle {

inline std::vector<int32_t> random_pool_selection(int64_t first, int64_t queries, int64_t pools,
                                                  int64_t kpool, int64_t share, uint64_t seed) {
  const int64_t width = pools * kpool + kpool - 1;
  std::vector<int32_t> selected(static_cast<size_t>(queries * width), -1);
  std::mt19937_64 rng(seed);
  std::vector<int32_t> chosen;
  for (int64_t i = 0; i < queries; ++i) {
    const int64_t t = first + i, visible = (first + i / share * share + 1) / kpool;
    if (i % share == 0) {
      chosen.clear();
      std::uniform_int_distribution<int64_t> pick(0, visible - 1);
      while (static_cast<int64_t>(chosen.size()) < std::min(pools, visible)) {
        const auto p = static_cast<int32_t>(pick(rng));
        if (std::find(chosen.begin(), chosen.end(), p) == chosen.end()) chosen.push_back(p);
      }
      std::sort(chosen.begin(), chosen.end());
    }
    int32_t* row = selected.data() + i * width;
    for (size_t k = 0; k < chosen.size(); ++k)
      for (int64_t j = 0; j < kpool; ++j) row[k * kpool + j] = static_cast<int32_t>(chosen[k] * kpool + j);
    for (int64_t j = 0; j < (t + 1) % kpool; ++j)
      row[pools * kpool + j] = static_cast<int32_t>(t + 1 - (t + 1) % kpool + j);
  }
  return selected;
}

}  // namespace spindle
