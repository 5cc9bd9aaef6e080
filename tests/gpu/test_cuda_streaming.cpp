// The streaming executor on the GPU (docs/STREAMING.md) against the GPU's own passes over the
// whole sequence, on the same weights, in both forms of MLA. The model is the CPU streaming tests':
// KDA, DSA with its own indexer, DSA sharing that selection, KDA, DSA with its own indexer; dense
// and MoE feed-forward sites. Chunks of 37 and 300 tokens split k-pools (8 tokens) and conv windows
// (3 carried rows) and the KDA kernel's 64-token chunks; 64 is aligned with both.
//
// Streamed and whole passes compute the same function with the same bf16 roundings of the same
// kinds of values; they differ only in the order of fp32 sums (a GEMM over a chunk's rows may take
// another cuBLASLt algorithm than over the whole sequence's, the KDA kernel's chunks of 64 tokens
// start at other positions, atomics in the backward kernels). Such a difference flips an
// activation's bf16 rounding here and there (2^-8 relative); it is far smaller than the rounding of
// the weights to bf16 (which the GPU-vs-CPU tests keep out of their comparison) and bounded here
// below the GPU-vs-CPU bounds of test_cuda_model.cpp: mean |diff| of log-probs 0.01 (half of
// theirs), the loss 1e-3 relative, each gradient tensor's direction within cosine 0.99.
#include <gtest/gtest.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <map>
#include <nlohmann/json.hpp>
#include <string>
#include <utility>
#include <vector>

#include "backend/cuda/register.h"
#include "backend/device_model.h"
#include "io/token_text.h"
#include "model/backward.h"
#include "model/init.h"

namespace spindle {
namespace {

const std::string kTests = SPINDLE_TEST_DATA;

// last_kda: the last layer a KDA layer instead of a DSA one.
ModelConfig streaming_config(int64_t index_topk, bool last_kda = false) {
  nlohmann::json j = nlohmann::json::parse(R"({
    "model_type": "glm5_next_text", "vocab_size": 16, "hidden_size": 32, "intermediate_size": 48,
    "moe_intermediate_size": 16, "num_hidden_layers": 5, "num_attention_heads": 2,
    "num_key_value_heads": 2, "n_routed_experts": 4, "num_experts_per_tok": 2, "kv_lora_rank": 16,
    "q_lora_rank": 24, "qk_nope_head_dim": 16, "v_head_dim": 16, "index_head_dim": 8,
    "index_n_heads": 4, "index_kpool": 8, "linear_head_dim": 8, "linear_num_heads": 2,
    "pad_token_id": 0,
    "layer_types": ["linear_attention", "deepseek_sparse_attention", "deepseek_sparse_attention",
                    "linear_attention", "deepseek_sparse_attention"],
    "indexer_types": ["full", "full", "shared", "full", "full"],
    "mlp_layer_types": ["dense", "sparse", "dense", "sparse", "sparse"]})");
  j["index_topk"] = index_topk;
  if (last_kda) j["layer_types"][4] = "linear_attention";
  ModelConfig config = parse_model_config(j, last_kda ? "tiny, 2 DSA layers" : "tiny, 3 DSA layers");
  config.initializer_range = 0.1;  // predictions far from uniform: differences show
  return config;
}

std::vector<int32_t> dna(size_t n) {
  std::vector<int32_t> tokens = read_token_text(kTests + "/../bench/chr22_70k.tokens");
  tokens.resize(n);
  return tokens;
}

std::unique_ptr<DeviceModel> on_gpu(const ModelConfig& config, const ModelWeights& weights, bool absorbed_mla,
                                    int64_t chunk_tokens = 0) {
  cuda::register_backend();
  return open_device_model(Device::CUDA, config, weights, {true, absorbed_mla, chunk_tokens});
}

// 1000 tokens; a top-k of 4 pools out of up to 125, so that the indexer really chooses, in every
// chunk, among the pools of the earlier chunks and its own.
TEST(CudaStreaming, LogProbsInChunksEqualTheWholeSequence) {
  const ModelConfig config = streaming_config(32);
  ModelWeights weights = allocate_weights(config, DType::F32);
  init_weights(config, weights, 7);
  const std::vector<int32_t> tokens = dna(1000);
  for (const bool absorbed : {true, false}) {
    SCOPED_TRACE(absorbed ? "absorbed MLA" : "expanded MLA");
    const std::vector<float> whole = on_gpu(config, weights, absorbed)->log_probs(tokens);
    double spread = 0, mean_lp = 0;
    for (float v : whole) mean_lp += v / static_cast<double>(whole.size());
    for (float v : whole) spread += std::abs(v - mean_lp) / static_cast<double>(whole.size());
    EXPECT_GT(spread, 0.05) << "nearly uniform predictions: the comparison would prove little";
    for (const int64_t chunk : {37, 64, 300}) {
      const std::vector<float> got = on_gpu(config, weights, absorbed, chunk)->log_probs(tokens);
      ASSERT_EQ(got.size(), whole.size());
      double sum = 0, most = 0;
      for (size_t i = 0; i < got.size(); ++i) {
        ASSERT_TRUE(std::isfinite(got[i])) << "position " << i + 1 << ", chunks of " << chunk;
        sum += std::abs(got[i] - whole[i]);
        most = std::max(most, static_cast<double>(std::abs(got[i] - whole[i])));
      }
      const double mean = sum / static_cast<double>(got.size());
      std::printf("%s, chunks of %lld: mean |diff| %.3e, max %.3e (mean spread %.3f)\n",
                  absorbed ? "absorbed" : "expanded", static_cast<long long>(chunk), mean, most, spread);
      EXPECT_LE(mean, 0.01) << "chunks of " << chunk;
    }
  }
}

// spindle select --device cuda: every chunk's selections of each layer with its own indexer reach
// the caller in order, every query's row once, each pointing at tokens it may see; taking them
// changes nothing in the log probabilities.
TEST(CudaStreaming, SelectionsOfEveryChunkReachTheCaller) {
  const ModelConfig config = streaming_config(32);
  ModelWeights weights = allocate_weights(config, DType::F32);
  init_weights(config, weights, 7);
  const std::vector<int32_t> tokens = dna(1000);
  const auto L = static_cast<int64_t>(tokens.size());
  const int64_t width =
      config.index_topk + (config.index_kpool_always_select_tail ? config.index_kpool - 1 : 0);
  for (const int64_t chunk : {int64_t{0}, int64_t{300}}) {
    SCOPED_TRACE("chunks of " + std::to_string(chunk));
    auto device = on_gpu(config, weights, true, chunk);
    const std::vector<float> plain = device->log_probs(tokens);
    std::map<int64_t, int64_t> next_query;  // layer -> the first query of its next chunk
    int64_t chosen = 0;
    const std::vector<float> seen = device->log_probs_and_selections(
        tokens, [&](int64_t layer, int64_t first, const std::vector<int32_t>& selection) {
          EXPECT_EQ(first, next_query[layer]) << "layer " << layer;
          ASSERT_EQ(static_cast<int64_t>(selection.size()) % width, 0) << "layer " << layer;
          const int64_t queries = static_cast<int64_t>(selection.size()) / width;
          EXPECT_EQ(queries, std::min(chunk > 0 ? chunk : L, L - first)) << "layer " << layer;
          for (int64_t q = 0; q < queries; ++q)
            for (int64_t i = 0; i < width; ++i) {
              const int32_t token = selection[q * width + i];
              EXPECT_GE(token, -1);
              EXPECT_LE(token, first + q) << "layer " << layer << " query " << first + q << " sees ahead";
              chosen += token >= 0;
            }
          next_query[layer] = first + queries;
        });
    // Layers 1 and 4 have their own indexer; layer 2 shares layer 1's.
    EXPECT_EQ(next_query, (std::map<int64_t, int64_t>{{1, L}, {4, L}}));
    EXPECT_GT(chosen, 2 * L) << "the selections are mostly empty";
    ASSERT_EQ(seen.size(), plain.size());
    for (size_t i = 0; i < seen.size(); ++i) ASSERT_EQ(seen[i], plain[i]) << "position " << i + 1;
  }
}

// Each tensor holding at least 1e-3 of the gradient's norm points the same way in both; the norms
// agree within 2%. Returns the number of tensors checked.
int compare_gradients(const ModelConfig& config, ModelWeights& want, ModelWeights& got) {
  auto a_table = parameter_table(config, want);
  auto b_table = parameter_table(config, got);
  std::vector<std::array<double, 3>> sums;  // per tensor: |want|^2, |got|^2, want . got
  double want_sq = 0, got_sq = 0, dot = 0;
  for (size_t i = 0; i < a_table.size(); ++i) {
    double ab = 0, aa = 0, bb = 0;
    for (int64_t j = 0; j < a_table[i].tensor.numel(); ++j) {
      const double x = a_table[i].tensor.item_as_double(j), y = b_table[i].tensor.item_as_double(j);
      EXPECT_TRUE(std::isfinite(y)) << b_table[i].name << " element " << j;
      ab += x * y, aa += x * x, bb += y * y;
    }
    want_sq += aa, got_sq += bb, dot += ab;
    sums.push_back({aa, bb, ab});
  }
  const double norm = std::sqrt(want_sq);
  int checked = 0;
  for (size_t i = 0; i < sums.size(); ++i) {
    const auto [aa, bb, ab] = sums[i];
    if (std::sqrt(aa) < 1e-3 * norm) continue;  // mHC scales and biases: sums that mostly cancel
    EXPECT_GT(ab / std::sqrt(aa * bb), 0.99)
        << a_table[i].name << ": |whole| " << std::sqrt(aa) << " |streamed| " << std::sqrt(bb);
    ++checked;
  }
  std::printf("gradient norm whole %.6f streamed %.6f, cosine %.6f over %d tensors\n", norm,
              std::sqrt(got_sq), dot / (norm * std::sqrt(got_sq)), checked);
  EXPECT_NEAR(std::sqrt(got_sq), norm, 2e-2 * norm);
  EXPECT_GT(dot / (norm * std::sqrt(got_sq)), 0.999);
  return checked;
}

// The loss, the balance loss, the indexer's KL, the expert loads and every gradient. The top-k
// covers the sequence here, so that both passes attend to the same keys (a near-tie of two pools'
// scores could otherwise fall either way; selection in chunks is checked by the test above and
// exactly by the kernel tests), and the KL trains every indexer. With the balance loss the forward
// takes every chunk; without it, all but the last, whose recomputation is then its only forward, and
// each stops at the last layer's attention sublayer (the later feed-forward sublayers count their
// loads in the recomputation).
TEST(CudaStreaming, LossAndGradientsInChunksEqualTheWholeSequence) {
  const ModelConfig config = streaming_config(512);
  ModelWeights weights = allocate_weights(config, DType::F32);
  init_weights(config, weights, 9);
  const std::vector<int32_t> tokens = dna(400);
  for (const bool absorbed : {true, false})
    for (const double aux_loss_coef : {0.01, 0.0}) {
      SCOPED_TRACE(std::string(absorbed ? "absorbed MLA" : "expanded MLA") +
                   (aux_loss_coef > 0 ? ", balance loss" : ", no balance loss"));
      LossOptions options;
      options.indexer_kl_coef = 0.5;
      options.aux_loss_coef = aux_loss_coef;
      options.scale = 0.5;
      auto plain = on_gpu(config, weights, absorbed);
      const LossResult whole = plain->loss_and_gradients(tokens, options);
      ModelWeights whole_grads = zero_gradients(config, DType::F32);
      plain->download_gradients(whole_grads);
      ASSERT_GT(whole.indexer_kl, 0);
      // Chunks of 37 both ways: the forward's selections kept as pool lists (the default) and the
      // indexer run again before each chunk's backward; 64 kept, 150 again. The recomputation keeps
      // the sublayers' outputs for their backwards (the default) at 37, with the KDA matrices (the
      // default) and without, and with the feed-forward sites' inputs made again; each backward
      // computes them again at 64 and 150.
      struct Streamed {
        int64_t chunk;
        bool keep_selections, keep_outputs, keep_kda_matrices, rebuild_ffn_inputs = false;
      };
      for (const Streamed& run : {Streamed{37, true, true, true},
                                  {37, true, true, true, true},
                                  {37, false, true, false},
                                  {64, true, false, false},
                                  {150, false, false, false}}) {
        const int64_t chunk = run.chunk;
        const bool keep = run.keep_selections;
        SCOPED_TRACE("chunks of " + std::to_string(chunk) + (keep ? ", selections kept" : ", indexer again") +
                     (run.keep_outputs ? ", outputs kept" : ", outputs again") +
                     (run.keep_kda_matrices ? ", KDA matrices kept" : "") +
                     (run.rebuild_ffn_inputs ? ", feed-forward inputs again" : ""));
        LossOptions streamed_options = options;
        streamed_options.chunk_tokens = chunk;
        streamed_options.keep_selections = keep;
        streamed_options.keep_outputs = run.keep_outputs;
        streamed_options.keep_kda_matrices = run.keep_kda_matrices;
        streamed_options.rebuild_ffn_inputs = run.rebuild_ffn_inputs;
        auto device = on_gpu(config, weights, absorbed);
        const LossResult streamed = device->loss_and_gradients(tokens, streamed_options);
        ModelWeights grads = zero_gradients(config, DType::F32);
        device->download_gradients(grads);
        std::printf(
            "%s, chunks of %lld%s%s%s%s%s: loss %.6f / %.6f, indexer KL %.6f / %.6f, aux %.6f / %.6f\n",
            absorbed ? "absorbed" : "expanded", static_cast<long long>(chunk), keep ? "" : " (indexer again)",
            run.keep_outputs ? "" : " (outputs again)",
            run.keep_outputs && !run.keep_kda_matrices ? " (KDA matrices again)" : "",
            run.rebuild_ffn_inputs ? " (feed-forward inputs again)" : "",
            aux_loss_coef > 0 ? "" : " (no balance loss)", streamed.loss, whole.loss, streamed.indexer_kl,
            whole.indexer_kl, streamed.aux_loss, whole.aux_loss);
        EXPECT_NEAR(streamed.loss, whole.loss, 1e-3 * whole.loss);
        EXPECT_NEAR(streamed.aux_loss, whole.aux_loss, 1e-3 * whole.aux_loss);
        EXPECT_NEAR(streamed.indexer_kl, whole.indexer_kl, 1e-2 * whole.indexer_kl);
        EXPECT_NEAR(streamed.indexer_closed, whole.indexer_closed, 0.02);
        ASSERT_EQ(streamed.expert_load.size(), whole.expert_load.size());
        for (size_t i = 0; i < whole.expert_load.size(); ++i) {
          ASSERT_EQ(streamed.expert_load[i].size(), whole.expert_load[i].size()) << "layer " << i;
          int64_t routed = 0;
          for (size_t e = 0; e < whole.expert_load[i].size(); ++e) {
            routed += streamed.expert_load[i][e];
            // A token near a routing tie may go either way.
            EXPECT_NEAR(streamed.expert_load[i][e], whole.expert_load[i][e], 4)
                << "layer " << i << " expert " << e;
          }
          if (!whole.expert_load[i].empty()) {
            EXPECT_EQ(routed, static_cast<int64_t>(tokens.size()) * config.num_experts_per_tok)
                << "layer " << i;
          }
        }
        EXPECT_GT(compare_gradients(config, whole_grads, grads), 30);
      }
    }
}

// Without the balance loss each chunk's forward stops at the last layer's attention, which makes
// its carry alone (no output: nothing reads it). With that layer a DSA layer and a KDA layer,
// chunks of 64 (the last layer's carry crosses six chunk boundaries) against the whole sequence.
TEST(CudaStreaming, LastLayerOfEitherKindMakesItsCarryAlone) {
  for (const bool last_kda : {false, true}) {
    SCOPED_TRACE(last_kda ? "the last layer a KDA layer" : "the last layer a DSA layer");
    const ModelConfig config = streaming_config(512, last_kda);
    ModelWeights weights = allocate_weights(config, DType::F32);
    init_weights(config, weights, 13);
    const std::vector<int32_t> tokens = dna(400);
    LossOptions options;
    options.aux_loss_coef = 0.0;
    auto plain = on_gpu(config, weights, true);
    const LossResult whole = plain->loss_and_gradients(tokens, options);
    ModelWeights whole_grads = zero_gradients(config, DType::F32);
    plain->download_gradients(whole_grads);
    options.chunk_tokens = 64;
    auto device = on_gpu(config, weights, true);
    const LossResult streamed = device->loss_and_gradients(tokens, options);
    ModelWeights grads = zero_gradients(config, DType::F32);
    device->download_gradients(grads);
    std::printf("%s last: loss %.6f / %.6f\n", last_kda ? "KDA" : "DSA", streamed.loss, whole.loss);
    EXPECT_NEAR(streamed.loss, whole.loss, 1e-3 * whole.loss);
    EXPECT_GT(compare_gradients(config, whole_grads, grads), 30);
  }
}

// Two streamed runs whose options differ only in what the recomputation keeps for the backward: the
// same loss bit for bit (the head runs on the same recomputation) and the same gradients but for
// the order of the backward's atomic sums.
void expect_same_step(const LossOptions& plain, const LossOptions& changed, const char* what) {
  const ModelConfig config = streaming_config(512);
  ModelWeights weights = allocate_weights(config, DType::F32);
  init_weights(config, weights, 11);
  const std::vector<int32_t> tokens = dna(300);
  std::vector<LossResult> results;
  std::vector<ModelWeights> grads;
  for (const LossOptions* options : {&plain, &changed}) {
    auto device = on_gpu(config, weights, true);
    results.push_back(device->loss_and_gradients(tokens, *options));
    grads.push_back(zero_gradients(config, DType::F32));
    device->download_gradients(grads.back());
  }
  EXPECT_EQ(results[1].loss, results[0].loss);
  EXPECT_EQ(results[1].aux_loss, results[0].aux_loss);
  EXPECT_EQ(results[1].expert_load, results[0].expert_load);
  const auto a = parameter_table(config, grads[0]), b = parameter_table(config, grads[1]);
  double diff = 0, norm = 0;
  int64_t differing = 0, values = 0;
  for (size_t i = 0; i < a.size(); ++i)
    for (int64_t j = 0; j < a[i].tensor.numel(); ++j) {
      const double x = a[i].tensor.item_as_double(j), y = b[i].tensor.item_as_double(j);
      diff += (x - y) * (x - y), norm += x * x;
      differing += x != y;
      ++values;
    }
  std::printf("%s: loss %.9f / %.9f, %lld of %lld gradient values differ, relative difference %.3g\n", what,
              results[1].loss, results[0].loss, static_cast<long long>(differing),
              static_cast<long long>(values), std::sqrt(diff / norm));
  EXPECT_GT(norm, 0);
  EXPECT_LT(std::sqrt(diff / norm), 1e-4);
}

LossOptions streamed_in_64s() {
  LossOptions options;
  options.chunk_tokens = 64;
  options.indexer_kl_coef = 0.5;
  options.aux_loss_coef = 0.01;
  return options;
}

// The feed-forward sites' inputs made again before their backwards (one combine from the attention
// site's input, its kept output and coefficients) and the kept attention outputs and MoE products
// (LossOptions::rebuild_ffn_inputs).
TEST(CudaStreaming, FeedForwardInputsMadeAgainChangeNothing) {
  LossOptions rebuilt = streamed_in_64s();
  rebuilt.rebuild_ffn_inputs = true;
  expect_same_step(streamed_in_64s(), rebuilt, "feed-forward inputs again");
}

// The last KDA layers' input projections kept from the recomputation for their backwards
// (LossOptions::kda_projections_kept), with the feed-forward inputs made again as the 1M step runs:
// one layer kept and the others made again, and every layer kept (more than the model has).
TEST(CudaStreaming, KeptKdaProjectionsChangeNothing) {
  LossOptions plain = streamed_in_64s();
  plain.rebuild_ffn_inputs = true;
  for (const int64_t layers : {1, 64}) {
    LossOptions kept = plain;
    kept.kda_projections_kept = layers;
    expect_same_step(
        plain, kept,
        layers == 1 ? "KDA projections kept in the last layer" : "KDA projections kept in every layer");
  }
}

// The union form of the DSA attention (docs/UNION_ATTENTION.md: on by default where its fused
// kernels take the heads' widths, 128 here), on the whole sequence and streamed in chunks with the
// recomputation's outputs kept and without, against the whole sequence in the absorbed form
// (SPINDLE_UNION_ATTENTION=0 while that model is made), with the indexers' KL training on the
// attention's mass.
TEST(CudaStreaming, UnionFormInChunksEqualsTheAbsorbedForm) {
  ModelConfig config = streaming_config(512);
  config.qk_nope_head_dim = 128;
  config.v_head_dim = 128;
  ModelWeights weights = allocate_weights(config, DType::F32);
  init_weights(config, weights, 9);
  const std::vector<int32_t> tokens = dna(400);
  LossOptions options;
  options.indexer_kl_coef = 0.5;
  options.aux_loss_coef = 0.01;
  options.scale = 0.5;
  setenv("SPINDLE_UNION_ATTENTION", "0", 1);
  auto plain = on_gpu(config, weights, true);
  unsetenv("SPINDLE_UNION_ATTENTION");
  const LossResult whole = plain->loss_and_gradients(tokens, options);
  ModelWeights whole_grads = zero_gradients(config, DType::F32);
  plain->download_gradients(whole_grads);
  EXPECT_EQ(plain->kernel_report().find("dsa/attention/union:"), std::string::npos);
  for (const auto& [chunk, keep_outputs] :
       {std::pair<int64_t, bool>{0, false}, {37, true}, {64, false}}) {  // 0: the whole sequence
    SCOPED_TRACE("chunks of " + std::to_string(chunk) +
                 (keep_outputs ? ", outputs kept" : ", outputs again"));
    LossOptions streamed_options = options;
    streamed_options.chunk_tokens = chunk;
    streamed_options.keep_outputs = keep_outputs;
    auto device = on_gpu(config, weights, true);
    const LossResult streamed = device->loss_and_gradients(tokens, streamed_options);
    ModelWeights grads = zero_gradients(config, DType::F32);
    device->download_gradients(grads);
    std::printf("union form, chunks of %lld: loss %.6f / absorbed %.6f, indexer KL %.6f / %.6f\n",
                static_cast<long long>(chunk), streamed.loss, whole.loss, streamed.indexer_kl,
                whole.indexer_kl);
    EXPECT_NE(device->kernel_report().find("dsa/attention/union:"), std::string::npos)
        << "the union form did not run:\n"
        << device->kernel_report();
    EXPECT_NEAR(streamed.loss, whole.loss, 1e-3 * whole.loss);
    EXPECT_NEAR(streamed.indexer_kl, whole.indexer_kl, 1e-2 * whole.indexer_kl);
    EXPECT_GT(compare_gradients(config, whole_grads, grads), 30);
  }
}

}  // namespace
}  // namespace spindle
