// Routed-expert load statistics (spindle route): hand-computed counts, the chunk bookkeeping,
// bad input, and the loads a chunked forward pass reports.
#include <gtest/gtest.h>

#include <cmath>
#include <map>
#include <string>
#include <vector>

#include "core/error.h"
#include "core/random.h"
#include "eval/expert_load.h"
#include "model/config.h"
#include "model/forward.h"
#include "model/init.h"

namespace spindle {
namespace {

TEST(ExpertLoad, HandComputedStats) {
  // Mean 2 rows; deviations 4, 0, -2, -2: variance 24 / 4 = 6.
  const std::vector<int64_t> counts = {6, 2, 0, 0};
  const LoadStats s = load_stats(counts);
  EXPECT_EQ(s.rows, 8);
  EXPECT_EQ(s.busiest, 6);
  EXPECT_DOUBLE_EQ(s.max_over_mean, 3.0);
  EXPECT_NEAR(s.cv, std::sqrt(6.0) / 2.0, 1e-15);
  EXPECT_DOUBLE_EQ(s.idle_fraction, 0.5);
}

TEST(ExpertLoad, EvenLoadIsOne) {
  const std::vector<int64_t> counts = {5, 5, 5, 5, 5, 5, 5, 5};
  const LoadStats s = load_stats(counts);
  EXPECT_DOUBLE_EQ(s.max_over_mean, 1.0);
  EXPECT_DOUBLE_EQ(s.cv, 0.0);
  EXPECT_DOUBLE_EQ(s.idle_fraction, 0.0);
}

TEST(ExpertLoad, ChunksAndTheSequence) {
  // Chunk ratios 4/2, 3/2, 1/1; the sum {6, 4} has mean 5.
  const LayerLoad l = layer_load({{4, 0}, {1, 3}, {1, 1}});
  EXPECT_EQ(l.sequence.rows, 10);
  EXPECT_DOUBLE_EQ(l.sequence.max_over_mean, 1.2);
  EXPECT_NEAR(l.sequence.cv, 0.2, 1e-15);
  EXPECT_DOUBLE_EQ(l.mean_chunk_max_over_mean, 1.5);
  EXPECT_EQ(l.worst_chunk_index, 0);
  EXPECT_DOUBLE_EQ(l.worst_chunk.max_over_mean, 2.0);
  EXPECT_DOUBLE_EQ(l.max_chunk_idle_fraction, 0.5);
  EXPECT_EQ(l.peak_chunk_rows, 4);
}

TEST(ExpertLoad, ShortLastChunkIsNotThePeakRows) {
  // The short last chunk is the most uneven (2 over a mean of 1), but the full first chunk's
  // busiest expert took more rows: the buffer must hold 3.
  const LayerLoad l = layer_load({{3, 1}, {2, 0}});
  EXPECT_EQ(l.worst_chunk_index, 1);
  EXPECT_DOUBLE_EQ(l.worst_chunk.max_over_mean, 2.0);
  EXPECT_EQ(l.worst_chunk.busiest, 2);
  EXPECT_EQ(l.peak_chunk_rows, 3);
}

TEST(ExpertLoad, BadInputFails) {
  EXPECT_THROW(load_stats(std::vector<int64_t>{}), Error);
  EXPECT_THROW(load_stats(std::vector<int64_t>{0, 0, 0}), Error);
  EXPECT_THROW(load_stats(std::vector<int64_t>{3, -1}), Error);
  EXPECT_THROW(layer_load({}), Error);
  EXPECT_THROW(layer_load({{1, 2}, {1, 2, 3}}), Error);
}

// The forward pass reports each MoE layer's load once per chunk, tokens x top-k rows each, and
// the chunks add up to the loads of the whole sequence in one chunk (routing does not depend on
// the chunking).
TEST(ExpertLoad, ForwardReportsLoadsPerChunk) {
  ModelConfig c = load_model_config(std::string(SPINDLE_TEST_DATA) + "/configs/tiny.json");
  c.initializer_range = 0.2;
  ModelWeights w = allocate_weights(c, DType::F64);
  init_weights(c, w, 8);
  Random rng(9);
  std::vector<int32_t> tokens(300);
  for (int32_t& t : tokens) t = static_cast<int32_t>(4 + rng.next() % 4);
  auto loads = [&](int64_t chunk) {
    std::map<int64_t, std::vector<std::vector<int64_t>>> out;
    ForwardOptions options;
    options.chunk_tokens = chunk;
    options.on_expert_load = [&](int64_t layer, const std::vector<int64_t>& load) {
      out[layer].push_back(load);
    };
    sequence_log_probs<double>(c, w, tokens, options);
    return out;
  };
  const auto whole = loads(0), chunked = loads(64);
  int64_t moe_layers = 0;
  for (const MlpKind kind : c.mlp_layer_types) moe_layers += kind == MlpKind::Sparse ? 1 : 0;
  ASSERT_GT(moe_layers, 0);
  ASSERT_EQ(static_cast<int64_t>(whole.size()), moe_layers);
  ASSERT_EQ(chunked.size(), whole.size());
  for (const auto& [layer, chunks] : chunked) {
    ASSERT_EQ(chunks.size(), 5u) << "layer " << layer;  // 64 x 4 + 44 tokens
    for (size_t i = 0; i < chunks.size(); ++i)
      EXPECT_EQ(load_stats(chunks[i]).rows, (i < 4 ? 64 : 44) * c.num_experts_per_tok) << "layer " << layer;
    ASSERT_EQ(whole.at(layer).size(), 1u);
    std::vector<int64_t> sum(chunks.front().size(), 0);
    for (const auto& counts : chunks)
      for (size_t e = 0; e < counts.size(); ++e) sum[e] += counts[e];
    EXPECT_EQ(sum, whole.at(layer).front()) << "layer " << layer;
  }
}

}  // namespace
}  // namespace spindle
