// spindle select: how much neighbouring queries' DSA selections overlap, per DSA layer, on one
// sequence (real tokens or uniformly random ids), from a forward pass on the CPU (or, with
// --device cuda, the GPU's bf16 forward, for models too large for the CPU's). The sparse
// attention gathers every query's pools separately; the union of G neighbours' pools is what a
// kernel taking them together would gather (eval/selection_overlap.h). With a chunk longer than the
// largest of those groups, also how many distinct tokens a chunk's queries select between them:
// what a sparse attention that made each chunk's selected keys explicit would have to make.
#include <cstdio>
#include <iostream>
#include <map>
#include <nlohmann/json.hpp>
#include <utility>
#include <vector>

#include "backend/device_model.h"
#include "cli/args.h"
#include "cli/commands.h"
#include "cli/commands/cpu_analysis.h"
#include "cli/commands/layer_progress.h"
#include "eval/selection_overlap.h"
#include "kernels/cpu/dsa.h"
#include "model/checkpoint.h"
#include "model/forward.h"

namespace spindle {

namespace {

const std::vector<int64_t> kGroups = {2, 4, 8, 16, 32};

// DSA layer index -> each query's chosen pools and its latest complete pool, in position order.
struct Selections {
  std::vector<std::vector<int32_t>> pools;
  std::vector<int64_t> latest;
};
using LayerPools = std::map<int64_t, Selections>;

// The chunk of queries from `first` on of DSA layer `layer` ([queries, width] selected tokens) as
// pool lists, appended to the layer's.
void add_selection(const ModelConfig& c, LayerPools& pools, int64_t layer, int64_t first,
                   const std::vector<int32_t>& selection) {
  cpu::IndexerShape shape{
      0,    c.index_n_heads, c.index_head_dim, c.index_kpool, c.index_topk, c.index_kpool_always_select_tail,
      first};
  const int64_t queries = static_cast<int64_t>(selection.size()) / shape.width();
  shape.tokens = first + queries;
  const int64_t per_query = shape.topk / shape.kpool;
  std::vector<int32_t> lists(static_cast<size_t>(queries * per_query));
  cpu::selection_to_pools(shape, selection.data(), lists.data());
  Selections& out = pools[layer];
  for (int64_t q = 0; q < queries; ++q) {
    out.pools.emplace_back(lists.begin() + q * per_query, lists.begin() + (q + 1) * per_query);
    out.latest.push_back((first + q + 1) / shape.kpool - 1);
  }
}

template <class T>
LayerPools select(const Model& model, const std::vector<int32_t>& tokens, int64_t chunk) {
  LayerPools pools;
  ForwardOptions options;
  options.chunk_tokens = chunk;
  options.on_selection = [&](int64_t layer, int64_t first, const std::vector<int32_t>& selection) {
    add_selection(model.config, pools, layer, first, selection);
  };
  options.on_layer = layer_progress(model.config, tokens.size());
  sequence_log_probs<T>(model.config, model.weights, tokens, options);
  return pools;
}

// The same from the device's forward: the layers with their own indexer (a layer sharing one
// chooses what its source chose).
LayerPools select_on_device(const Model& model, const std::vector<int32_t>& tokens, int64_t chunk,
                            Device device) {
  DeviceModelOptions options;
  options.chunk_tokens = chunk;
  const auto on_device = open_device_model(device, model.config, model.weights, options);
  LayerPools pools;
  on_device->log_probs_and_selections(
      tokens, [&](int64_t layer, int64_t first, const std::vector<int32_t>& selection) {
        add_selection(model.config, pools, layer, first, selection);
      });
  return pools;
}

}  // namespace

int run_select(const std::vector<std::string>& argv) {
  const Args args = cpu_analysis_args("select", argv, {"device"});
  const Device device = parse_device(args.value_or("device", "cpu"), "--device");
  check(device == Device::CPU || !args.optional("dtype"),
        "--dtype applies to the CPU forward (--device cpu); the GPU's runs in bf16");
  const CpuAnalysis run = load_cpu_analysis(args, "select");
  const auto& [dir, dtype, chunk, model, tokens, source] = run;
  const ModelConfig& c = model.config;
  check(c.index_kpool >= 1 && c.index_topk >= c.index_kpool, "model '", dir,
        "' has no k-pool indexer (kpool ", c.index_kpool, ", topk ", c.index_topk, ")");
  const auto L = static_cast<int64_t>(tokens.size());

  const LayerPools pools = device != Device::CPU ? select_on_device(model, tokens, chunk, device)
                           : dtype == DType::F64 ? select<double>(model, tokens, chunk)
                                                 : select<float>(model, tokens, chunk);
  check(!pools.empty(), "model '", dir, "' has no DSA layer");
  const int64_t full = c.index_topk / c.index_kpool;
  std::vector<int64_t> groups = kGroups;
  const bool chunk_union = chunk > kGroups.back() && chunk <= L;
  if (chunk_union) groups.push_back(chunk);

  std::cout
      << "DSA selections: " << full << " pools of " << c.index_kpool << " tokens per query, " << L
      << " tokens (" << source << ")\n"
      << "union / sum: the pools G neighbouring queries chose, gathered once, over their gathers one by "
         "one (1: none shared, 1/G: all the same)\n"
      << "recent: the chosen pools among the query's latest " << 2 * full << " (twice what it chooses)\n"
      << "distinct: how many different pool sets the queries chose (1: the indexer ignores the query)\n"
      << "pairs: the pools of query 2p + 1 that 2p chose too\n"
      << "layer  queries distinct  recent  jaccard(t, t+1)   pairs";
  for (int64_t g : kGroups) {
    char head[16];
    std::snprintf(head, sizeof head, " %7s", ("G=" + std::to_string(g)).c_str());
    std::cout << head;
  }
  std::cout << '\n';
  nlohmann::json layers = nlohmann::json::array();
  std::vector<std::pair<int64_t, SelectionOverlap>> collapsed;  // the layers of one distinct selection
  for (const auto& [layer, selections] : pools) {
    const SelectionOverlap o = selection_overlap(selections.pools, selections.latest, full, groups);
    char line[200];
    std::snprintf(line, sizeof line, "%-6lld %7lld %8lld %7.3f %16.3f %7.3f", static_cast<long long>(layer),
                  static_cast<long long>(o.queries), static_cast<long long>(o.distinct_selections),
                  o.recent_share, o.consecutive_jaccard, o.pair_shared);
    std::cout << line;
    for (size_t g = 0; g < kGroups.size(); ++g) {
      std::snprintf(line, sizeof line, " %7.3f", o.union_over_sum[g]);
      std::cout << line;
    }
    std::cout << '\n';
    // union / sum times the sum (chunk queries x full pools) is the chunk's distinct pools.
    const double chunk_tokens =
        chunk_union ? o.union_over_sum.back() * static_cast<double>(chunk * full * c.index_kpool) : 0.0;
    if (chunk_union && o.union_over_sum.back() > 0) {
      std::snprintf(line, sizeof line,
                    "       a chunk's %lld queries select %.0f distinct tokens between them\n",
                    static_cast<long long>(chunk), chunk_tokens);
      std::cout << line;
    }
    if (o.queries > 1 && o.distinct_selections == 1) collapsed.emplace_back(layer, o);
    layers.push_back({{"layer", layer},
                      {"queries", o.queries},
                      {"recent_share", o.recent_share},
                      {"consecutive_jaccard", o.consecutive_jaccard},
                      {"pair_shared", o.pair_shared},
                      {"distinct_selections", o.distinct_selections},
                      {"lowest_pools_share", o.lowest_pools_share},
                      {"group_sizes", o.group_sizes},
                      {"union_over_sum", o.union_over_sum},
                      {"chunk_distinct_tokens", chunk_tokens}});
  }
  for (const auto& [layer, o] : collapsed)
    std::cout
        << "warning: layer " << layer << ": all " << o.queries
        << " queries chose the same pools; its indexer ignores the query"
        << (o.lowest_pools_share == 1.0
                ? " and ties every score (they all take the lowest pools): every relu closed (its KL then "
                  "trains it no more) or its head weights zero\n"
                : " (the same pools score best for every query)\n");
  if (full * c.index_kpool >= L)
    std::cout << "note: every query sees at most " << L / c.index_kpool << " pools and chooses up to " << full
              << ": overlap here says little\n";

  write_analysis_json(args,
                      {{"model", dir},
                       {"tokens", source},
                       {"length", L},
                       {"dtype", device != Device::CPU ? std::string("bf16 (") + device_name(device) + ")"
                                                       : std::string(dtype_name(dtype))},
                       {"kpool", c.index_kpool},
                       {"pools_per_query", full},
                       {"layers", layers}});
  return 0;
}

}  // namespace spindle
