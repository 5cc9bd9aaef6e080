#include "eval/selection_overlap.h"

#include <algorithm>

#include "core/error.h"

namespace spindle {

namespace {

// The query's chosen pools, sorted, or nothing when it has fewer than `full`.
std::vector<int32_t> chosen(const std::vector<int32_t>& pools, int64_t full) {
  std::vector<int32_t> out;
  for (int32_t p : pools)
    if (p >= 0) out.push_back(p);
  if (static_cast<int64_t>(out.size()) != full) return {};
  std::sort(out.begin(), out.end());
  return out;
}

int64_t common(const std::vector<int32_t>& a, const std::vector<int32_t>& b) {
  std::vector<int32_t> both;
  std::set_intersection(a.begin(), a.end(), b.begin(), b.end(), std::back_inserter(both));
  return static_cast<int64_t>(both.size());
}

}  // namespace

SelectionOverlap selection_overlap(const std::vector<std::vector<int32_t>>& pools,
                                   const std::vector<int64_t>& latest, int64_t full,
                                   const std::vector<int64_t>& group_sizes) {
  check(full >= 1, "selection_overlap: pools per query must be >= 1, got ", full);
  check(latest.size() == pools.size(), "selection_overlap: ", latest.size(), " latest pools for ",
        pools.size(), " queries");
  check(!group_sizes.empty(), "selection_overlap: no group sizes");
  for (int64_t g : group_sizes) check(g >= 1, "selection_overlap: group size ", g, " (expected >= 1)");
  std::vector<std::vector<int32_t>> sets;
  for (const std::vector<int32_t>& q : pools) sets.push_back(chosen(q, full));
  const auto counts = [&](size_t q) { return !sets[q].empty(); };

  SelectionOverlap o;
  o.group_sizes = group_sizes;
  double jaccard = 0;
  int64_t pairs = 0, recent = 0;
  for (size_t q = 0; q < sets.size(); ++q) {
    if (!counts(q)) continue;
    ++o.queries;
    for (int32_t p : sets[q]) recent += p > latest[q] - 2 * full ? 1 : 0;
    if (q + 1 < sets.size() && counts(q + 1)) {
      const auto shared = static_cast<double>(common(sets[q], sets[q + 1]));
      jaccard += shared / (2.0 * static_cast<double>(full) - shared);
      ++pairs;
    }
  }
  o.consecutive_jaccard = pairs > 0 ? jaccard / static_cast<double>(pairs) : 0.0;
  int64_t pair_common = 0, pair_pools = 0;
  for (size_t q = 0; q + 1 < sets.size(); q += 2) {
    if (!counts(q) || !counts(q + 1)) continue;
    pair_common += common(sets[q], sets[q + 1]);
    pair_pools += full;
  }
  o.pair_shared = pair_pools > 0 ? static_cast<double>(pair_common) / static_cast<double>(pair_pools) : 0.0;
  o.recent_share = o.queries > 0 ? static_cast<double>(recent) / static_cast<double>(o.queries * full) : 0.0;
  std::vector<std::vector<int32_t>> distinct;
  int64_t lowest = 0;
  for (const std::vector<int32_t>& set : sets) {
    if (set.empty()) continue;
    distinct.push_back(set);
    lowest += set.back() == full - 1 ? 1 : 0;  // sorted, distinct, >= 0: exactly 0 .. full - 1
  }
  std::sort(distinct.begin(), distinct.end());
  o.distinct_selections = std::unique(distinct.begin(), distinct.end()) - distinct.begin();
  o.lowest_pools_share = o.queries > 0 ? static_cast<double>(lowest) / static_cast<double>(o.queries) : 0.0;
  for (int64_t g : group_sizes) {
    int64_t unions = 0, sum = 0;
    for (size_t first = 0; first + static_cast<size_t>(g) <= sets.size(); first += static_cast<size_t>(g)) {
      std::vector<int32_t> all;
      bool whole = true;
      for (size_t q = first; q < first + static_cast<size_t>(g); ++q) {
        whole = whole && counts(q);
        all.insert(all.end(), sets[q].begin(), sets[q].end());
      }
      if (!whole) continue;
      std::sort(all.begin(), all.end());
      unions += std::unique(all.begin(), all.end()) - all.begin();
      sum += g * full;
    }
    o.union_over_sum.push_back(sum > 0 ? static_cast<double>(unions) / static_cast<double>(sum) : 0.0);
  }
  return o;
}

}  // namespace spindle
