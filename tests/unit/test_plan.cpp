// The planner (src/plan): the memory model against the H200 measurements of docs/PERF.md, the
// pick (the fastest policy that fits), infeasibility with its reason, and monotone behaviour.
#include <gtest/gtest.h>

#include <cmath>
#include <map>
#include <optional>
#include <set>
#include <string>
#include <vector>

#include "core/allocator.h"
#include "core/error.h"
#include "plan/execution.h"
#include "plan/planner.h"

namespace spindle::plan {
namespace {

const std::string kConfigs = std::string(SPINDLE_TEST_DATA) + "/../configs/";
constexpr double kGiB = 1024.0 * 1024.0 * 1024.0;

double gib(int64_t bytes) { return static_cast<double>(bytes) / kGiB; }
int64_t bytes(double gib) { return static_cast<int64_t>(gib * kGiB); }

MemoryPrediction today(const ModelConfig& c, int64_t tokens, bool absorbed = false) {
  const Parallel one{1, 1};
  StepOptions options;
  options.absorbed = absorbed;
  return predict_memory(gpu_shapes(c, one), state_bytes(c, one), tokens, Policy{}, options);
}

// A policy's name without the KDA projections the planner fills the room left with
// (Policy::kda_projections_kept).
std::string without_projections(Policy p) {
  p.kda_projections_kept = 0;
  return p.name();
}

PlanRequest request(int64_t tokens, double gpu_gib, double host_gib = 128, int64_t gpus = 1) {
  PlanRequest r;
  r.tokens = tokens;
  r.machine = {gpus, bytes(gpu_gib), bytes(host_gib)};
  return r;
}

// docs/PERF.md, "Training a 2.8 B GLM-5.3-Flash-shaped model on one H200": spindle bench on
// configs/glm53-flash-1b.json (expanded MLA, no indexer KL, no balance loss), H200, commit
// 2322ba8, peak device memory of one training step per length (GiB).
struct Measured {
  int64_t tokens;
  double peak_gib;
};
const std::vector<Measured> kH200Peaks = {
    {1024, 47.5}, {2048, 48.5}, {4096, 50.5}, {16384, 61.2}, {65536, 104.0}};

// What cudaMalloc took on the H200 (CUDA 13), 200 blocks of each size: past 1 MiB whole 2 MiB pages,
// up to 1 MiB shared pages (counted in 512-byte granules).
TEST(Plan, DeviceAllocationsTakeWholePagesPastOneMebibyte) {
  constexpr int64_t MiB = int64_t{1} << 20;
  EXPECT_EQ(device_allocation_bytes(0), 512);
  EXPECT_EQ(device_allocation_bytes(65536), 65536);
  EXPECT_EQ(device_allocation_bytes(MiB - 512), MiB - 512);
  EXPECT_EQ(device_allocation_bytes(MiB), MiB);
  EXPECT_EQ(device_allocation_bytes(MiB + 512), 2 * MiB);
  EXPECT_EQ(device_allocation_bytes(2 * MiB), 2 * MiB);
  EXPECT_EQ(device_allocation_bytes(2 * MiB + 512), 4 * MiB);
  EXPECT_EQ(device_allocation_bytes(3 * MiB), 4 * MiB);
  EXPECT_EQ(device_allocation_bytes(10 * MiB + 512), 12 * MiB);
  EXPECT_EQ(device_allocation_bytes(100 * MiB + 512), 102 * MiB);
}

// Counts from 1 to 2^22: each rounds up to at most 1/8 more (1024 at least) and to itself again,
// and each doubling holds 8 capacities.
TEST(Plan, GeometricCapacityTakesEightSizesPerDoubling) {
  std::map<int, std::set<int64_t>> by_doubling;
  for (int64_t rows = 1; rows <= (int64_t{1} << 22); rows += 1 + rows / 97) {
    const int64_t c = geometric_capacity(rows);
    ASSERT_GE(c, rows);
    ASSERT_LE(c, std::max<int64_t>(1024, rows + rows / 8)) << rows;
    ASSERT_EQ(geometric_capacity(c), c) << rows;
    if (rows > 1024) by_doubling[static_cast<int>(std::log2(static_cast<double>(rows)))].insert(c);
  }
  for (const auto& [doubling, capacities] : by_doubling) EXPECT_LE(capacities.size(), 9u) << doubling;
  EXPECT_EQ(geometric_capacity(100000), 106496);  // 13 of 2^16 / 8
}

TEST(Plan, TodaysExecutorPeakWithinTenPercentOfTheH200) {
  const ModelConfig c = load_model_config(kConfigs + "glm53-flash-1b.json");
  for (const Measured& m : kH200Peaks) {
    const double predicted = gib(today(c, m.tokens).device.peak_total);
    EXPECT_NEAR(predicted, m.peak_gib, 0.1 * m.peak_gib) << m.tokens << " tokens";
  }
}

// docs/PERF.md, "Faster kernels": the same config with the absorbed MLA form on the tensor
// cores (the default since), commit dc699ca, H200.
const std::vector<Measured> kH200AbsorbedPeaks = {
    {1024, 47.53}, {4096, 50.54}, {16384, 61.42}, {65536, 104.91}};

TEST(Plan, AbsorbedExecutorPeakWithinTenPercentOfTheH200) {
  const ModelConfig c = load_model_config(kConfigs + "glm53-flash-1b.json");
  for (const Measured& m : kH200AbsorbedPeaks) {
    const double predicted = gib(today(c, m.tokens, true).device.peak_total);
    EXPECT_NEAR(predicted, m.peak_gib, 0.1 * m.peak_gib) << m.tokens << " tokens";
  }
}

// docs/PERF.md, "The 4B model from 32k to a million tokens": spindle bench on
// configs/glm53-flash-4b.json, H200, the policy the planner picked at each length (the optimizer
// on the host only at 1M, where the device's would not leave 130 GB). Streaming ran the indexer
// again before fb77a11, and keeps the selections as pool lists since; each sublayer's backward
// computed its output again until the recomputation kept them (outputs_again false), and the
// KDA backward its intra-chunk matrices until the recomputation kept them too (the entries
// measured before that say kda_matrices_again). The binaries measured before the DSA caches kept
// the indexer's rows of the last chunk alone (model/cuda/modules.h, DsaCache) kept every token's,
// and those before the KDA backward kept u with the chunk matrices (kernels/cuda/kda.h) kept none:
// their entries say so, and the prediction they are held to counts those rows back and u out.
struct MeasuredPolicy {
  int64_t tokens;
  int64_t chunk;  // 0: the whole sequence in one pass
  bool optimizer_on_host, indexer_again, outputs_again;
  int64_t peak_bytes;
  bool kda_matrices_again = false;
  bool ffn_inputs_again = false;
  bool index_rows_of_every_token = true;
  bool kda_u_kept = false;
  bool pool_lists_of_32_bits = true;  // the kept selections' pool lists before they took 16 bits
  int64_t kda_projections_kept = 0;
};
const std::vector<MeasuredPolicy> kH200FourBillionPeaks = {
    {32768, 0, false, false, false, 134445705728},       // 45fcb91
    {131072, 16384, false, true, true, 110496194048},    // dd0ecd7
    {524288, 16384, false, true, true, 127076548096},    // 45fcb91
    {524288, 16384, false, false, true, 130028806656},   // fb77a11
    {1048576, 16384, true, true, true, 99015827968},     // 45fcb91
    {1048576, 16384, true, false, true, 104921408000}};  // 4e5fce3 and 65d0dee

// The 4B config's candidate for `policy` at `tokens` on one H200, absorbed MLA as bench runs it;
// none when the planner has no such policy.
std::optional<Candidate> four_billion_candidate(int64_t tokens, const Policy& policy) {
  static const ModelConfig c = load_model_config(kConfigs + "glm53-flash-4b.json");
  PlanRequest r = request(tokens, 141);
  r.options.absorbed = true;
  Policy listed = policy;  // the planner lists each with the most KDA projections that fit
  listed.kda_projections_kept = 0;
  for (const Candidate& x : make_plan(c, r).candidates)
    if (x.policy.name() == listed.name()) {
      Candidate kept = x;
      kept.policy = policy;
      kept.memory = predict_memory(gpu_shapes(c, {1, 1}), state_bytes(c, {1, 1}), tokens, policy, r.options);
      return kept;
    }
  return std::nullopt;
}

// The 4B config's shapes on one GPU.
const Shapes& four_billion_shapes() {
  static const Shapes s = gpu_shapes(load_model_config(kConfigs + "glm53-flash-4b.json"), {1, 1});
  return s;
}

// The bf16 keys and pool gates before pooling of `rows` tokens, over the 4B config's indexers.
int64_t four_billion_index_rows(int64_t rows) {
  const Shapes& s = four_billion_shapes();
  int64_t indexers = 0;
  for (const LayerShape& layer : s.layers) indexers += layer.own_indexer ? 1 : 0;
  return indexers * 2 * 2 * rows * s.index_dim;
}

// The fp32 u [64 tokens x 128 columns] of each 64-token chunk and KDA head that the 4B config's KDA
// layers keep with their matrices, over a streamed chunk of `chunk` tokens.
int64_t four_billion_kept_u(int64_t chunk) {
  const Shapes& s = four_billion_shapes();
  int64_t kda_layers = 0;
  for (const LayerShape& layer : s.layers) kda_layers += layer.attention == AttentionKind::Kda ? 1 : 0;
  return kda_layers * (chunk + 63) / 64 * 64 * s.kda_heads * 128 * 4;
}

// What the 4B config's kept pool lists took more as int32 than they do as 16-bit values: every
// kept chunk's (all but the last of `tokens` in chunks of `chunk`), where it fits 16 bits.
int64_t four_billion_pool_lists_narrowed(int64_t tokens, int64_t chunk) {
  const Shapes& s = four_billion_shapes();
  int64_t indexers = 0, bytes = 0;
  for (const LayerShape& layer : s.layers) indexers += layer.own_indexer ? 1 : 0;
  for (int64_t k = 0; (k + 1) * chunk < tokens; ++k)
    if ((k + 1) * chunk / s.kpool <= kPoolsIn16BitLists) bytes += 2 * chunk * s.selected_pools * indexers;
  return bytes;
}

// Each measured peak against the planner's prediction for its policy, within `fraction`.
void expect_four_billion_peaks(const std::vector<MeasuredPolicy>& measured, double fraction) {
  for (const MeasuredPolicy& m : measured) {
    Policy policy;
    policy.activations = m.chunk > 0 ? ActivationPolicy::Stream : ActivationPolicy::KeepSites;
    policy.chunk_tokens = m.chunk;
    policy.optimizer_on_host = m.optimizer_on_host;
    policy.indexer_again = m.indexer_again;
    policy.outputs_again = m.outputs_again;
    policy.kda_matrices_again = m.kda_matrices_again;
    policy.ffn_inputs_again = m.ffn_inputs_again;
    policy.kda_projections_kept = m.kda_projections_kept;
    const std::optional<Candidate> it = four_billion_candidate(m.tokens, policy);
    ASSERT_TRUE(it.has_value()) << m.tokens;
    const bool matrices_kept = m.chunk > 0 && !m.outputs_again && !m.kda_matrices_again;
    const int64_t predicted =
        it->memory.device.peak_total +
        (m.index_rows_of_every_token && m.chunk > 0 ? four_billion_index_rows(m.tokens - m.chunk) : 0) -
        (matrices_kept && !m.kda_u_kept ? four_billion_kept_u(m.chunk) : 0) +
        (m.chunk > 0 && !m.indexer_again && m.pool_lists_of_32_bits
             ? four_billion_pool_lists_narrowed(m.tokens, m.chunk)
             : 0);
    const double bytes = static_cast<double>(m.peak_bytes);
    EXPECT_NEAR(static_cast<double>(predicted), bytes, fraction * bytes)
        << m.tokens << " tokens, " << it->policy.name();
  }
}

// The last KDA layers' input projections kept and the pool lists in 16 bits (docs/PERF.md, "KDA
// projections kept"): 32k in 16k chunks, KDA matrices again, host AdamW, without and with 12 layers'
// projections, on an H100, the binary of fb3834f, one call, 2026-12-06. The two differ by
// 2,329,935,872 bytes, as predicted to the byte.
TEST(Plan, KdaProjectionsKeptPeaksWithinOnePercentOfTheH100) {
  expect_four_billion_peaks(
      {{32768, 16384, true, false, false, 77190319616, true, false, false, true, false},
       {32768, 16384, true, false, false, 79520255488, true, false, false, true, false, 12}},
      0.01);
  const std::optional<Candidate> without = four_billion_candidate(32768, [] {
    Policy p{ActivationPolicy::Stream, 16384, true};
    p.kda_matrices_again = true;
    return p;
  }());
  Policy twelve{ActivationPolicy::Stream, 16384, true};
  twelve.kda_matrices_again = true;
  twelve.kda_projections_kept = 12;
  const std::optional<Candidate> with = four_billion_candidate(32768, twelve);
  ASSERT_TRUE(without && with);
  EXPECT_EQ(with->memory.device.peak_total - without->memory.device.peak_total, 79520255488 - 77190319616);
}

TEST(Plan, FourBillionModelPeaksWithinTenPercentOfTheH200) {
  expect_four_billion_peaks(kH200FourBillionPeaks, 0.1);
}

// The feed-forward inputs made again (docs/PERF.md, "The feed-forward inputs made again"): 64k in
// 16k chunks with the host AdamW on an H100 (the same predictions as on an H200), both ways, the
// binaries of 2cf36f2 and of the change, one call, 2026-12-05.
TEST(Plan, FeedForwardInputsAgainPeaksWithinOnePercentOfTheH100) {
  expect_four_billion_peaks({{65536, 16384, true, false, false, 82264133120},
                             {65536, 16384, true, false, false, 81201925632, false, true}},
                            0.01);
}

// The DSA caches' index rows of the last chunk alone and the KDA matrices' kept u (docs/PERF.md,
// "The index-rows window and kept u, measured"): 32k with the host AdamW on an H100, the binaries of
// 6e2cc5e (both) and of main 117d240 (neither), one call, 2026-12-06. 16k chunks with the outputs
// made again keep no KDA matrices: the two binaries differ by the rows alone; 4k chunks keep them.
TEST(Plan, IndexRowsWindowAndKeptUPeaksWithinOnePercentOfTheH100) {
  expect_four_billion_peaks({{32768, 16384, true, false, true, 56976920064, false, false, false, true},
                             {32768, 16384, true, false, true, 57069194752},
                             {32768, 4096, true, false, false, 42449029120, false, true, false, true}},
                            0.01);
}

// The streamed recomputation's kept outputs (docs/PERF.md, "Kept outputs in the streamed backward,
// and the allocator's pages"): the ledger replays them to within 1% (0.1% measured). 1M at fe244d1
// (its allocator counted 512-byte granules; the pages add little at 1M, whose AdamW state is on
// the host), 512k at 7ded509 (pages counted, the AdamW state one arena on the device); with the
// KDA matrices kept too, 128k at 5f84280, 512k with the host AdamW and 1M at 279630f (the sites'
// mHC mix kept; the 1M step from a trained checkpoint).
TEST(Plan, KeptOutputsPeaksWithinOnePercentOfTheH200) {
  expect_four_billion_peaks({{524288, 16384, false, true, false, 147130920448, true},
                             {1048576, 16384, true, false, false, 124910412288, true},
                             {131072, 16384, false, false, false, 134775352832},
                             {524288, 16384, true, false, false, 104567582208},
                             {1048576, 16384, true, false, false, 129469427200}},
                            0.01);
}

// The kept selections, the kept outputs and the kept KDA matrices each cost memory and save time
// (an indexer pass; a feed-forward pass and the attention cores' once more; the KDA backward's
// matrices): the planner keeps all where they fit, else gives up what saves least first, and runs
// the indexer again where keeping the selections would force a smaller chunk. Making the
// feed-forward inputs again to keep the attention outputs and the MoE products instead is faster
// and, for the 4B config at 16k chunks, smaller too.
TEST(Plan, StreamingKeepsSelectionsWhereTheyFit) {
  const ModelConfig small = load_model_config(kConfigs + "glm53-flash-4b.json");
  PlanRequest r = request(524288, 160);
  r.options.absorbed = true;
  const Plan roomy = make_plan(small, r);
  ASSERT_TRUE(roomy.pick.has_value());
  EXPECT_EQ(without_projections(roomy.candidates[*roomy.pick].policy),
            "stream 16k, feed-forward inputs again");
  r = request(524288, 141, 64);  // too little host memory for the AdamW state there
  r.options.absorbed = true;
  const Plan fits = make_plan(small, r);
  ASSERT_TRUE(fits.pick.has_value());
  EXPECT_EQ(without_projections(fits.candidates[*fits.pick].policy), "stream 16k, KDA matrices again");
  r.machine.gpu_bytes = bytes(137.5);  // the selections would not leave 16k chunks room
  const Plan smaller = make_plan(small, r);
  ASSERT_TRUE(smaller.pick.has_value());
  EXPECT_EQ(without_projections(smaller.candidates[*smaller.pick].policy),
            "stream 16k, indexer twice, KDA matrices again");

  const ModelConfig real = load_model_config(kConfigs + "glm53-flash.json");
  r = request(1 << 20, 170, 1024, 8);
  r.options.absorbed = true;
  const Plan tight = make_plan(real, r);
  ASSERT_TRUE(tight.pick.has_value());
  const Policy& pick = tight.candidates[*tight.pick].policy;
  EXPECT_EQ(pick.chunk_tokens, 16384);
  EXPECT_TRUE(pick.indexer_again) << pick.name();
}

// docs/PERF.md, "The 4B model from 32k to a million tokens": device peaks by Spindle's allocator,
// host peaks as the process's VmHWM, on the H200.
struct MeasuredHostPolicy {
  int64_t tokens;
  ActivationPolicy activations;
  bool optimizer_on_host;
  double device_bytes, host_bytes;
};
const std::vector<MeasuredHostPolicy> kH200FourBillionHostPeaks = {
    {131072, ActivationPolicy::OffloadLayerInputs, false, 128673209856.0, 113852313600.0},  // cec0b99
    {32768, ActivationPolicy::KeepSites, true, 84436462080.0, 92364713984.0},               // bd53358
    {32768, ActivationPolicy::KeepSites, false, 134452613632.0, 19417153536.0},             // 982a7bc
};

TEST(Plan, HostAndDevicePeaksWithinTenPercentOfTheH200) {
  for (const MeasuredHostPolicy& m : kH200FourBillionHostPeaks) {
    Policy policy;
    policy.activations = m.activations;
    policy.optimizer_on_host = m.optimizer_on_host;
    const std::optional<Candidate> it = four_billion_candidate(m.tokens, policy);
    ASSERT_TRUE(it.has_value()) << m.tokens;
    EXPECT_NEAR(static_cast<double>(it->memory.device.peak_total), m.device_bytes, 0.1 * m.device_bytes)
        << it->policy.name();
    EXPECT_NEAR(static_cast<double>(it->memory.host), m.host_bytes, 0.1 * m.host_bytes) << it->policy.name();
  }
}

TEST(Plan, TodaysExecutorCategoriesAt64kWithinTenPercentOfTheH200) {
  // Peaks by category at 65,536 tokens (GiB), the same config and policy, measured again at
  // 3c5f1b0 over two steps (docs/PERF.md, "The head's logits once"): the head's workspace, taken
  // on its first use and kept, is there through the second step's forward, as the ledger has it
  // from the start; a single step's workspace peak is 1.76 GiB.
  const ModelConfig c = load_model_config(kConfigs + "glm53-flash-1b.json");
  const MemoryStats peak = today(c, 65536).device;
  const auto at = [&](MemoryCategory category) { return gib(peak.peak[static_cast<int>(category)]); };
  EXPECT_NEAR(at(MemoryCategory::Weights), 5.19, 0.519);
  EXPECT_NEAR(at(MemoryCategory::Gradients), 10.34, 1.034);
  EXPECT_NEAR(at(MemoryCategory::Optimizer), 31.0, 3.1);
  EXPECT_NEAR(at(MemoryCategory::Activations), 57.24, 5.724);
  EXPECT_NEAR(at(MemoryCategory::Workspace), 2.32, 0.232);
}

TEST(Plan, StateBytesCountEveryParameter) {
  // 2.78 B parameters (spindle info); bf16 matrices, so weights are about 2 bytes per value,
  // gradients 4, AdamW 12 (master, m, v), within the few fp32 small parameters.
  const ModelConfig c = load_model_config(kConfigs + "glm53-flash-1b.json");
  const StateBytes s = state_bytes(c, {1, 1});
  const double n = static_cast<double>(s.parameters);
  EXPECT_NEAR(n / 1e9, 2.78, 0.01);
  EXPECT_NEAR(static_cast<double>(s.weights) / n, 2.0, 0.01);
  EXPECT_NEAR(static_cast<double>(s.gradients) / n, 4.0, 0.01);
  EXPECT_NEAR(static_cast<double>(s.optimizer) / n, 12.0, 0.05);
}

TEST(Plan, PicksTheFastestPolicyThatFits) {
  const ModelConfig c = load_model_config(kConfigs + "glm53-flash-4b.json");
  for (const int64_t tokens : {32768, 131072, 524288}) {
    const Plan p = make_plan(c, request(tokens, 141));
    ASSERT_TRUE(p.pick.has_value()) << tokens;
    const Candidate& pick = p.candidates[*p.pick];
    EXPECT_TRUE(pick.fits());
    for (const Candidate& x : p.candidates)
      if (x.fits()) {
        EXPECT_LE(pick.time.total(), x.time.total()) << tokens << ": " << x.policy.name();
      }
  }
}

TEST(Plan, UsesAMemorySavingOnlyWhenNeeded) {
  const ModelConfig c = load_model_config(kConfigs + "glm53-flash-1b.json");
  const Plan short_plan = make_plan(c, request(4096, 141));
  ASSERT_TRUE(short_plan.pick.has_value());
  const Policy& keep = short_plan.candidates[*short_plan.pick].policy;
  EXPECT_EQ(keep.activations, ActivationPolicy::KeepSites);
  EXPECT_FALSE(keep.optimizer_on_host);
  // At 1M tokens keeping every site's input (90 x 8 GiB) cannot fit: something must give.
  const Plan long_plan = make_plan(c, request(1 << 20, 141, 1024));
  ASSERT_TRUE(long_plan.pick.has_value());
  EXPECT_NE(long_plan.candidates[*long_plan.pick].policy.activations, ActivationPolicy::KeepSites);
}

TEST(Plan, InfeasibleSaysWhy) {
  const ModelConfig c = load_model_config(kConfigs + "glm53-flash-1b.json");
  const Plan small_gpu = make_plan(c, request(65536, 8));  // the weights alone take 5 GiB of 6 usable
  EXPECT_FALSE(small_gpu.pick.has_value());
  for (const Candidate& x : small_gpu.candidates) {
    EXPECT_FALSE(x.fits());
    EXPECT_NE(x.infeasible.find("usable"), std::string::npos) << x.infeasible;
  }
  // Enough GPU for the host-AdamW policies only if the host can hold their state.
  const Plan small_host = make_plan(c, request(65536, 141, 1));
  EXPECT_FALSE(small_host.pick.has_value());
  bool host_reason = false;
  for (const Candidate& x : small_host.candidates) host_reason |= x.infeasible.rfind("host ", 0) == 0;
  EXPECT_TRUE(host_reason);
}

TEST(Plan, MoreMemoryNeverPicksASlowerPolicy) {
  const ModelConfig c = load_model_config(kConfigs + "glm53-flash-4b.json");
  for (const int64_t tokens : {131072, 1 << 20}) {
    double previous = INFINITY;
    for (double gpu = 20; gpu <= 300; gpu += 10) {
      const Plan p = make_plan(c, request(tokens, gpu, 512));
      if (!p.pick) {
        EXPECT_TRUE(std::isinf(previous)) << "a larger GPU lost its plan at " << gpu << " GiB";
        continue;
      }
      const double t = p.candidates[*p.pick].time.total();
      EXPECT_LE(t, previous) << tokens << " tokens, " << gpu << " GiB";
      previous = t;
    }
  }
}

TEST(Plan, SavingPoliciesTakeLessDeviceMemoryThanKeepingEverySite) {
  const ModelConfig c = load_model_config(kConfigs + "glm53-flash-1b.json");
  const Parallel one{1, 1};
  const Shapes s = gpu_shapes(c, one);
  const StateBytes state = state_bytes(c, one);
  const int64_t L = 65536;
  const auto activations = [&](const Policy& p) {
    return predict_memory(s, state, L, p).device.peak[static_cast<int>(MemoryCategory::Activations)];
  };
  const int64_t keep = activations({});
  const int64_t layer_inputs = activations({ActivationPolicy::KeepLayerInputs});
  const int64_t offload = activations({ActivationPolicy::OffloadLayerInputs});
  const int64_t stream = activations({ActivationPolicy::Stream, 4096});
  // One stream buffer [L, 4, hidden] bf16 is 512 MiB: the layer inputs save 45 of them.
  EXPECT_NEAR(gib(keep - layer_inputs), 45 * 0.5, 1.0);
  EXPECT_LT(offload, layer_inputs);
  EXPECT_LT(stream, offload);
  // The offload pool holds exactly the 45 layer inputs.
  EXPECT_EQ(predict_memory(s, state, L, {ActivationPolicy::OffloadLayerInputs}).pinned_pool,
            45 * L * 4 * 1024 * 2);
  // Host AdamW moves the optimizer state off the device.
  const MemoryPrediction host = predict_memory(s, state, L, {ActivationPolicy::KeepSites, 0, true});
  EXPECT_EQ(host.device.peak[static_cast<int>(MemoryCategory::Optimizer)], 0);
  EXPECT_GT(host.host, state.host_optimizer);
}

TEST(Plan, StreamingCarriesAreTheKdaStatesAndDsaCaches) {
  const ModelConfig c = load_model_config(kConfigs + "glm53-flash-1b.json");
  const Shapes s = gpu_shapes(c, {1, 1});
  const int64_t L = 1 << 20, C = 65536;
  // 34 KDA layers: 15 kept states [16, 64, 64] fp32 and conv windows (3 rows of q, k, v: bf16),
  // one state and window gradient (fp32); 11 DSA layers: latent [L, 512] bf16 + fp32 gradient,
  // pooled keys [L / 16, 64] bf16, the indexer's keys and pool gates before pooling, [C, 64]
  // bf16 each (the last chunk's: every chunk starts on a pool), and the selections as pool lists,
  // [L - C, 2048 / 16] of 16 bits (the forward pass leaves the last chunk to its recomputation; every
  // kept chunk's pools are below 65535).
  const int64_t state = 16 * 64 * 64 * 4, window = 3 * 3 * 1024;
  const auto index_rows = [](int64_t rows) { return 11 * (2 * 2 * rows * 64); };
  const int64_t expected = 34 * (15 * (state + 2 * window) + state + 4 * window) + 11 * (6 * L * 512) +
                           11 * (2 * (L / 16) * 64) + index_rows(C) + 11 * (2 * (L - C) * 128);
  EXPECT_EQ(streaming_carry_bytes(s, L, C, {}, true), expected);
  EXPECT_EQ(streaming_carry_bytes(s, L, C, {}, false), expected - 11 * (2 * (L - C) * 128));
  // At 2M the chunks from the 16th on see 65,536 pools or more: their lists take 32 bits.
  const int64_t two = 2 * L;
  EXPECT_EQ(streaming_carry_bytes(s, two, C, {}, true) - streaming_carry_bytes(s, two, C, {}, false),
            11 * 128 * C * (15 * 2 + 16 * 4));
  // A chunk that splits a pool needs the rows before it: every token's are kept.
  const int64_t odd = C + 8;  // 16 chunks still
  EXPECT_EQ(streaming_carry_bytes(s, L, odd, {}, false),
            expected - 11 * (2 * (L - C) * 128) - index_rows(C) + index_rows(L));
  // The indexer's KL reads every token's rows back and adds the pooled keys' fp32 gradient for the
  // sequence and the keys' and gates' bf16 gradients over one chunk and the pool that straddles its
  // start, not over the sequence.
  StepOptions kl;
  kl.indexer_kl = true;
  EXPECT_EQ(
      streaming_carry_bytes(s, L, C, kl, true),
      expected - index_rows(C) + index_rows(L) + 11 * (4 * (L / 16) * 64) + 11 * (2 * 2 * (C + 15) * 64));
}

// The streamed forward pass takes every chunk but the last, whose recomputation is its forward:
// of the extra forward streaming costs, N chunks pay (N - 1) / N.
TEST(Plan, StreamingPaysAnExtraForwardForAllChunksButTheLast) {
  Policy stream;
  stream.activations = ActivationPolicy::Stream;
  stream.chunk_tokens = 16384;
  const double two = forward_passes(stream, 2 * 16384, 0.3, 0.5);
  const double eight = forward_passes(stream, 8 * 16384, 0.3, 0.5);
  const double seven_and_a_bit = forward_passes(stream, 7 * 16384 + 1, 0.3, 0.5);
  EXPECT_NEAR(eight - two, 7.0 / 8 - 1.0 / 2, 1e-12);
  EXPECT_NEAR(seven_and_a_bit, eight, 1e-12);  // a short last chunk is a chunk
  stream.outputs_again = true;
  Policy keep;
  EXPECT_NEAR(forward_passes(stream, 8 * 16384, 0.3, 0.5) - forward_passes(keep, 8 * 16384, 0.3, 0.5),
              7.0 / 8, 1e-12);
}

TEST(Plan, TensorAndExpertParallelismShareTheState) {
  const ModelConfig c = load_model_config(kConfigs + "glm53-flash.json");
  const StateBytes one = state_bytes(c, {1, 1});
  const StateBytes eight = state_bytes(c, {8, 8});
  const StateBytes many = state_bytes(c, {64, 8});
  EXPECT_LT(eight.parameters, one.parameters / 7);
  EXPECT_LT(many.parameters, eight.parameters);
  EXPECT_THROW(gpu_shapes(c, {8, 3}), Error);  // 3 does not divide the heads
}

TEST(Plan, RejectsBadRequests) {
  const ModelConfig c = load_model_config(kConfigs + "glm53-flash-1b.json");
  EXPECT_THROW(make_plan(c, request(0, 141)), Error);
  EXPECT_THROW(make_plan(c, request(4096, 1)), Error);  // less than the reserve
  EXPECT_THROW(make_plan(c, request(4096, 141, 128, 0)), Error);
}

// What bench and train run: the planner's fastest fit among the executor's policies.
TEST(Plan, ExecutionKeepsWhatFitsAndStreamsWhatDoesNot) {
  const ModelConfig small = load_model_config(kConfigs + "glm53-flash-1b.json");
  const ModelConfig large = load_model_config(kConfigs + "glm53-flash-4b.json");
  const Machine h200{1, bytes(141), bytes(128)};
  StepOptions absorbed;
  absorbed.absorbed = true;
  const Execution shorter = plan_execution(small, 4096, h200, absorbed, std::nullopt);
  EXPECT_EQ(shorter.policy.name(), "keep");
  EXPECT_EQ(shorter.chunk_tokens, 0);
  EXPECT_FALSE(shorter.forced);
  const Execution million = plan_execution(large, 1048576, h200, absorbed, std::nullopt);
  EXPECT_EQ(million.policy.activations, ActivationPolicy::Stream);
  EXPECT_GT(million.chunk_tokens, 0);
  EXPECT_LE(million.predicted_peak_bytes, bytes(141) - kDeviceReserveBytes);
  EXPECT_TRUE(executor_runs(million.policy));
}

// The KDA matrices are kept with the outputs or not (never without them): keeping them costs device
// memory and saves time, and the 1M step keeps them under the 130 GB it must stay in. The
// feed-forward inputs are made again only with both kept, and save time.
TEST(Plan, KdaMatricesKeptWithTheOutputsWhereTheyFit) {
  const ModelConfig c = load_model_config(kConfigs + "glm53-flash-4b.json");
  PlanRequest r = request(1048576, 141);
  r.options.absorbed = true;
  const Plan plan = make_plan(c, r);
  std::map<std::string, const Candidate*> by_name;
  for (const Candidate& x : plan.candidates) {
    EXPECT_FALSE(x.policy.outputs_again && x.policy.kda_matrices_again) << x.policy.name();
    EXPECT_FALSE(x.policy.ffn_inputs_again && (x.policy.outputs_again || x.policy.kda_matrices_again))
        << x.policy.name();
    by_name[x.policy.name()] = &x;
  }
  int rebuilt = 0;
  for (const Candidate& x : plan.candidates) {
    if (!x.policy.ffn_inputs_again) continue;
    Policy kept = x.policy;
    kept.ffn_inputs_again = false;
    ASSERT_TRUE(by_name.count(kept.name())) << kept.name();
    // The GPU's work (with the gradients leaving per chunk, a shorter backward hides less of them).
    EXPECT_LT(x.time.compute, by_name[kept.name()]->time.compute) << x.policy.name();
    ++rebuilt;
  }
  EXPECT_GT(rebuilt, 0);
  int pairs = 0;
  for (const Candidate& x : plan.candidates) {
    if (!x.policy.kda_matrices_again) continue;
    Policy kept = x.policy;
    kept.kda_matrices_again = false;
    ASSERT_TRUE(by_name.count(kept.name())) << kept.name();
    const Candidate& k = *by_name[kept.name()];
    EXPECT_LT(x.memory.device.peak_total, k.memory.device.peak_total) << x.policy.name();
    EXPECT_GT(x.time.total(), k.time.total()) << x.policy.name();
    ++pairs;
  }
  EXPECT_GT(pairs, 0);

  // The 1M step planned for 130 GB (the bound: --gpu-mem 123, 121 GiB usable) keeps what
  // fits of the KDA projections; on the whole H200 all of them.
  const Execution million =
      plan_execution(c, 1048576, Machine{1, bytes(123), bytes(128)}, r.options, std::nullopt);
  EXPECT_EQ(without_projections(million.policy), "stream 16k, feed-forward inputs again + host AdamW");
  EXPECT_TRUE(million.keep_outputs);
  EXPECT_TRUE(million.keep_kda_matrices);
  EXPECT_TRUE(million.rebuild_ffn_inputs);
  EXPECT_GT(million.kda_projections_kept, 0);
  EXPECT_LT(million.kda_projections_kept, 34);
  EXPECT_LE(million.predicted_peak_bytes, int64_t{130} * 1000 * 1000 * 1000);
  const Execution whole =
      plan_execution(c, 1048576, Machine{1, bytes(141), bytes(128)}, r.options, std::nullopt);
  EXPECT_EQ(whole.kda_projections_kept, 34);
  EXPECT_LE(whole.predicted_peak_bytes, bytes(141) - kDeviceReserveBytes);
}

// Each streamed policy that keeps outputs and fits comes again with the most KDA layers keeping
// their input projections that still fit: each layer kept costs the same bytes at the peak and
// saves time, and one layer more would not fit (or every KDA layer keeps them).
TEST(Plan, KdaProjectionsFillTheRoomLeft) {
  const ModelConfig c = load_model_config(kConfigs + "glm53-flash-4b.json");
  for (const int64_t tokens : {int64_t{131072}, int64_t{1048576}}) {
    PlanRequest r = request(tokens, 123);
    r.options.absorbed = true;
    const Plan plan = make_plan(c, r);
    std::map<std::string, const Candidate*> by_name;
    for (const Candidate& x : plan.candidates) by_name[x.policy.name()] = &x;
    const Shapes shapes = gpu_shapes(c, {1, 1});
    const StateBytes state = state_bytes(c, {1, 1});
    const int64_t usable = bytes(123) - kDeviceReserveBytes;
    int filled = 0;
    for (const Candidate& x : plan.candidates) {
      if (x.policy.kda_projections_kept == 0) continue;
      ++filled;
      ASSERT_TRUE(by_name.count(without_projections(x.policy))) << x.policy.name();
      const Candidate& base = *by_name[without_projections(x.policy)];
      EXPECT_TRUE(base.fits() && x.fits()) << x.policy.name();
      EXPECT_LT(x.time.total(), base.time.total()) << x.policy.name();
      Policy one_less = x.policy, one_more = x.policy;
      --one_less.kda_projections_kept;
      ++one_more.kda_projections_kept;
      const int64_t at = x.memory.device.peak_total;
      const int64_t less = predict_memory(shapes, state, tokens, one_less, r.options).device.peak_total;
      EXPECT_GT(at, less) << x.policy.name();
      if (x.policy.kda_projections_kept < 34) {
        EXPECT_GT(predict_memory(shapes, state, tokens, one_more, r.options).device.peak_total, usable)
            << x.policy.name();
      }
    }
    EXPECT_GT(filled, 0) << tokens;
  }
}

TEST(Plan, ExecutionTakesAPolicyByItsName) {
  const ModelConfig c = load_model_config(kConfigs + "glm53-flash-4b.json");
  const Machine h200{1, bytes(141), bytes(128)};
  StepOptions absorbed;
  absorbed.absorbed = true;
  const Execution pick = plan_execution(c, 1048576, h200, absorbed, std::nullopt);
  EXPECT_TRUE(pick.rebuild_ffn_inputs);
  const Execution named = plan_execution(c, 1048576, h200, absorbed, std::nullopt, std::nullopt, std::nullopt,
                                         std::string("stream 16k + host AdamW"));
  EXPECT_TRUE(named.forced);
  EXPECT_EQ(named.policy.name(), "stream 16k + host AdamW");
  EXPECT_EQ(named.chunk_tokens, 16384);
  EXPECT_TRUE(named.keep_outputs);
  EXPECT_FALSE(named.rebuild_ffn_inputs);
  EXPECT_LT(named.predicted_peak_bytes, int64_t{130} * 1000 * 1000 * 1000);
  EXPECT_THROW(plan_execution(c, 1048576, h200, absorbed, std::nullopt, std::nullopt, std::nullopt,
                              std::string("stream 16k + host AdamW and gradients")),
               Error);  // planned only
  EXPECT_THROW(
      plan_execution(c, 1048576, h200, absorbed, std::nullopt, true, std::nullopt, std::string("stream 16k")),
      Error);  // the AdamW state is on the host
  EXPECT_THROW(plan_execution(c, 1048576, h200, absorbed, std::nullopt, std::nullopt, std::nullopt,
                              std::string("stream 16 k")),
               Error);
}

TEST(Plan, ExecutionTakesAForcedChunkAndFailsLoudlyWhenNothingFits) {
  const ModelConfig c = load_model_config(kConfigs + "glm53-flash-4b.json");
  const Machine h200{1, bytes(141), bytes(128)};
  const Execution forced = plan_execution(c, 131072, h200, {}, int64_t{16384});
  EXPECT_TRUE(forced.forced);
  EXPECT_EQ(forced.chunk_tokens, 16384);
  EXPECT_EQ(without_projections(forced.policy), "stream 16k, feed-forward inputs again");
  EXPECT_GT(forced.predicted_peak_bytes, 0);
  const Execution odd = plan_execution(c, 131072, h200, {}, int64_t{10000});  // no prediction
  EXPECT_EQ(odd.chunk_tokens, 10000);
  EXPECT_EQ(odd.predicted_peak_bytes, 0);
  EXPECT_EQ(plan_execution(c, 131072, h200, {}, int64_t{0}).chunk_tokens, 0);
  // At 960k with the AdamW state on the device of a 135 GiB GPU, 16k chunks fit only without the
  // kept selections and outputs.
  StepOptions absorbed;
  absorbed.absorbed = true;
  const Execution tight =
      plan_execution(c, 983040, {1, bytes(135), bytes(128)}, absorbed, int64_t{16384}, false);
  EXPECT_EQ(tight.policy.name(), "stream 16k, indexer twice, outputs again");
  EXPECT_FALSE(tight.keep_selections);
  EXPECT_FALSE(tight.keep_outputs);
  EXPECT_LE(tight.predicted_peak_bytes, bytes(135) - kDeviceReserveBytes);
  try {
    plan_execution(c, 1048576, {1, bytes(24), bytes(128)}, {}, std::nullopt);
    ADD_FAILURE() << "a 24 GiB GPU cannot hold the 4B model's state";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("no policy that the executor runs fits"), std::string::npos)
        << e.what();
  }
  EXPECT_TRUE(executor_runs({ActivationPolicy::OffloadLayerInputs, 0, false, 1}));
  EXPECT_TRUE(executor_runs({ActivationPolicy::KeepSites, 0, true, 1}));     // host AdamW
  EXPECT_FALSE(executor_runs({ActivationPolicy::Stream, 16384, false, 2}));  // tensor parallel
}

// --policy forces keep, recompute or offload with the planner's prediction and tells the executor
// what to keep; it excludes --chunk and a streamed policy. Unforced, the planner picks the fastest
// policy that fits.
TEST(Plan, ExecutionTakesAForcedSitePolicy) {
  const ModelConfig c = load_model_config(kConfigs + "glm53-flash-4b.json");
  const Machine h200{1, bytes(141), bytes(128)};
  StepOptions absorbed;
  absorbed.absorbed = true;
  const Execution recompute =
      plan_execution(c, 32768, h200, absorbed, std::nullopt, false, parse_site_policy("recompute"));
  EXPECT_EQ(recompute.policy.name(), "recompute");
  EXPECT_EQ(recompute.site_memory, SiteMemory::KeepLayerInputs);
  EXPECT_EQ(recompute.chunk_tokens, 0);
  EXPECT_TRUE(recompute.forced);
  EXPECT_GT(recompute.predicted_peak_bytes, 0);
  const Execution offload =
      plan_execution(c, 32768, h200, absorbed, std::nullopt, true, parse_site_policy("offload"));
  EXPECT_EQ(offload.policy.name(), "offload + host AdamW");
  EXPECT_EQ(offload.site_memory, SiteMemory::OffloadLayerInputs);
  EXPECT_LT(offload.predicted_peak_bytes, recompute.predicted_peak_bytes);
  EXPECT_EQ(
      plan_execution(c, 32768, h200, absorbed, std::nullopt, false, parse_site_policy("keep")).site_memory,
      SiteMemory::KeepSites);
  EXPECT_THROW(
      plan_execution(c, 32768, h200, absorbed, int64_t{4096}, false, ActivationPolicy::KeepLayerInputs),
      Error);
  EXPECT_THROW(plan_execution(c, 32768, h200, absorbed, std::nullopt, false, ActivationPolicy::Stream),
               Error);
  EXPECT_THROW(parse_site_policy("stream"), Error);
  // At 128k the layer inputs would fit in the host's 128 GiB, but streaming with kept outputs is
  // the faster: offloading recomputes every sublayer once more, from its layer's input (on the
  // H200: 24.4 s a step against 20.8 s).
  const Execution picked = plan_execution(c, 131072, h200, absorbed, std::nullopt);
  EXPECT_EQ(picked.site_memory, SiteMemory::KeepSites) << picked.policy.name();
  EXPECT_GT(picked.chunk_tokens, 0);
  EXPECT_FALSE(picked.forced);
}

}  // namespace
}  // namespace spindle::plan
