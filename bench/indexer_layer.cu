// One DSA layer's indexer over a whole sequence, as the streamed forward runs it: chunk by chunk,
// each chunk's queries in the executor's query blocks (as many rows as a score tile of
// `workspace_mib` holds, model/cuda/dsa.cpp's kSelectWorkspaceBytes: 1 GiB), scores then top-k.
// GLM's indexer shape (32 heads x 128, k-pool 16, top 2048), random inputs (one chunk's queries
// reused at every position). Each chunk runs once, timed by CUDA events: the scores alone, then
// the whole selection. Prints the layer's totals and their rates by quarter of the sequence, next
// to one block at the end timed as bench_indexer_scores times it (median of 5): the step's
// indexer (9.4 s for 11 layers at 1M, 2026-12-05) against its kernel's bench.
// round_waves 1: each block rounded down to whole waves of the scorer's CTAs (16 queries each, one
// an SM), to measure what the blocks' last partial wave costs. layers: the layer run that many
// times in a row (the step runs 11), each pass's totals printed, to see the GPU's clock and power
// settle as they do in a step (sample them beside it: nvidia-smi -lms 100).
//     build/bench_indexer_layer [tokens] [chunk] [workspace_mib] [round_waves] [layers]
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <vector>

#include "backend/cuda/check.h"
#include "backend/cuda/device_memory.h"
#include "indexer_inputs.cuh"
#include "kernels/cpu/dsa.h"
#include "kernels/cuda/indexer.h"

using namespace spindle;
using namespace spindle::cuda;

constexpr int64_t kScorerQueries = 16;  // queries per CTA of the wgmma scorer

int main(int argc, char** argv) {
  const int64_t tokens = argc > 1 ? std::atoll(argv[1]) : 1048576;
  const int64_t chunk = argc > 2 ? std::atoll(argv[2]) : 16384;
  const int64_t workspace_mib = argc > 3 ? std::atoll(argv[3]) : 1024;
  const bool round_waves = argc > 4 && std::atoi(argv[4]) != 0;
  const int layers = argc > 5 ? std::atoi(argv[5]) : 1;
  if (chunk < 1 || tokens < chunk || tokens % chunk != 0 || workspace_mib < 1 || layers < 1) {
    std::fprintf(stderr, "tokens must be a multiple of chunk (>= 1), workspace_mib and layers >= 1\n");
    return 2;
  }
  int sms = 0;
  SPINDLE_CUDA(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
  const int64_t wave = sms * kScorerQueries;
  IndexerBenchInputs in = indexer_bench_inputs(tokens, chunk, 0);
  const cpu::IndexerShape whole = in.shape;
  const size_t limit = static_cast<size_t>(workspace_mib) << 20;
  DeviceBuffer<int32_t> selected(static_cast<size_t>(chunk * whole.width()), MemoryCategory::Activations);

  // A chunk's shape and its query block, as run_indexer sizes it (then rounded, if asked).
  const auto shape_at = [&](int64_t c0) {
    cpu::IndexerShape s = whole;
    s.tokens = c0 + chunk;
    s.first_query = c0;
    return s;
  };
  const auto block_of = [&](const cpu::IndexerShape& s) {
    const int64_t row = std::max<int64_t>(1, s.complete_pools() * 4);
    int64_t block = std::max<int64_t>(1, std::min<int64_t>(chunk, static_cast<int64_t>(limit) / row));
    if (round_waves && block > wave && block < chunk) block = block / wave * wave;
    return block;
  };
  // The score tile and, past it, the block's tile maxima (as run_indexer allocates them), for the
  // largest of the chunks' blocks.
  size_t workspace_bytes = 0;
  for (int64_t c0 = 0; c0 < tokens; c0 += chunk) {
    const cpu::IndexerShape s = shape_at(c0);
    workspace_bytes = std::max(workspace_bytes, indexer_select_workspace_bytes(s, block_of(s)));
  }
  DeviceBuffer<float> workspace((workspace_bytes + 3) / 4, MemoryCategory::Workspace);
  const auto scores_of = [&](const cpu::IndexerShape& s, int64_t block) {
    unsigned* maxima = reinterpret_cast<unsigned*>(workspace.data() + block * s.complete_pools());
    for (int64_t t0 = s.first_query; t0 < s.tokens; t0 += block)
      indexer_scores(s, in.q.data(), in.keys.data(), in.weights.data(), t0, std::min(block, s.tokens - t0),
                     workspace.data(), maxima, nullptr);
  };
  const auto select_of = [&](const cpu::IndexerShape& s, int64_t block) {
    indexer_select(s, in.q.data(), in.keys.data(), in.weights.data(), selected.data(), workspace.data(),
                   indexer_select_workspace_bytes(s, block), nullptr);
  };
  const auto flops_of = [&](const cpu::IndexerShape& s, int64_t first, int64_t rows) {
    double f = 0;
    for (int64_t t = first; t < first + rows; ++t)
      f += 2.0 * s.heads * s.head_dim * static_cast<double>(std::min(s.complete_pools(), (t + 1) / s.kpool));
    return f;
  };

  const cpu::IndexerShape last = shape_at(tokens - chunk);
  const int64_t last_block = block_of(last);
  scores_of(last, last_block);  // warm-up
  const double one_block = median_ms(
      [&] {
        unsigned* maxima = reinterpret_cast<unsigned*>(workspace.data() + last_block * last.complete_pools());
        indexer_scores(last, in.q.data(), in.keys.data(), in.weights.data(), last.first_query, last_block,
                       workspace.data(), maxima, nullptr);
      },
      5);
  const double one_block_flops = flops_of(last, last.first_query, last_block);

  const int64_t chunks = tokens / chunk;
  std::vector<double> scores_ms(chunks), select_ms(chunks), flops(chunks);
  int64_t blocks = 0;
  for (int64_t i = 0; i < chunks; ++i) {
    const cpu::IndexerShape s = shape_at(i * chunk);
    const int64_t block = block_of(s);
    blocks += (chunk + block - 1) / block;
    flops[i] = flops_of(s, s.first_query, chunk);
  }
  // The last pass's times are the ones reported by quarter; each pass's totals as it ends.
  for (int pass = 0; pass < layers; ++pass) {
    double pass_ms = 0;
    for (int64_t i = 0; i < chunks; ++i) {
      const cpu::IndexerShape s = shape_at(i * chunk);
      const int64_t block = block_of(s);
      scores_ms[i] = elapsed_ms([&] { scores_of(s, block); });
      select_ms[i] = elapsed_ms([&] { select_of(s, block); });
      pass_ms += scores_ms[i] + select_ms[i];
    }
    if (layers > 1) std::printf("  pass %d: scores and selection %.1f ms\n", pass + 1, pass_ms);
  }
  double total_scores = 0, total_select = 0, total_flops = 0;
  for (int64_t i = 0; i < chunks; ++i) {
    total_scores += scores_ms[i];
    total_select += select_ms[i];
    total_flops += flops[i];
  }
  std::printf(
      "indexer layer of %lld tokens in chunks of %lld, score tiles of %lld MiB%s: %lld blocks\n"
      "  one block at the end (%lld queries), median of 5: %.3f ms, %.0f TFLOP/s\n"
      "  the layer: scores %.1f ms (%.0f TFLOP/s), selection (scores + top-k) %.1f ms, top-k %.1f ms\n",
      static_cast<long long>(tokens), static_cast<long long>(chunk), static_cast<long long>(workspace_mib),
      round_waves ? ", blocks in whole waves" : "", static_cast<long long>(blocks),
      static_cast<long long>(last_block), one_block, one_block_flops / one_block / 1e9, total_scores,
      total_flops / total_scores / 1e9, total_select, total_select - total_scores);
  for (int q = 0; q < 4; ++q) {
    const int64_t a = chunks * q / 4, b = chunks * (q + 1) / 4;
    double s_ms = 0, sel_ms = 0, f = 0;
    for (int64_t i = a; i < b; ++i) {
      s_ms += scores_ms[i];
      sel_ms += select_ms[i];
      f += flops[i];
    }
    std::printf("  quarter %d (tokens %lld .. %lld): scores %.1f ms (%.0f TFLOP/s), selection %.1f ms\n",
                q + 1, static_cast<long long>(a * chunk), static_cast<long long>(b * chunk), s_ms,
                f / s_ms / 1e9, sel_ms);
  }
  return 0;
}
