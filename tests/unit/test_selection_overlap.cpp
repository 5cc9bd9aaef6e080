// Selection overlap statistics (spindle select): hand-made pool lists with known unions, the
// queries that do not count, bad input, and the selections a forward pass reports.
#include <gtest/gtest.h>

#include <algorithm>
#include <map>
#include <random>
#include <set>
#include <vector>

#include "core/error.h"
#include "eval/selection_overlap.h"
#include "model/config.h"
#include "model/forward.h"
#include "model/init.h"

namespace spindle {
namespace {

TEST(SelectionOverlap, HandMadeUnions) {
  // Four queries of 2 pools: 0 and 1 the same, 2 sharing one pool with 1, 3 sharing none with 2.
  const std::vector<std::vector<int32_t>> pools = {{3, 5}, {5, 3}, {5, 9}, {1, 2}};
  // Recent: each query's latest 4 pools. Query 0 (latest 7, pools 4-7): 5; query 1 (7-10): none;
  // query 2 (6-9): 9; query 3 (7-10): none. 2 of 8.
  const std::vector<int64_t> latest = {7, 10, 9, 10};
  const SelectionOverlap o = selection_overlap(pools, latest, 2, {1, 2, 4});
  EXPECT_EQ(o.queries, 4);
  EXPECT_EQ(o.distinct_selections, 3);  // {3, 5} twice, {5, 9}, {1, 2}
  EXPECT_DOUBLE_EQ(o.lowest_pools_share, 0.0);
  EXPECT_DOUBLE_EQ(o.recent_share, 2.0 / 8.0);
  // Jaccard of (0, 1), (1, 2), (2, 3): 1, 1/3, 0.
  EXPECT_NEAR(o.consecutive_jaccard, (1.0 + 1.0 / 3.0 + 0.0) / 3.0, 1e-15);
  // Pairs (0, 1): both of 1's pools in 0's; (2, 3): none of 3's in 2's.
  EXPECT_DOUBLE_EQ(o.pair_shared, 2.0 / 4.0);
  ASSERT_EQ(o.union_over_sum.size(), 3u);
  EXPECT_DOUBLE_EQ(o.union_over_sum[0], 1.0);  // one query: its own pools
  // Groups {0, 1}: union 2 of 4; {2, 3}: union 4 of 4.
  EXPECT_DOUBLE_EQ(o.union_over_sum[1], 6.0 / 8.0);
  // One group of 4: {1, 2, 3, 5, 9} = 5 of 8.
  EXPECT_DOUBLE_EQ(o.union_over_sum[2], 5.0 / 8.0);
}

TEST(SelectionOverlap, OnlyQueriesWithEveryPoolCount) {
  // Query 0 chose 1 of 2 pools (early in a sequence): it and the groups holding it do not count.
  const std::vector<std::vector<int32_t>> pools = {{4, -1}, {4, 6}, {4, 6}, {7, 8}};
  const std::vector<int64_t> latest = {4, 8, 8, 8};
  const SelectionOverlap o = selection_overlap(pools, latest, 2, {2});
  EXPECT_EQ(o.queries, 3);
  EXPECT_EQ(o.distinct_selections, 2);                           // query 0 does not count
  EXPECT_NEAR(o.consecutive_jaccard, (1.0 + 0.0) / 2.0, 1e-15);  // (1, 2) and (2, 3)
  EXPECT_DOUBLE_EQ(o.pair_shared, 0.0);                          // only the pair (2, 3) counts
  EXPECT_DOUBLE_EQ(o.union_over_sum[0], 4.0 / 4.0);              // only {2, 3} counts
  // Recent (the latest 4 of 8: pools 5 to 8): 6, 6, 7 and 8 of the 6 counted.
  EXPECT_DOUBLE_EQ(o.recent_share, 4.0 / 6.0);
  EXPECT_THROW(selection_overlap(pools, latest, 2, {}), Error);
  EXPECT_THROW(selection_overlap(pools, latest, 2, {0}), Error);
  EXPECT_THROW(selection_overlap(pools, latest, 0, {2}), Error);
  EXPECT_THROW(selection_overlap(pools, {1, 2}, 2, {2}), Error);
}

// A collapsed indexer: every query the same pools, in any order.
TEST(SelectionOverlap, OneSelectionForEveryQueryIsOneDistinct) {
  const std::vector<std::vector<int32_t>> pools = {{0, 1, 2}, {2, 0, 1}, {1, 2, 0}, {0, 2, 1}};
  const SelectionOverlap o = selection_overlap(pools, {3, 4, 5, 6}, 3, {2, 4});
  EXPECT_EQ(o.distinct_selections, 1);
  EXPECT_DOUBLE_EQ(o.lowest_pools_share, 1.0);  // pools 0, 1, 2: a row of tied scores
  EXPECT_DOUBLE_EQ(o.consecutive_jaccard, 1.0);
  EXPECT_DOUBLE_EQ(o.pair_shared, 1.0);
  EXPECT_DOUBLE_EQ(o.union_over_sum[1], 1.0 / 4.0);
}

// The linear unions and distinct count against sorting (what they replaced) on random selections:
// neighbours that share most pools, a few early queries with too few, groups up to half the sequence.
TEST(SelectionOverlap, UnionsAndDistinctSetsMatchSorting) {
  std::mt19937 rng(7);
  const int64_t full = 16, queries = 3000;
  std::vector<std::vector<int32_t>> pools(queries);
  std::vector<int64_t> latest(queries);
  std::vector<int32_t> base;
  for (int64_t q = 0; q < queries; ++q) {
    latest[q] = 40 + q / 4;
    if (q % 5 == 0 || base.empty()) {  // a new base selection every 5 queries
      std::set<int32_t> s;
      while (static_cast<int64_t>(s.size()) < full) s.insert(static_cast<int32_t>(rng() % (latest[q] + 1)));
      base.assign(s.begin(), s.end());
    }
    std::set<int32_t> s(base.begin(), base.end());
    if (q % 3 == 0) {  // one pool swapped for another (not already chosen)
      s.erase(s.begin());
      while (static_cast<int64_t>(s.size()) < full) s.insert(static_cast<int32_t>(rng() % (latest[q] + 1)));
    }
    pools[q].assign(s.rbegin(), s.rend());            // any order
    if (q < 100 && q % 7 == 0) pools[q].back() = -1;  // too few (early queries): does not count
  }
  const std::vector<int64_t> groups = {2, 8, 64, 1000, queries / 2};  // the larger: only the last whole
  const SelectionOverlap o = selection_overlap(pools, latest, full, groups);

  const auto counted = [&](int64_t q) {
    std::vector<int32_t> v;
    for (int32_t p : pools[q])
      if (p >= 0) v.push_back(p);
    std::sort(v.begin(), v.end());
    return static_cast<int64_t>(v.size()) == full ? v : std::vector<int32_t>();
  };
  std::vector<std::vector<int32_t>> all_sets;
  for (int64_t q = 0; q < queries; ++q)
    if (!counted(q).empty()) all_sets.push_back(counted(q));
  std::sort(all_sets.begin(), all_sets.end());
  EXPECT_EQ(o.distinct_selections, std::unique(all_sets.begin(), all_sets.end()) - all_sets.begin());
  ASSERT_EQ(o.union_over_sum.size(), groups.size());
  for (size_t i = 0; i < groups.size(); ++i) {
    const int64_t g = groups[i];
    int64_t unions = 0, sum = 0;
    for (int64_t first = 0; first + g <= queries; first += g) {
      std::vector<int32_t> all;
      bool whole = true;
      for (int64_t q = first; q < first + g; ++q) {
        const std::vector<int32_t> v = counted(q);
        whole = whole && !v.empty();
        all.insert(all.end(), v.begin(), v.end());
      }
      if (!whole) continue;
      std::sort(all.begin(), all.end());
      unions += std::unique(all.begin(), all.end()) - all.begin();
      sum += g * full;
    }
    ASSERT_GT(sum, 0) << "G = " << g << ": no whole group";
    EXPECT_DOUBLE_EQ(o.union_over_sum[i],
                     sum > 0 ? static_cast<double>(unions) / static_cast<double>(sum) : 0.0)
        << "G = " << g;
  }
}

TEST(SelectionOverlap, ForwardReportsEveryDsaLayerOnce) {
  const ModelConfig c = load_model_config(std::string(SPINDLE_TEST_DATA) + "/configs/tiny.json");
  ModelWeights w = allocate_weights(c, DType::F32);
  init_weights(c, w, 5);
  std::vector<int32_t> tokens;
  for (int i = 0; i < 100; ++i) tokens.push_back(1 + i % 7);
  std::map<int64_t, int64_t> queries;  // layer -> queries reported
  ForwardOptions options;
  options.chunk_tokens = 37;  // a pool split across chunks
  const int64_t width = c.index_topk + (c.index_kpool_always_select_tail ? c.index_kpool - 1 : 0);
  options.on_selection = [&](int64_t layer, int64_t first, const std::vector<int32_t>& selection) {
    EXPECT_EQ(first % 37, 0);
    EXPECT_EQ(static_cast<int64_t>(selection.size()) % width, 0);
    for (size_t i = 0; i < selection.size(); ++i) {
      const int64_t t = first + static_cast<int64_t>(i) / width;
      EXPECT_LE(selection[i], t) << "query " << t << " selected a later token";
    }
    queries[layer] += static_cast<int64_t>(selection.size()) / width;
  };
  sequence_log_probs<float>(c, w, tokens, options);
  int64_t dsa_layers = 0;
  for (AttentionKind kind : c.layer_types) dsa_layers += kind == AttentionKind::Dsa;
  EXPECT_EQ(static_cast<int64_t>(queries.size()), dsa_layers);
  for (const auto& [layer, n] : queries) EXPECT_EQ(n, 100) << "layer " << layer;
}

}  // namespace
}  // namespace spindle
