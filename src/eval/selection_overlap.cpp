#include "eval/selection_overlap.h"

#include <algorithm>
#include <cstdint>
#include <utility>

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

// How many different sets `sets` holds among the non-empty ones: by a hash of each, sorted, then the
// sets of equal hashes compared (a run of equal hashes is one set but for a collision), so that a
// million queries' selections (a 1M-token sequence) take seconds, not a sort of the sets themselves.
int64_t distinct_sets(const std::vector<std::vector<int32_t>>& sets) {
  std::vector<std::pair<uint64_t, size_t>> keyed;
  for (size_t q = 0; q < sets.size(); ++q) {
    if (sets[q].empty()) continue;
    uint64_t h = 14695981039346656037ull;  // FNV-1a over the pool numbers
    for (int32_t p : sets[q]) h = (h ^ static_cast<uint32_t>(p)) * 1099511628211ull;
    keyed.emplace_back(h, q);
  }
  std::sort(keyed.begin(), keyed.end());
  int64_t distinct = 0;
  std::vector<size_t> seen;  // within a run of equal hashes: one query of each set met
  for (size_t i = 0; i < keyed.size(); ++i) {
    if (i == 0 || keyed[i].first != keyed[i - 1].first) seen.clear();
    const std::vector<int32_t>& set = sets[keyed[i].second];
    if (std::none_of(seen.begin(), seen.end(), [&](size_t q) { return sets[q] == set; })) {
      seen.push_back(keyed[i].second);
      ++distinct;
    }
  }
  return distinct;
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
  int64_t lowest = 0, largest = -1;
  for (const std::vector<int32_t>& set : sets) {
    if (set.empty()) continue;
    lowest += set.back() == full - 1 ? 1 : 0;  // sorted, distinct, >= 0: exactly 0 .. full - 1
    largest = std::max<int64_t>(largest, set.back());
  }
  o.distinct_selections = distinct_sets(sets);
  o.lowest_pools_share = o.queries > 0 ? static_cast<double>(lowest) / static_cast<double>(o.queries) : 0.0;
  // Each group's union by marking its pools with the group's number: linear in the pools.
  std::vector<int64_t> marked(static_cast<size_t>(largest + 1), -1);
  int64_t group_number = 0;
  for (int64_t g : group_sizes) {
    int64_t unions = 0, sum = 0;
    for (size_t first = 0; first + static_cast<size_t>(g) <= sets.size(); first += static_cast<size_t>(g)) {
      const size_t end = first + static_cast<size_t>(g);
      bool whole = true;
      for (size_t q = first; q < end && whole; ++q) whole = counts(q);
      if (!whole) continue;
      for (size_t q = first; q < end; ++q)
        for (int32_t p : sets[q])
          if (marked[static_cast<size_t>(p)] != group_number) {
            marked[static_cast<size_t>(p)] = group_number;
            ++unions;
          }
      ++group_number;
      sum += g * full;
    }
    o.union_over_sum.push_back(sum > 0 ? static_cast<double>(unions) / static_cast<double>(sum) : 0.0);
  }
  return o;
}

}  // namespace spindle
