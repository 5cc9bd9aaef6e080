// spindle route: how unevenly the routed experts are loaded on one sequence (real tokens or
// uniformly random ids), per MoE layer over the whole sequence and per chunk of the streaming
// executor, from a forward pass on the CPU. The worst chunk's busiest expert is what a chunk's
// per-expert row buffers must hold.
#include <algorithm>
#include <array>
#include <cstdio>
#include <iostream>
#include <map>
#include <nlohmann/json.hpp>

#include "cli/args.h"
#include "cli/commands.h"
#include "cli/commands/cpu_analysis.h"
#include "cli/commands/layer_progress.h"
#include "eval/expert_load.h"
#include "model/checkpoint.h"
#include "model/forward.h"

namespace spindle {

namespace {

// MoE layer index -> its rows per expert, chunk by chunk ([chunk][expert]).
using ChunkLoads = std::map<int64_t, std::vector<std::vector<int64_t>>>;

template <class T>
ChunkLoads route(const Model& model, const std::vector<int32_t>& tokens, int64_t chunk) {
  ChunkLoads loads;
  ForwardOptions options;
  options.chunk_tokens = chunk;
  options.on_expert_load = [&](int64_t layer, const std::vector<int64_t>& load) {
    loads[layer].push_back(load);
  };
  options.on_layer = layer_progress(model.config, tokens.size());
  sequence_log_probs<T>(model.config, model.weights, tokens, options);
  return loads;
}

nlohmann::json stats_json(const LoadStats& s) {
  return {{"rows", s.rows},
          {"busiest_rows", s.busiest},
          {"max_over_mean", s.max_over_mean},
          {"cv", s.cv},
          {"idle_fraction", s.idle_fraction}};
}

// One table row: sequence max/mean, CV, idle; chunks' mean and worst max/mean, most idle; the
// most rows one expert took in one chunk.
using Row = std::array<double, 7>;

Row table_row(const LayerLoad& l) {
  return {l.sequence.max_over_mean,
          l.sequence.cv,
          l.sequence.idle_fraction,
          l.mean_chunk_max_over_mean,
          l.worst_chunk.max_over_mean,
          l.max_chunk_idle_fraction,
          static_cast<double>(l.peak_chunk_rows)};
}

void print_row(const std::string& name, const Row& r) {
  char line[200];
  std::snprintf(line, sizeof line, "%-6s %9.3f %7.3f %7.3f %12.3f %12.3f %11.3f %13.0f", name.c_str(), r[0],
                r[1], r[2], r[3], r[4], r[5], r[6]);
  std::cout << line << '\n';
}

}  // namespace

int run_route(const std::vector<std::string>& argv) {
  const Args args = cpu_analysis_args("route", argv);
  const CpuAnalysis run = load_cpu_analysis(args, "route");
  const auto& [dir, dtype, chunk, model, tokens, source] = run;
  const ModelConfig& c = model.config;
  check(c.n_routed_experts > 0, "model '", dir, "' has no routed experts");
  const auto L = static_cast<int64_t>(tokens.size());
  const int64_t chunk_tokens = chunk > 0 ? std::min(chunk, L) : L;

  const ChunkLoads loads =
      dtype == DType::F64 ? route<double>(model, tokens, chunk) : route<float>(model, tokens, chunk);
  check(!loads.empty(), "model '", dir, "' has no MoE layer");

  // A full chunk's mean rows per expert: the busiest expert over it is the buffer factor.
  const double chunk_mean =
      static_cast<double>(chunk_tokens * c.num_experts_per_tok) / static_cast<double>(c.n_routed_experts);
  std::cout << "routed experts " << c.n_routed_experts << ", top-" << c.num_experts_per_tok << ", " << L
            << " tokens (" << source << "), chunks of " << chunk_tokens << " tokens\n";
  std::cout << "                 sequence            chunks: max/mean     chunks\n"
               "layer  max/mean      cv    idle         mean        worst   most idle     peak rows\n";
  nlohmann::json layers = nlohmann::json::array();
  Row mean{}, worst{};
  int64_t peak_rows = 0;
  for (const auto& [layer, chunks] : loads) {
    const LayerLoad l = layer_load(chunks);
    const Row row = table_row(l);
    print_row(std::to_string(layer), row);
    for (size_t i = 0; i < row.size(); ++i) {
      mean[i] += row[i] / static_cast<double>(loads.size());
      worst[i] = std::max(worst[i], row[i]);
    }
    peak_rows = std::max(peak_rows, l.peak_chunk_rows);
    layers.push_back({{"layer", layer},
                      {"sequence", stats_json(l.sequence)},
                      {"mean_chunk_max_over_mean", l.mean_chunk_max_over_mean},
                      {"worst_chunk", stats_json(l.worst_chunk)},
                      {"worst_chunk_index", l.worst_chunk_index},
                      {"max_chunk_idle_fraction", l.max_chunk_idle_fraction},
                      {"peak_chunk_rows", l.peak_chunk_rows},
                      {"chunk_loads", chunks}});
  }
  print_row("mean", mean);
  print_row("worst", worst);
  const double buffer_factor = static_cast<double>(peak_rows) / chunk_mean;
  char line[200];
  std::snprintf(line, sizeof line,
                "per-expert buffer: the busiest expert took %lld rows of a %lld-token chunk, %.3f x the mean "
                "(%.1f rows; at most %lld)\n",
                static_cast<long long>(peak_rows), static_cast<long long>(chunk_tokens), buffer_factor,
                chunk_mean, static_cast<long long>(chunk_tokens));
  std::cout << line;

  write_analysis_json(args, {{"model", dir},
                             {"tokens", source},
                             {"length", L},
                             {"chunk_tokens", chunk_tokens},
                             {"dtype", dtype_name(dtype)},
                             {"routed_experts", c.n_routed_experts},
                             {"experts_per_token", c.num_experts_per_tok},
                             {"peak_chunk_rows", peak_rows},
                             {"buffer_factor", buffer_factor},
                             {"layers", layers}});
  return 0;
}

}  // namespace spindle
