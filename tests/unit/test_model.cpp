// Checkpoint names (on-disk and in-memory forms), save/load round trips, and the forward pass
// in float against double on a random model.
#include <gtest/gtest.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <regex>

#include "core/error.h"
#include "core/random.h"
#include "io/safetensors.h"
#include "model/backward.h"
#include "model/checkpoint.h"
#include "model/flops.h"
#include "model/forward.h"
#include "model/init.h"
#include "model/modules.h"

namespace spindle {
namespace {

namespace fs = std::filesystem;

const std::string kTiny = std::string(SPINDLE_TEST_DATA) + "/configs/tiny.json";

// Weights for c drawn at initializer range 0.2 (double), and n random bases (A, C, G, T) as tokens.
ModelWeights random_weights(ModelConfig& c, uint64_t seed) {
  c.initializer_range = 0.2;
  ModelWeights w = allocate_weights(c, DType::F64);
  init_weights(c, w, seed);
  return w;
}
std::vector<int32_t> random_bases(int64_t n, uint64_t seed) {
  Random rng(seed);
  std::vector<int32_t> tokens(static_cast<size_t>(n));
  for (int32_t& t : tokens) t = static_cast<int32_t>(4 + rng.next() % 4);
  return tokens;
}

// The largest |a[i] - b[i]|.
double max_abs_difference(const std::vector<double>& a, const std::vector<double>& b) {
  double worst = 0;
  for (size_t i = 0; i < a.size(); ++i) worst = std::max(worst, std::abs(a[i] - b[i]));
  return worst;
}

fs::path fresh_dir(const std::string& name) {
  const fs::path dir =
      fs::temp_directory_path() / ("spindle_model_" + name + "_" + std::to_string(::getpid()));
  fs::remove_all(dir);
  fs::create_directories(dir);
  return dir;
}

// A model whose every parameter is random (not at its neutral init), saved in f32.
Model random_model(const fs::path& dir, nlohmann::json overrides = {}) {
  nlohmann::json j;
  std::ifstream(kTiny) >> j;
  for (auto& [k, v] : overrides.items()) j[k] = v;
  ModelConfig config = parse_model_config(j, "tiny");
  ModelWeights weights = allocate_weights(config, DType::F32);
  init_weights(config, weights, 1);
  Random rng(2);
  for (Param& p : parameter_table(config, weights)) {
    float* v = p.tensor.data<float>();
    for (int64_t i = 0; i < p.tensor.numel(); ++i) v[i] += static_cast<float>(0.05 * rng.normal());
  }
  save_model(dir.string(), config, weights, DType::F32);
  return {config, std::move(weights)};
}

void expect_same_weights(Model& a, Model& b) {
  auto ta = parameter_table(a.config, a.weights), tb = parameter_table(b.config, b.weights);
  ASSERT_EQ(ta.size(), tb.size());
  for (size_t i = 0; i < ta.size(); ++i) {
    ASSERT_EQ(ta[i].name, tb[i].name);
    for (int64_t k = 0; k < ta[i].tensor.numel(); ++k)
      ASSERT_EQ(ta[i].tensor.item_as_double(k), tb[i].tensor.item_as_double(k)) << ta[i].name;
  }
}

TEST(Model, SaveLoadRoundTrip) {
  const fs::path dir = fresh_dir("roundtrip");
  Model saved = random_model(dir);
  Model loaded = load_model(dir.string(), DType::F32);
  expect_same_weights(saved, loaded);
  fs::remove_all(dir);
}

// The GPU multiplies by stacked weights as wholes or by their leading rows (DSA's x_proj: q_a's and
// kv_a's rows first, the indexer's wk and compress gate after them): each stack must be its named
// row blocks, in order, and nothing else. Layers: KDA, DSA with its indexer, DSA sharing it.
TEST(Model, StackedWeightsAreTheirNamedBlocksInOrder) {
  nlohmann::json j;
  std::ifstream(kTiny) >> j;
  j["layer_types"] = {"linear_attention", "deepseek_sparse_attention", "deepseek_sparse_attention"};
  j["indexer_types"] = {"full", "full", "shared"};
  j["mlp_layer_types"] = {"dense", "sparse", "sparse"};
  j["num_hidden_layers"] = 3;
  const ModelConfig config = parse_model_config(j, "tiny, one of each attention");
  const ModelWeights w = allocate_weights(config, DType::F32);
  const auto expect_blocks = [](const Tensor& stack, std::initializer_list<const Tensor*> blocks,
                                const std::string& what) {
    const auto* at = static_cast<const char*>(stack.raw());
    for (const Tensor* b : blocks) {
      EXPECT_EQ(b->raw(), at) << what;
      EXPECT_EQ(b->dim(1), stack.dim(1)) << what;
      at += b->nbytes();
    }
    EXPECT_EQ(at, static_cast<const char*>(stack.raw()) + stack.nbytes()) << what;
  };
  const KdaWeights& k = w.layers[0].kda;
  expect_blocks(k.in_proj, {&k.q_proj, &k.k_proj, &k.v_proj, &k.g_a_proj, &k.f_a_proj, &k.b_proj}, "in_proj");
  const DsaWeights &own = w.layers[1].dsa, &shared = w.layers[2].dsa;
  ASSERT_TRUE(own.has_indexer);
  ASSERT_FALSE(shared.has_indexer);
  expect_blocks(own.x_proj, {&own.q_a_proj, &own.kv_a_proj, &own.indexer.wk, &own.indexer.compress_gate},
                "x_proj, own indexer");
  expect_blocks(shared.x_proj, {&shared.q_a_proj, &shared.kv_a_proj}, "x_proj, shared indexer");
  const MlpWeights& dense = w.layers[0].dense;
  expect_blocks(dense.gate_up, {&dense.gate_proj, &dense.up_proj}, "gate_up");
}

// transformers' in-memory names (fused experts, fused conv, attn_hc.fn, forget_gate.*) and the
// short "model." prefix load to the same weights as the on-disk names.
TEST(Model, InMemoryNamesLoadLikeOnDiskNames) {
  const fs::path dir = fresh_dir("inmemory");
  Model saved = random_model(dir);
  const ModelConfig& c = saved.config;
  const SafetensorsReader on_disk = SafetensorsReader::open(dir.string());
  NamedTensors renamed;
  const int64_t E = c.n_routed_experts, I = c.moe_intermediate_size, D = c.hidden_size;
  const int64_t qkv = c.linear_qkv_dim(), K = c.linear_conv_kernel_dim;
  static const std::regex expert(R"(^(.*mlp\.experts\.)(\d+)\.(gate|up|down)_proj\.weight$)");
  static const std::regex conv(R"(^(.*self_attn\.)([qkv])_conv1d\.weight$)");
  std::map<std::string, Tensor> fused;
  for (const std::string& name : on_disk.names()) {
    const Tensor& t = on_disk.get(name);
    std::smatch m;
    if (std::regex_match(name, m, expert)) {
      const int64_t e = std::stoll(m[2].str());
      const std::string kind = m[3].str();
      if (kind == "down") {
        auto& dst = fused[m[1].str() + "down_proj"];
        if (!dst.defined()) dst = Tensor::empty({E, D, I}, DType::F32);
        dst.select(e).copy_from(t);
      } else {
        auto& dst = fused[m[1].str() + "gate_up_proj"];
        if (!dst.defined()) dst = Tensor::empty({E, 2 * I, D}, DType::F32);
        dst.block(e * 2 * I * D + (kind == "up" ? I * D : 0), {I, D}).copy_from(t);
      }
    } else if (std::regex_match(name, m, conv)) {
      auto& dst = fused[m[1].str() + "conv1d.weight"];
      if (!dst.defined()) dst = Tensor::empty({3 * qkv, 1, K}, DType::F32);
      const int64_t part = std::string("qkv").find(m[2].str()[0]);
      dst.block(part * qkv * K, {qkv, 1, K}).copy_from(t);
    } else {
      std::string n =
          std::regex_replace(name, std::regex(R"(\.hc_(attn|ffn)_(fn|base|scale)$)"), ".$1_hc.$2");
      n = std::regex_replace(n, std::regex(R"(self_attn\.(f_a_proj|f_b_proj|dt_bias|A_log))"),
                             "self_attn.forget_gate.$1");
      n = std::regex_replace(n, std::regex("^model\\.language_model\\."), "model.");
      renamed.emplace_back(n, t);
    }
  }
  for (auto& [n, t] : fused)
    renamed.emplace_back(std::regex_replace(n, std::regex("^model\\.language_model\\."), "model."), t);
  const fs::path other = fresh_dir("inmemory_renamed");
  fs::copy_file(dir / "config.json", other / "config.json");
  write_safetensors(other / "model.safetensors", renamed);
  Model loaded = load_model(other.string(), DType::F32);
  expect_same_weights(saved, loaded);
  fs::remove_all(dir);
  fs::remove_all(other);
}

// The vision tower and the multi-token-prediction layer (index num_hidden_layers) are ignored.
TEST(Model, VisionAndMtpTensorsAreIgnored) {
  const fs::path dir = fresh_dir("ignored");
  Model saved = random_model(dir);
  const SafetensorsReader reader = SafetensorsReader::open(dir.string());
  NamedTensors tensors;
  for (const std::string& name : reader.names()) tensors.emplace_back(name, reader.get(name));
  const std::string mtp = "model.language_model.layers." + std::to_string(saved.config.num_hidden_layers);
  tensors.emplace_back(mtp + ".eh_proj.weight", Tensor::zeros({4, 4}, DType::F32));
  tensors.emplace_back(mtp + ".shared_head.norm.weight", Tensor::zeros({4}, DType::F32));
  tensors.emplace_back("model.visual.blocks.0.attn.qkv.weight", Tensor::zeros({3, 3}, DType::BF16));
  write_safetensors(dir / "model.safetensors", tensors);
  Model loaded = load_model(dir.string(), DType::F32);
  expect_same_weights(saved, loaded);
  fs::remove_all(dir);
}

TEST(Model, IntegerWeightIsRejected) {
  const fs::path dir = fresh_dir("intweight");
  Model saved = random_model(dir);
  const SafetensorsReader reader = SafetensorsReader::open(dir.string());
  NamedTensors tensors;
  for (const std::string& name : reader.names()) {
    const Tensor& t = reader.get(name);
    tensors.emplace_back(name, name == "model.language_model.norm.weight" ? t.to(DType::I32) : t);
  }
  write_safetensors(dir / "model.safetensors", tensors);
  try {
    load_model(dir.string(), DType::F32);
    FAIL() << "expected an error";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("norm.weight' has dtype i32"), std::string::npos) << e.what();
  }
  fs::remove_all(dir);
}

TEST(Model, TiedEmbeddingsSaveNoHead) {
  const fs::path dir = fresh_dir("tied");
  Model saved = random_model(dir, {{"tie_word_embeddings", true}});
  const SafetensorsReader reader = SafetensorsReader::open(dir.string());
  EXPECT_FALSE(reader.contains("lm_head.weight"));
  Model loaded = load_model(dir.string(), DType::F64);
  EXPECT_EQ(loaded.weights.lm_head.raw(), loaded.weights.embed_tokens.raw());
  fs::remove_all(dir);
}

// The same model run in float and in double: the float pass is a rounding of the double one.
TEST(Model, FloatForwardTracksDouble) {
  const fs::path dir = fresh_dir("precision");
  random_model(dir);
  Model m32 = load_model(dir.string(), DType::F32);
  Model m64 = load_model(dir.string(), DType::F64);
  Random rng(9);
  std::vector<int32_t> tokens(150);
  for (int32_t& t : tokens) t = static_cast<int32_t>(rng.next() % 16);
  const auto lp32 = sequence_log_probs<float>(m32.config, m32.weights, tokens);
  const auto lp64 = sequence_log_probs<double>(m64.config, m64.weights, tokens);
  ASSERT_EQ(lp32.size(), tokens.size() - 1);
  double worst = 0;
  for (size_t i = 0; i < lp32.size(); ++i) worst = std::max(worst, std::abs(double(lp32[i]) - lp64[i]));
  EXPECT_LT(worst, 1e-4);
  for (double v : lp64) EXPECT_TRUE(std::isfinite(v) && v < 0);
  fs::remove_all(dir);
}

// The CPU reference keeps every residual site; asking it to recompute or offload layer inputs
// (the GPU executor's policies) fails and says so, rather than silently keeping everything.
TEST(Model, CpuReferenceRefusesTheGpuSitePolicies) {
  const fs::path dir = fresh_dir("site_policy");
  random_model(dir);
  Model m = load_model(dir.string(), DType::F64);
  const std::vector<int32_t> tokens = {1, 5, 7, 2, 9, 4};
  for (const SiteMemory memory : {SiteMemory::KeepLayerInputs, SiteMemory::OffloadLayerInputs}) {
    LossOptions options;
    options.site_memory = memory;
    ModelWeights grads = zero_gradients(m.config, DType::F64);
    try {
      loss_and_gradients<double>(m.config, m.weights, tokens, grads, options);
      ADD_FAILURE() << "the CPU reference accepted a GPU site policy";
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find("GPU executor"), std::string::npos) << e.what();
    }
  }
  fs::remove_all(dir);
}

// The log-probs of the first n tokens do not depend on what follows them (causality), including
// through the DSA selection and the MoE.
TEST(Model, ForwardIsCausal) {
  const fs::path dir = fresh_dir("causal");
  random_model(dir);
  Model m = load_model(dir.string(), DType::F64);
  Random rng(10);
  std::vector<int32_t> tokens(120);
  for (int32_t& t : tokens) t = static_cast<int32_t>(rng.next() % 16);
  const auto full = sequence_log_probs<double>(m.config, m.weights, tokens);
  std::vector<int32_t> prefix(tokens.begin(), tokens.begin() + 77);
  const auto part = sequence_log_probs<double>(m.config, m.weights, prefix);
  for (size_t i = 0; i < part.size(); ++i) EXPECT_NEAR(part[i], full[i], 1e-12) << i;
  fs::remove_all(dir);
}

int64_t parameter_count(const ModelConfig& c) {
  ModelWeights shapes = allocate_weights(c, DType::BF16, /*shapes_only=*/true);
  int64_t total = 0;
  for (const Param& p : parameter_table(c, shapes))
    if (p.role != ParamRole::RouterBias) total += p.tensor.numel();
  return total;
}

// The reference configs: the real GLM-5.3-Flash text config, and the shape that fits one H200
// with its optimizer (issue 5): 45 layers, 34 KDA + 11 DSA in the same order, MoE from layer 3.
TEST(Model, ReferenceConfigs) {
  const std::string dir = std::string(SPINDLE_TEST_DATA) + "/../configs/";
  for (const char* name : {"glm53-flash.json", "glm53-flash-4b.json"}) {
    const ModelConfig c = load_model_config(dir + name);
    int64_t dsa = 0;
    for (AttentionKind k : c.layer_types) dsa += k == AttentionKind::Dsa;
    EXPECT_EQ(c.num_hidden_layers, 45) << name;
    EXPECT_EQ(dsa, 11) << name;
    EXPECT_EQ(c.vocab_size, 154880) << name;
    EXPECT_EQ(c.hc_mult, 4) << name;
    for (int64_t i = 0; i < 45; ++i)
      EXPECT_EQ(c.mlp_layer_types[static_cast<size_t>(i)], i < 3 ? MlpKind::Dense : MlpKind::Sparse) << name;
  }
  EXPECT_GT(parameter_count(load_model_config(dir + "glm53-flash.json")), int64_t{300'000'000'000});
  const ModelConfig small = load_model_config(dir + "glm53-flash-4b.json");
  EXPECT_EQ(small.hidden_size, 2048);
  EXPECT_GE(parameter_count(small), int64_t{4'000'000'000});
}

// The analytic count's projections equal 2 x the multiply-adds of every weight matrix a token
// passes through, counted here from the parameter table instead: experts weighted by the
// share a token uses (k of E), conv taps and vectors left out, the tied head counted once more.
TEST(ModelFlops, ProjectionsAreTwiceTheMatricesATokenUses) {
  const ModelConfig c = load_model_config(std::string(SPINDLE_TEST_DATA) + "/configs/tiny.json");
  ModelWeights shapes = allocate_weights(c, DType::F32, true);
  double per_token = 0;
  for (const Param& p : parameter_table(c, shapes)) {
    const bool matrix = p.role == ParamRole::Matrix || p.role == ParamRole::CompressGate;
    if (!matrix || p.tensor.ndim() != 2) continue;  // conv taps are [channels, 1, K]
    double share = 1.0;
    if (p.name.find(".mlp.experts.") != std::string::npos)
      share = static_cast<double>(c.num_experts_per_tok) / static_cast<double>(c.n_routed_experts);
    per_token += 2.0 * static_cast<double>(p.tensor.numel()) * share;
  }
  for (const Param& p : parameter_table(c, shapes))
    if (p.role == ParamRole::HcFn) per_token += 2.0 * static_cast<double>(p.tensor.numel());
  if (c.tie_word_embeddings) per_token += 2.0 * static_cast<double>(c.vocab_size * c.hidden_size);
  const int64_t L = 1000;
  const ModelFlops f = model_flops(c, L);
  EXPECT_NEAR(f.projections, per_token * L, 1e-9 * per_token * L);
  EXPECT_GT(f.kda, 0);
  EXPECT_GT(f.attention, 0);
  EXPECT_GT(f.indexer, 0);
  EXPECT_DOUBLE_EQ(f.training(), 3 * (f.projections + f.kda + f.attention) + f.indexer);
}

// The streaming executor's first brick: a KDA layer run chunk by chunk, carrying the delta-rule
// state and the conv window, equals the layer run over the whole sequence (double). Chunks of
// 1 and 3 tokens split the 4-tap conv window; 64 is a KDA chunk; 97 is none of these.
TEST(Streaming, KdaLayerInChunksEqualsTheWholeSequence) {
  ModelConfig c = load_model_config(std::string(SPINDLE_TEST_DATA) + "/configs/tiny.json");
  c.initializer_range = 0.2;  // large enough that the state matters
  ModelWeights w = allocate_weights(c, DType::F64);
  init_weights(c, w, 3);
  ASSERT_EQ(w.layers[0].attention, AttentionKind::Kda);
  ASSERT_GT(c.linear_conv_kernel_dim, 1);
  const int64_t L = 300, D = c.hidden_size;
  Random rng(4);
  std::vector<double> x(static_cast<size_t>(L * D)), whole(x.size());
  for (double& v : x) v = rng.normal();
  kda_forward(c, w.layers[0].kda, x.data(), L, whole.data());
  double scale = 0;
  for (double v : whole) scale = std::max(scale, std::abs(v));
  ASSERT_GT(scale, 1e-3);
  for (const int64_t chunk : {1, 3, 64, 97}) {
    KdaCarry<double> carry(c);
    std::vector<double> streamed(x.size());
    for (int64_t start = 0; start < L; start += chunk) {
      const int64_t n = std::min(chunk, L - start);
      kda_forward(c, w.layers[0].kda, x.data() + start * D, n, streamed.data() + start * D, carry);
    }
    const double worst = max_abs_difference(streamed, whole);
    EXPECT_LT(worst, 1e-12 * scale) << "chunks of " << chunk;
  }
}

// A DSA layer run chunk by chunk, carrying the earlier tokens' keys/values and indexer keys,
// selects the same keys and computes the same outputs as over the whole sequence (double).
// Chunks of 3 and 5 tokens split the 8-token pools; 300 tokens exceed the top-k (32), so the
// selection matters.
TEST(Streaming, DsaLayerInChunksEqualsTheWholeSequence) {
  ModelConfig c = load_model_config(std::string(SPINDLE_TEST_DATA) + "/configs/tiny.json");
  c.initializer_range = 0.2;
  ModelWeights w = allocate_weights(c, DType::F64);
  init_weights(c, w, 6);
  size_t layer = 0;
  while (layer < w.layers.size() && w.layers[layer].attention != AttentionKind::Dsa) ++layer;
  ASSERT_LT(layer, w.layers.size());
  const DsaWeights& dsa = w.layers[layer].dsa;
  ASSERT_TRUE(dsa.has_indexer);
  const int64_t L = 300, D = c.hidden_size;
  ASSERT_GT(L, c.index_topk);
  Random rng(7);
  std::vector<double> x(static_cast<size_t>(L * D)), whole(x.size());
  for (double& v : x) v = rng.normal();
  std::vector<int32_t> whole_selection;
  dsa_forward(c, dsa, x.data(), L, whole_selection, whole.data());
  const auto width = static_cast<int64_t>(whole_selection.size()) / L;
  double scale = 0;
  for (double v : whole) scale = std::max(scale, std::abs(v));
  ASSERT_GT(scale, 1e-3);
  for (const int64_t chunk : {1, 3, 5, 64, 97}) {
    DsaCarry<double> carry;
    std::vector<double> streamed(x.size());
    int64_t differing = 0;
    for (int64_t start = 0; start < L; start += chunk) {
      const int64_t n = std::min(chunk, L - start);
      std::vector<int32_t> selection;
      dsa_forward(c, dsa, x.data() + start * D, n, selection, streamed.data() + start * D, carry);
      for (int64_t i = 0; i < n * width; ++i)
        differing +=
            selection[static_cast<size_t>(i)] != whole_selection[static_cast<size_t>(start * width + i)];
    }
    EXPECT_EQ(differing, 0) << "selected positions that differ, chunks of " << chunk;
    const double worst = max_abs_difference(streamed, whole);
    EXPECT_LT(worst, 1e-12 * scale) << "chunks of " << chunk;
  }
}

// The whole model, streamed through all layers a chunk at a time, gives the log-probs of the
// plain pass (double): tiny's 3 KDA + 1 DSA layers, MoE, mHC, 300 real DNA tokens.
TEST(Streaming, ModelLogProbsInChunksEqualTheWholeSequence) {
  ModelConfig c = load_model_config(kTiny);
  const ModelWeights w = random_weights(c, 8);
  const std::vector<int32_t> tokens = random_bases(300, 9);
  const std::vector<double> whole = sequence_log_probs<double>(c, w, tokens);
  for (const int64_t chunk : {1, 7, 64, 299}) {
    ForwardOptions options;
    options.chunk_tokens = chunk;
    const std::vector<double> streamed = sequence_log_probs<double>(c, w, tokens, options);
    ASSERT_EQ(streamed.size(), whole.size());
    const double worst = max_abs_difference(streamed, whole);
    EXPECT_LT(worst, 1e-11) << "chunks of " << chunk;
  }
}

// The largest |a - b| over two tensors of one shape, and the largest |b| (the scale it is judged by).
std::pair<double, double> tensor_gap(const Tensor& a, const Tensor& b) {
  double diff = 0, size = 0;
  for (int64_t i = 0; i < a.numel(); ++i) {
    diff = std::max(diff, std::abs(a.item_as_double(i) - b.item_as_double(i)));
    size = std::max(size, std::abs(b.item_as_double(i)));
  }
  return {diff, size};
}

// A KDA layer's backward in chunks, last chunk first, each starting from the carry its forward
// received and handing the carry's gradient (state and conv window) to the chunk before: the
// input and weight gradients equal the whole sequence's (double).
TEST(Streaming, KdaLayerBackwardInChunksEqualsTheWholeSequence) {
  ModelConfig c = load_model_config(std::string(SPINDLE_TEST_DATA) + "/configs/tiny.json");
  c.initializer_range = 0.2;
  ModelWeights w = allocate_weights(c, DType::F64);
  init_weights(c, w, 12);
  const KdaWeights& kda = w.layers[0].kda;
  const int64_t L = 200, D = c.hidden_size;
  Random rng(13);
  std::vector<double> x(static_cast<size_t>(L * D)), dy(x.size()), dx_whole(x.size(), 0.0);
  for (double& v : x) v = rng.normal();
  for (double& v : dy) v = rng.normal();
  ModelWeights whole = zero_gradients(c, DType::F64);
  kda_backward(c, kda, x.data(), L, dy.data(), dx_whole.data(), whole.layers[0].kda);
  double scale = 0;
  for (double v : dx_whole) scale = std::max(scale, std::abs(v));
  ASSERT_GT(scale, 1e-6);
  for (const int64_t chunk : {1, 2, 64, 77}) {
    std::vector<KdaCarry<double>> starts;
    KdaCarry<double> carry(c);
    std::vector<double> y(x.size());
    for (int64_t t0 = 0; t0 < L; t0 += chunk) {
      starts.push_back(carry);
      kda_forward(c, kda, x.data() + t0 * D, std::min(chunk, L - t0), y.data() + t0 * D, carry);
    }
    ModelWeights chunked = zero_gradients(c, DType::F64);
    std::vector<double> dx(x.size(), 0.0);
    KdaCarry<double> carry_grad(c);
    for (size_t k = starts.size(); k-- > 0;) {
      const int64_t t0 = static_cast<int64_t>(k) * chunk, n = std::min(chunk, L - t0);
      kda_backward(c, kda, x.data() + t0 * D, n, dy.data() + t0 * D, dx.data() + t0 * D,
                   chunked.layers[0].kda, starts[k], carry_grad);
    }
    const double worst = max_abs_difference(dx, dx_whole);
    EXPECT_LT(worst, 1e-10 * scale) << "dx, chunks of " << chunk;
    auto a = parameter_table(c, chunked), b = parameter_table(c, whole);
    for (size_t p = 0; p < a.size(); ++p) {
      if (a[p].name.find("layers.0.self_attn.") == std::string::npos) continue;
      const auto [diff, size] = tensor_gap(a[p].tensor, b[p].tensor);
      EXPECT_LE(diff, 1e-10 * size) << a[p].name << ", chunks of " << chunk;
    }
  }
}

// A DSA layer's backward in chunks, last chunk first, over the forward's cache: each chunk adds
// its queries' key/value gradients (and, training the indexer, its pooled keys' gradients) to
// buffers shaped like the cache and sends its own rows' (complete by then) back through kv_b, its
// norm and kv_a (the indexer's key norm, wk and compress_gate). Equal to the whole sequence, with
// and without the indexer's KL.
TEST(Streaming, DsaLayerBackwardInChunksEqualsTheWholeSequence) {
  ModelConfig c = load_model_config(std::string(SPINDLE_TEST_DATA) + "/configs/tiny.json");
  c.initializer_range = 0.2;
  ModelWeights w = allocate_weights(c, DType::F64);
  init_weights(c, w, 14);
  size_t layer = 0;
  while (w.layers[layer].attention != AttentionKind::Dsa) ++layer;
  const DsaWeights& dsa = w.layers[layer].dsa;
  const int64_t L = 200, D = c.hidden_size;
  Random rng(15);
  std::vector<double> x(static_cast<size_t>(L * D)), dy(x.size()), y(x.size());
  for (double& v : x) v = rng.normal();
  for (double& v : dy) v = rng.normal();
  std::vector<int32_t> selection;
  dsa_forward(c, dsa, x.data(), L, selection, y.data());
  const auto width = static_cast<int64_t>(selection.size()) / L;
  for (const double coef : {0.0, 0.7}) {
    std::vector<double> dx_whole(x.size(), 0.0);
    ModelWeights whole = zero_gradients(c, DType::F64);
    IndexerLoss whole_kl{coef};
    dsa_backward(c, dsa, x.data(), L, selection, dy.data(), dx_whole.data(), whole.layers[layer].dsa,
                 &whole_kl);
    EXPECT_EQ(whole_kl.layers, coef > 0 ? 1 : 0);
    double scale = 0;
    for (double v : dx_whole) scale = std::max(scale, std::abs(v));
    ASSERT_GT(scale, 1e-6);
    for (const int64_t chunk : {1, 5, 64, 77}) {
      DsaCarry<double> cache;  // the forward's, chunk by chunk
      std::vector<std::vector<int32_t>> selections;
      for (int64_t t0 = 0; t0 < L; t0 += chunk) {
        selections.emplace_back();
        dsa_forward(c, dsa, x.data() + t0 * D, std::min(chunk, L - t0), selections.back(), y.data() + t0 * D,
                    cache);
      }
      ModelWeights chunked = zero_gradients(c, DType::F64);
      std::vector<double> dx(x.size(), 0.0);
      DsaCacheGrad<double> cache_grad(c, cache);
      IndexerLoss kl{coef};
      for (size_t k = selections.size(); k-- > 0;) {
        const int64_t t0 = static_cast<int64_t>(k) * chunk, n = std::min(chunk, L - t0);
        ASSERT_EQ(static_cast<int64_t>(selections[k].size()), n * width);
        dsa_backward(c, dsa, x.data() + t0 * D, n, selections[k], dy.data() + t0 * D, dx.data() + t0 * D,
                     chunked.layers[layer].dsa, &kl, cache, t0, cache_grad);
      }
      EXPECT_EQ(kl.layers, whole_kl.layers);
      EXPECT_NEAR(kl.kl_sum, whole_kl.kl_sum, 1e-12 * whole_kl.kl_sum) << "chunks of " << chunk;
      const double worst = max_abs_difference(dx, dx_whole);
      EXPECT_LT(worst, 1e-10 * scale) << "dx, chunks of " << chunk;
      auto a = parameter_table(c, chunked), b = parameter_table(c, whole);
      const std::string prefix = "layers." + std::to_string(layer) + ".self_attn.";
      int trained = 0;  // indexer tensors with a gradient
      for (size_t p = 0; p < a.size(); ++p) {
        if (a[p].name.find(prefix) == std::string::npos) continue;
        const auto [diff, size] = tensor_gap(a[p].tensor, b[p].tensor);
        EXPECT_LE(diff, 1e-10 * size) << a[p].name << ", chunks of " << chunk << ", coef " << coef;
        trained += a[p].name.find(".indexer.") != std::string::npos && size > 0;
      }
      if (coef > 0) {
        EXPECT_GT(whole_kl.kl_sum, 0);
        EXPECT_EQ(trained, 7) << "chunks of " << chunk;  // wq_b, wk, k_norm (2), weights_proj, ape, gate
      } else {
        EXPECT_EQ(trained, 0) << "chunks of " << chunk;
      }
    }
  }
}

// The streaming executor's loss and gradients equal the plain path's (double), for chunks that
// split the conv window (1, 3), the 8-token pools (7, 37) and a KDA chunk (64): every parameter,
// through 3 KDA + 1 DSA layers, MoE (with the balance loss) and mHC.
TEST(Streaming, LossAndGradientsInChunksEqualTheWholeSequence) {
  ModelConfig c = load_model_config(kTiny);
  const ModelWeights w = random_weights(c, 16);
  const std::vector<int32_t> tokens = random_bases(160, 17);
  LossOptions plain_options;
  plain_options.aux_loss_coef = 0.05;  // the balance loss: statistics pooled over all chunks first
  ModelWeights whole = zero_gradients(c, DType::F64);
  const LossResult plain = loss_and_gradients<double>(c, w, tokens, whole, plain_options);
  ASSERT_GT(plain.aux_loss, 0);
  auto b = parameter_table(c, whole);
  for (const int64_t chunk : {1, 3, 7, 37, 64}) {
    LossOptions options = plain_options;
    options.chunk_tokens = chunk;
    ModelWeights chunked = zero_gradients(c, DType::F64);
    const LossResult streamed = loss_and_gradients<double>(c, w, tokens, chunked, options);
    EXPECT_NEAR(streamed.loss, plain.loss, 1e-12 * plain.loss) << "chunks of " << chunk;
    EXPECT_NEAR(streamed.aux_loss, plain.aux_loss, 1e-12 * plain.aux_loss) << "chunks of " << chunk;
    auto a = parameter_table(c, chunked);
    int compared = 0;
    for (size_t p = 0; p < a.size(); ++p) {
      const auto [diff, size] = tensor_gap(a[p].tensor, b[p].tensor);
      EXPECT_LE(diff, 1e-9 * size + 1e-15) << a[p].name << ", chunks of " << chunk;
      compared += size > 0;
    }
    EXPECT_GT(compared, 50);
    for (size_t l = 0; l < plain.expert_load.size(); ++l)
      EXPECT_EQ(streamed.expert_load[l], plain.expert_load[l]);
  }
}

// With the indexers trained on their KL (and the balance loss on), the streaming executor's loss,
// indexer KL and every parameter's gradient equal the plain path's (double). Two DSA layers with
// their own indexers and one sharing its predecessor's selection, among KDA layers; chunks of 1,
// 5 and 12 (they split the 8-token pools and the conv window), 37, 64 (pool-aligned) and 200
// (more than the sequence: the plain path).
TEST(Streaming, LossAndGradientsWithTheIndexersKlInChunksEqualTheWholeSequence) {
  nlohmann::json j;
  std::ifstream(kTiny) >> j;
  j["num_hidden_layers"] = 5;
  j["layer_types"] = {"linear_attention", "deepseek_sparse_attention", "deepseek_sparse_attention",
                      "linear_attention", "deepseek_sparse_attention"};
  j["indexer_types"] = {"full", "full", "shared", "full", "full"};
  j["mlp_layer_types"] = {"dense", "sparse", "dense", "sparse", "sparse"};
  ModelConfig c = parse_model_config(j, "tiny, 3 DSA layers");
  const ModelWeights w = random_weights(c, 18);
  ASSERT_FALSE(w.layers[2].dsa.has_indexer);
  const std::vector<int32_t> tokens = random_bases(160, 19);
  LossOptions plain_options;
  plain_options.indexer_kl_coef = 0.3;
  plain_options.aux_loss_coef = 0.05;
  plain_options.scale = 0.5;
  ModelWeights whole = zero_gradients(c, DType::F64);
  const LossResult plain = loss_and_gradients<double>(c, w, tokens, whole, plain_options);
  ASSERT_GT(plain.indexer_kl, 0);
  auto b = parameter_table(c, whole);
  int indexer_tensors = 0;  // with a gradient
  for (const Param& p : b)
    indexer_tensors +=
        p.name.find(".indexer.") != std::string::npos && tensor_gap(p.tensor, p.tensor).second > 0;
  EXPECT_EQ(indexer_tensors, 14);  // 7 in each of layers 1 and 4
  for (const int64_t chunk : {1, 5, 12, 37, 64, 200}) {
    LossOptions options = plain_options;
    options.chunk_tokens = chunk;
    ModelWeights chunked = zero_gradients(c, DType::F64);
    const LossResult streamed = loss_and_gradients<double>(c, w, tokens, chunked, options);
    EXPECT_NEAR(streamed.loss, plain.loss, 1e-12 * plain.loss) << "chunks of " << chunk;
    EXPECT_NEAR(streamed.indexer_kl, plain.indexer_kl, 1e-12 * plain.indexer_kl) << "chunks of " << chunk;
    EXPECT_EQ(streamed.indexer_closed, plain.indexer_closed) << "chunks of " << chunk;
    EXPECT_NEAR(streamed.aux_loss, plain.aux_loss, 1e-12 * plain.aux_loss) << "chunks of " << chunk;
    auto a = parameter_table(c, chunked);
    for (size_t p = 0; p < a.size(); ++p) {
      const auto [diff, size] = tensor_gap(a[p].tensor, b[p].tensor);
      EXPECT_LE(diff, 1e-9 * size + 1e-15) << a[p].name << ", chunks of " << chunk;
    }
  }
}

// An indexer whose queries are all zero has every relu closed: its scores tie at 0 and the KL
// gives it no gradient. The loss reports the share of such queries (spindle train warns on it):
// all of them here, against few at initialisation (4 heads and 2-4 pools a query can close by
// chance in the tiny config).
TEST(IndexerKl, QueriesWithEveryReluClosedAreCountedAndGetNoGradient) {
  ModelConfig c = load_model_config(kTiny);
  ModelWeights w = random_weights(c, 21);
  const std::vector<int32_t> tokens = random_bases(160, 22);
  LossOptions options;
  options.indexer_kl_coef = 0.5;
  const auto indexer_gradient = [&](ModelWeights& g) {
    double largest = 0;
    for (const Param& p : parameter_table(c, g))
      if (p.name.find(".indexer.") != std::string::npos)
        largest = std::max(largest, tensor_gap(p.tensor, p.tensor).second);
    return largest;
  };
  ModelWeights healthy = zero_gradients(c, DType::F64);
  const LossResult before = loss_and_gradients<double>(c, w, tokens, healthy, options);
  EXPECT_LT(before.indexer_closed, 0.1);
  EXPECT_GT(indexer_gradient(healthy), 1e-6);

  int dead = 0;
  for (LayerWeights& layer : w.layers) {
    if (!layer.dsa.has_indexer) continue;
    Tensor& wq_b = layer.dsa.indexer.wq_b;
    std::fill(wq_b.data<double>(), wq_b.data<double>() + wq_b.numel(), 0.0);
    ++dead;
  }
  ASSERT_GT(dead, 0);
  ModelWeights closed = zero_gradients(c, DType::F64);
  const LossResult after = loss_and_gradients<double>(c, w, tokens, closed, options);
  EXPECT_EQ(after.indexer_closed, 1.0);
  EXPECT_GT(after.indexer_kl, 0);  // the attention's mass is not uniform: there is something to learn
  EXPECT_EQ(indexer_gradient(closed), 0.0);
}

}  // namespace
}  // namespace spindle
