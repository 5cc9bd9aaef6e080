// How much neighbouring queries' DSA selections overlap. The sparse attention gathers each query's
// selected pools separately; a kernel that took G neighbouring queries together would gather the
// union of their pools once. These statistics measure what that union costs against the separate
// gathers, on the selections a model's indexer actually makes (`spindle select`).
#pragma once

#include <cstdint>
#include <vector>

namespace spindle {

struct SelectionOverlap {
  int64_t queries = 0;             // queries counted: those with every one of their pools chosen
  double consecutive_jaccard = 0;  // mean |A and B| / |A or B| of the pools of queries t and t + 1
  // How many different pool sets the counted queries chose: 1 for an indexer that ignores its
  // query (collapsed: every score equal, or the same pools best for all).
  int64_t distinct_selections = 0;
  // Of the counted queries, the share that chose exactly the `full` lowest pools, what a row of
  // equal scores gives (ties go to the lower pool): near 1, the indexer scores every pool the same.
  double lowest_pools_share = 0;
  // Of the chosen pools, the share among the query's 2 x full latest complete pools (the recent
  // context, as far back as twice what it may choose).
  double recent_share = 0;
  // Of the pools of query 2p + 1, the share that query 2p chose too (pairs whose both queries
  // count).
  double pair_shared = 0;
  // For each group size G: the pools of G neighbouring queries (groups aligned at multiples of G)
  // gathered once for the group, over the pools gathered query by query: 1 when no two share a
  // pool, 1 / G when all G chose the same ones.
  std::vector<int64_t> group_sizes;
  std::vector<double> union_over_sum;
};

// pools[q]: the pools query q chose (any order, -1 for none), queries in position order; latest[q]:
// its latest complete pool. Only queries with `full` pools chosen count (the first ones of a
// sequence see fewer), and a group only when all its queries count. Fails on an empty group size
// list or one below 1.
SelectionOverlap selection_overlap(const std::vector<std::vector<int32_t>>& pools,
                                   const std::vector<int64_t>& latest, int64_t full,
                                   const std::vector<int64_t>& group_sizes);

}  // namespace spindle
