// Training utilities: AdamW against PyTorch's formulas, clipping, the lr schedule, gradient
// accumulation, RUN.toml parsing, and checkpoints that resume bit-exactly and survive SIGKILL.
#include <gtest/gtest.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>
#include <nlohmann/json.hpp>
#include <numbers>
#include <random>
#include <set>
#include <sstream>
#include <thread>

#include "core/progress.h"
#include "core/random.h"
#include "io/safetensors.h"
#include "model/checkpoint.h"
#include "model/init.h"
#include "scratch_dir.h"
#include "train/adamw.h"
#include "train/checkpoint_dir.h"
#include "train/grad_accum.h"
#include "train/grad_clip.h"
#include "train/run_config.h"
#include "train/schedule.h"
#include "train/train_state.h"

namespace spindle {
namespace {

namespace fs = std::filesystem;

const std::string kTiny = std::string(SPINDLE_TEST_DATA) + "/configs/tiny.json";

ModelConfig tiny_config(const nlohmann::json& overrides = {}) {
  nlohmann::json j;
  std::ifstream(kTiny) >> j;
  for (auto& [k, v] : overrides.items()) j[k] = v;
  return parse_model_config(j, "tiny");
}

class TrainDir : public ScratchDirTest {};

// The message of the error `body` raises; fails the test if it raises none.
template <class Body>
std::string error_of(Body body) {
  try {
    body();
  } catch (const Error& error) {
    return error.what();
  }
  ADD_FAILURE() << "no error raised";
  return "";
}

#define EXPECT_ERROR(body, ...)                                                                   \
  do {                                                                                            \
    const std::string message = error_of([&] { body; });                                          \
    for (const char* part : {__VA_ARGS__}) {                                                      \
      EXPECT_NE(message.find(part), std::string::npos) << "'" << part << "' not in: " << message; \
    }                                                                                             \
  } while (0)

void fill_normal(Tensor& t, Random& rng, double scale) {
  for (int64_t i = 0; i < t.numel(); ++i) {
    const double v = scale * rng.normal();
    if (t.dtype() == DType::F32)
      t.data<float>()[i] = static_cast<float>(v);
    else
      t.data<double>()[i] = v;
  }
}

void fill_model(const ModelConfig& c, ModelWeights& w, uint64_t seed, double scale) {
  Random rng(seed);
  for (Param& p : parameter_table(c, w)) fill_normal(p.tensor, rng, scale);
}

std::vector<double> values(const Tensor& t) {
  std::vector<double> out(static_cast<size_t>(t.numel()));
  for (int64_t i = 0; i < t.numel(); ++i) out[static_cast<size_t>(i)] = t.item_as_double(i);
  return out;
}

// ---------------------------------------------------------------------------------------------
// AdamW

// torch.optim.AdamW (foreach=False, capturable=False) for one tensor, written out in double.
struct ReferenceAdamW {
  double lr, beta1, beta2, eps, weight_decay;
  std::vector<double> p, m, v;
  int64_t t = 0;

  void step(const std::vector<double>& g, double step_lr, bool decays) {
    ++t;
    if (decays)
      for (double& x : p) x *= 1 - step_lr * weight_decay;  // param.mul_(1 - lr * wd)
    for (size_t i = 0; i < p.size(); ++i) {
      m[i] += (g[i] - m[i]) * (1 - beta1);              // exp_avg.lerp_(grad, 1 - beta1)
      v[i] = v[i] * beta2 + (1 - beta2) * g[i] * g[i];  // exp_avg_sq.mul_(b2).addcmul_(...)
      const double bias_correction1 = 1 - std::pow(beta1, static_cast<double>(t));
      const double bias_correction2 = 1 - std::pow(beta2, static_cast<double>(t));
      const double step_size = step_lr / bias_correction1;
      const double denom = std::sqrt(v[i]) / std::sqrt(bias_correction2) + eps;
      p[i] += -step_size * m[i] / denom;  // param.addcdiv_(exp_avg, denom)
    }
  }
};

// Several AdamW steps on a random model with random gradients (changing lr, as a schedule
// would) match the double reference per parameter, role by role; RouterBias never moves.
void check_adamw_against_reference(DType model_dtype, DType grad_dtype, int steps) {
  const ModelConfig config = tiny_config();
  ModelWeights weights = allocate_weights(config, model_dtype);
  fill_model(config, weights, 11, 0.5);
  ModelWeights grads = allocate_weights(config, grad_dtype);
  const AdamWOptions options{1e-2, 0.9, 0.95, 1e-8, 0.1};
  AdamW adamw(config, weights, options);

  std::vector<Param> table = parameter_table(config, weights);
  std::set<ParamRole> roles;
  std::vector<ReferenceAdamW> reference;
  std::map<std::string, std::vector<double>> router_bias;
  for (const Param& p : table) {
    roles.insert(p.role);
    std::vector<double> start = values(p.tensor);
    if (p.role == ParamRole::RouterBias) router_bias[p.name] = start;
    // The master is the weight rounded to fp32.
    for (double& x : start) x = static_cast<float>(x);
    reference.push_back({options.lr, options.beta1, options.beta2, options.eps, options.weight_decay, start,
                         std::vector<double>(start.size()), std::vector<double>(start.size())});
  }
  // The tiny model has every role, so each decay rule is exercised.
  EXPECT_EQ(roles.size(), 12u);

  Random rng(12);
  for (int s = 0; s < steps; ++s) {
    const double lr = options.lr * (1.0 - 0.1 * s);
    for (Param& g : parameter_table(config, grads)) fill_normal(g.tensor, rng, 1.0);
    const std::vector<Param> grad_table = parameter_table(config, grads);
    adamw.step(grads, lr);
    for (size_t i = 0; i < table.size(); ++i) {
      if (table[i].role == ParamRole::RouterBias) continue;
      reference[i].step(values(grad_table[i].tensor), lr, role_decays(table[i].role));
    }
  }
  EXPECT_EQ(adamw.steps(), steps);

  size_t slot = 0;
  for (size_t i = 0; i < table.size(); ++i) {
    const std::vector<double> got = values(table[i].tensor);
    if (table[i].role == ParamRole::RouterBias) {
      EXPECT_EQ(got, router_bias[table[i].name]) << table[i].name << " must not be trained by AdamW";
      continue;
    }
    const AdamW::Slot& s = adamw.slots()[slot++];
    ASSERT_EQ(s.name, table[i].name);
    const ReferenceAdamW& r = reference[i];
    for (size_t k = 0; k < got.size(); ++k) {
      // fp32 state: a few roundings of relative size 6e-8 per step; m cancels (random signs), so
      // its error is relative to the gradients' size (~1), not to its own.
      ASSERT_NEAR(got[k], r.p[k], 1e-6 * std::abs(r.p[k]) + 1e-7) << table[i].name << "[" << k << "]";
      ASSERT_EQ(got[k], static_cast<double>(s.master.data<float>()[k]))
          << "weights are written from the masters";
      ASSERT_NEAR(s.exp_avg.data<float>()[k], r.m[k], 1e-6 * std::abs(r.m[k]) + 1e-7) << table[i].name;
      ASSERT_NEAR(s.exp_avg_sq.data<float>()[k], r.v[k], 1e-6 * std::abs(r.v[k]) + 1e-12) << table[i].name;
    }
  }
  EXPECT_EQ(slot, adamw.slots().size());
}

// Long work reports how far it is, at most once per interval: a step that finishes within the
// interval prints nothing.
TEST(Progress, ReportsAtMostOncePerInterval) {
  std::ostringstream captured;
  std::streambuf* saved = std::cerr.rdbuf(captured.rdbuf());
  Progress quiet("quiet step", 3600.0);
  for (size_t k = 0; k < 8; ++k) quiet.update("forward chunk", k, 8);
  Progress chatty("long step", 0.0);
  chatty.update("backward chunk", 3, 8);
  std::cerr.rdbuf(saved);
  const std::string text = captured.str();
  EXPECT_EQ(text.find("quiet step"), std::string::npos) << text;
  EXPECT_NE(text.find("long step: backward chunk 3/8, 0 s"), std::string::npos) << text;
}

TEST(AdamW, OneStepMatchesPyTorchFormulas) { check_adamw_against_reference(DType::F64, DType::F64, 1); }
TEST(AdamW, SeveralStepsMatchPyTorchFormulasF64Model) {
  check_adamw_against_reference(DType::F64, DType::F64, 5);
}
TEST(AdamW, SeveralStepsMatchPyTorchFormulasF32Model) {
  check_adamw_against_reference(DType::F32, DType::F32, 5);
}
TEST(AdamW, MixedModelAndGradientDtypes) { check_adamw_against_reference(DType::F32, DType::F64, 3); }

// bf16 weights (the host AdamW's copies of the device's): the update runs on the same fp32
// masters as for an f32 model started from the same values, and each weight is its master rounded
// to bf16, written in the update's pass.
TEST(AdamW, Bf16WeightsAreTheirMastersRounded) {
  const ModelConfig config = tiny_config();
  ModelWeights bf16_weights = allocate_weights(config, DType::BF16);
  ModelWeights f32_weights = allocate_weights(config, DType::F32);
  fill_model(config, f32_weights, 13, 0.5);
  std::vector<Param> bf16_table = parameter_table(config, bf16_weights);
  std::vector<Param> f32_table = parameter_table(config, f32_weights);
  for (size_t i = 0; i < f32_table.size(); ++i) {
    bf16_table[i].tensor.copy_from(f32_table[i].tensor);
    f32_table[i].tensor.copy_from(bf16_table[i].tensor);  // the same starting values
  }
  const AdamWOptions options{1e-2, 0.9, 0.95, 1e-8, 0.1};
  AdamW on_bf16(config, bf16_weights, options), on_f32(config, f32_weights, options);
  ModelWeights grads = allocate_weights(config, DType::F32);
  Random rng(14);
  for (int step = 0; step < 3; ++step) {
    for (Param& g : parameter_table(config, grads)) fill_normal(g.tensor, rng, 1.0);
    on_bf16.step(grads, options.lr);
    on_f32.step(grads, options.lr);
  }
  ASSERT_EQ(on_bf16.slots().size(), on_f32.slots().size());
  for (size_t i = 0; i < on_bf16.slots().size(); ++i) {
    const AdamW::Slot& a = on_bf16.slots()[i];
    const AdamW::Slot& b = on_f32.slots()[i];
    const float* master = a.master.data<float>();
    const uint16_t* weight = static_cast<const uint16_t*>(a.weight.raw());
    for (int64_t k = 0; k < a.master.numel(); ++k) {
      ASSERT_EQ(master[k], b.master.data<float>()[k]) << a.name << "[" << k << "]";
      ASSERT_EQ(weight[k], float_to_bf16(master[k])) << a.name << "[" << k << "]";
    }
  }
}

// With zero gradients the Adam term vanishes and only decoupled weight decay remains: exactly
// the matrices and the embedding shrink by (1 - lr * wd); every other role stays put.
TEST(AdamW, WeightDecayOnlyOnMatricesAndEmbedding) {
  const ModelConfig config = tiny_config();
  ModelWeights weights = allocate_weights(config, DType::F64);
  fill_model(config, weights, 3, 1.0);
  for (Param& p : parameter_table(config, weights))  // exactly representable in f32
    for (int64_t i = 0; i < p.tensor.numel(); ++i)
      p.tensor.data<double>()[i] = static_cast<float>(p.tensor.data<double>()[i]);
  std::map<std::string, std::vector<double>> before;
  for (Param& p : parameter_table(config, weights)) before[p.name] = values(p.tensor);
  ModelWeights grads = allocate_weights(config, DType::F64);
  zero_grads(config, grads);
  AdamW adamw(config, weights, {0.5, 0.9, 0.95, 1e-8, 0.2});
  adamw.step(grads);
  for (Param& p : parameter_table(config, weights)) {
    const std::vector<double> now = values(p.tensor);
    const bool decays = p.role == ParamRole::Matrix || p.role == ParamRole::Embedding;
    EXPECT_EQ(role_decays(p.role), decays) << p.name;
    for (size_t k = 0; k < now.size(); ++k) {
      const double expected = decays ? static_cast<float>(before[p.name][k] * 0.9) : before[p.name][k];
      ASSERT_EQ(now[k], expected) << p.name << "[" << k << "]";
    }
  }
}

// The update is vectorised (an AVX2 clone where the CPU has it): it must give the bits of the
// scalar formula, fp64 operations in the written order with no fused multiply-add, on bf16
// weights and fp32 gradients as the host AdamW runs it, at the second step (bias corrections < 1).
TEST(AdamW, VectorisedUpdateGivesTheScalarFormulasBits) {
  const ModelConfig config = tiny_config();
  ModelWeights weights = allocate_weights(config, DType::BF16);
  ModelWeights f32 = allocate_weights(config, DType::F32);
  fill_model(config, f32, 21, 0.5);
  std::vector<Param> table = parameter_table(config, weights), f32_table = parameter_table(config, f32);
  for (size_t i = 0; i < table.size(); ++i) table[i].tensor.copy_from(f32_table[i].tensor);
  const AdamWOptions options{3e-3, 0.9, 0.95, 1e-8, 0.1};
  AdamW adamw(config, weights, options);
  ModelWeights first_grads = allocate_weights(config, DType::F32),
               grads = allocate_weights(config, DType::F32);
  Random rng(22);
  for (ModelWeights* g : {&first_grads, &grads})
    for (Param& p : parameter_table(config, *g)) fill_normal(p.tensor, rng, 1.0);
  adamw.step(first_grads, options.lr);
  struct State {
    std::vector<float> p, m, v;
  };
  std::vector<State> before;
  for (const AdamW::Slot& s : adamw.slots()) {
    const auto copy = [](const Tensor& t) {
      return std::vector<float>(t.data<float>(), t.data<float>() + t.numel());
    };
    before.push_back({copy(s.master), copy(s.exp_avg), copy(s.exp_avg_sq)});
  }
  const double lr = 2e-3, b1 = options.beta1, b2 = options.beta2;
  adamw.step(grads, lr);
  const double step_size = lr / (1.0 - std::pow(b1, 2.0)), bc2_sqrt = std::sqrt(1.0 - std::pow(b2, 2.0));
  const std::vector<Param> grad_table = parameter_table(config, grads);
  size_t slot = 0;
  int64_t checked = 0;
  for (const Param& g : grad_table) {
    if (!role_trained(g.role)) continue;
    const AdamW::Slot& s = adamw.slots()[slot];
    const State& b = before[slot++];
    const double decay = role_decays(g.role) ? 1.0 - lr * options.weight_decay : 1.0;
    for (int64_t k = 0; k < g.tensor.numel(); ++k, ++checked) {
      const double gk = g.tensor.data<float>()[k];
      const double mk = b1 * b.m[k] + (1.0 - b1) * gk;
      const double vk = b2 * b.v[k] + (1.0 - b2) * gk * gk;
      const double pk = decay * b.p[k] - step_size * mk / (std::sqrt(vk) / bc2_sqrt + options.eps);
      ASSERT_EQ(s.exp_avg.data<float>()[k], static_cast<float>(mk)) << s.name << "[" << k << "]";
      ASSERT_EQ(s.exp_avg_sq.data<float>()[k], static_cast<float>(vk)) << s.name << "[" << k << "]";
      ASSERT_EQ(s.master.data<float>()[k], static_cast<float>(pk)) << s.name << "[" << k << "]";
      ASSERT_EQ(static_cast<const uint16_t*>(s.weight.raw())[k], float_to_bf16(static_cast<float>(pk)));
    }
  }
  EXPECT_EQ(slot, adamw.slots().size());
  EXPECT_GT(checked, 10000);  // long rows: the vector loop's body, not only its scalar tail

  // In batches (as the host AdamW pipelines it with its copies): the same bits, every slot in
  // exactly one batch, in order, each announced before and after its update.
  ModelWeights batched_weights = allocate_weights(config, DType::BF16);
  std::vector<Param> batched_table = parameter_table(config, batched_weights);
  for (size_t i = 0; i < table.size(); ++i) batched_table[i].tensor.copy_from(f32_table[i].tensor);
  AdamW batched(config, batched_weights, options);
  batched.step(first_grads, options.lr);  // the same two steps as above
  std::vector<std::pair<size_t, size_t>> announced, finished;
  AdamWBatches batches;
  batches.elements = 1000;
  batches.before = [&](size_t first, size_t last) { announced.emplace_back(first, last); };
  batches.after = [&](size_t first, size_t last) {
    finished.emplace_back(first, last);
    for (size_t i = first; i < last; ++i)  // this batch's slots are updated by now
      ASSERT_EQ(batched.slots()[i].master.data<float>()[0], adamw.slots()[i].master.data<float>()[0]);
  };
  batched.step(grads, lr, batches);
  ASSERT_GT(announced.size(), 3u);
  EXPECT_EQ(announced, finished);
  for (size_t b = 0; b < announced.size(); ++b)
    EXPECT_EQ(announced[b].first, b == 0 ? 0 : announced[b - 1].second) << "batch " << b;
  EXPECT_EQ(announced.back().second, adamw.slots().size());
  for (size_t i = 0; i < adamw.slots().size(); ++i) {
    const AdamW::Slot& a = adamw.slots()[i];
    const AdamW::Slot& b = batched.slots()[i];
    EXPECT_EQ(0, std::memcmp(a.master.raw(), b.master.raw(), a.master.nbytes())) << a.name;
    EXPECT_EQ(0, std::memcmp(a.exp_avg_sq.raw(), b.exp_avg_sq.raw(), a.exp_avg_sq.nbytes())) << a.name;
    EXPECT_EQ(0, std::memcmp(a.weight.raw(), b.weight.raw(), a.weight.nbytes())) << a.name;
  }
}

// The host AdamW's device share (backend/cuda/host_optimizer.h): the last slots' state where the
// caller puts it (built as AdamW's own), and a step limited to the first slots updates those as a
// whole step would and leaves the rest as they were, for the device to update with constants() of
// the same step, which are the step's own (the formulas' in fp64).
TEST(AdamW, FirstSlotsHereTheRestWithTheStepsConstants) {
  const ModelConfig config = tiny_config();
  const AdamWOptions options{3e-3, 0.9, 0.95, 1e-8, 0.1};
  ModelWeights whole_weights = allocate_weights(config, DType::F32),
               part_weights = allocate_weights(config, DType::F32);
  fill_model(config, whole_weights, 31, 0.5);
  fill_model(config, part_weights, 31, 0.5);
  AdamW whole(config, whole_weights, options);
  // The second half of the slots' state in memory of the caller's (as the device share's is pinned).
  const size_t here = whole.slots().size() / 2;
  std::vector<int64_t> offsets(whole.slots().size(), -1);
  int64_t room_values = 0;
  for (size_t i = here; i < whole.slots().size(); ++i) {
    offsets[i] = room_values;
    room_values += 3 * whole.slots()[i].master.numel();
  }
  auto room = std::make_shared<std::vector<float>>(static_cast<size_t>(room_values), -1.0f);
  AdamWStateStorage storage{
      room, [&](size_t slot, int64_t) { return offsets[slot] < 0 ? nullptr : room->data() + offsets[slot]; }};
  AdamW part(config, part_weights, options, storage);
  for (size_t i = 0; i < part.slots().size(); ++i) {
    const AdamW::Slot& s = part.slots()[i];
    if (i >= here) {
      EXPECT_EQ(s.master.data<float>(), room->data() + offsets[i]) << s.name;
      EXPECT_EQ(s.exp_avg_sq.data<float>(), room->data() + offsets[i] + 2 * s.master.numel()) << s.name;
    }
    EXPECT_EQ(0, std::memcmp(s.master.raw(), whole.slots()[i].master.raw(), s.master.nbytes())) << s.name;
    EXPECT_EQ(0, std::memcmp(s.exp_avg.raw(), whole.slots()[i].exp_avg.raw(), s.exp_avg.nbytes())) << s.name;
  }
  ModelWeights grads = allocate_weights(config, DType::F32);
  Random rng(32);
  for (Param& p : parameter_table(config, grads)) fill_normal(p.tensor, rng, 1.0);
  whole.step(grads, options.lr);
  part.step(grads, options.lr);
  std::vector<std::vector<float>> masters_before;
  for (const AdamW::Slot& s : part.slots())
    masters_before.emplace_back(s.master.data<float>(), s.master.data<float>() + s.master.numel());
  const double lr = 2e-3;
  whole.step(grads, lr);
  AdamWBatches batches;
  batches.slots = here;
  part.step(grads, lr, batches);
  for (size_t i = 0; i < part.slots().size(); ++i) {
    const AdamW::Slot &a = whole.slots()[i], &b = part.slots()[i];
    if (i < here)
      EXPECT_EQ(0, std::memcmp(a.master.raw(), b.master.raw(), a.master.nbytes())) << a.name;
    else
      EXPECT_EQ(0, std::memcmp(masters_before[i].data(), b.master.raw(), b.master.nbytes())) << b.name;
  }
  EXPECT_EQ(part.steps(), 2);
  for (const bool decays : {false, true}) {
    const AdamWConstants c = part.constants(decays, lr, 2);
    EXPECT_EQ(c.beta1, options.beta1);
    EXPECT_EQ(c.beta2, options.beta2);
    EXPECT_EQ(c.step_size, lr / (1.0 - std::pow(options.beta1, 2.0)));
    EXPECT_EQ(c.bc2_sqrt, std::sqrt(1.0 - std::pow(options.beta2, 2.0)));
    EXPECT_EQ(c.eps, options.eps);
    EXPECT_EQ(c.decay, decays ? 1.0 - lr * options.weight_decay : 1.0);
  }
}

TEST(AdamW, FrozenSlotsAndBadInput) {
  const ModelConfig config = tiny_config();
  ModelWeights weights = allocate_weights(config, DType::F32);
  fill_model(config, weights, 5, 1.0);
  ModelWeights grads = allocate_weights(config, DType::F32);
  fill_model(config, grads, 6, 1.0);
  AdamW adamw(config, weights);
  AdamW::Slot& frozen = adamw.slots().front();
  frozen.frozen = true;
  const std::vector<double> before = values(frozen.weight), second = values(adamw.slots()[1].weight);
  adamw.step(grads);
  EXPECT_EQ(values(frozen.weight), before);
  EXPECT_NE(values(adamw.slots()[1].weight), second);

  const ModelConfig other = tiny_config({{"hidden_size", 64}});
  ModelWeights wrong = allocate_weights(other, DType::F32);
  EXPECT_ERROR(adamw.step(wrong), "AdamW: gradient", "has shape");
  EXPECT_ERROR((AdamW(config, weights, {1e-3, 1.0, 0.95, 1e-8, 0.1})), "beta1");
  EXPECT_ERROR((AdamW(config, weights, {1e-3, 0.9, 0.95, 0.0, 0.1})), "eps");
  EXPECT_ERROR(adamw.step(grads, -1.0), "learning rate");
  // A gradient dtype the update does not take is an error before anything moves (the update
  // itself runs on worker threads, which could not report it).
  ModelWeights bf16_grads = allocate_weights(config, DType::BF16);
  const std::vector<double> kept = values(adamw.slots()[1].weight);
  const int64_t steps = adamw.steps();
  EXPECT_ERROR(adamw.step(bf16_grads), "AdamW: gradient", "dtype bf16 is not supported");
  EXPECT_EQ(values(adamw.slots()[1].weight), kept);
  EXPECT_EQ(adamw.steps(), steps);
}

// The host AdamW's share: the default unless SPINDLE_HOST_ADAMW_SHARE says otherwise, and a clear
// error for anything but a number in (0, 1].
TEST(AdamW, HostShareFromTheEnvironment) {
  unsetenv("SPINDLE_HOST_ADAMW_SHARE");
  EXPECT_EQ(host_adamw_host_share(), kHostAdamWHostShare);
  setenv("SPINDLE_HOST_ADAMW_SHARE", "0.65", 1);
  EXPECT_EQ(host_adamw_host_share(), 0.65);
  setenv("SPINDLE_HOST_ADAMW_SHARE", "1", 1);
  EXPECT_EQ(host_adamw_host_share(), 1.0);
  for (const char* bad : {"0", "1.5", "-0.2", "", "half", "0.5x", "nan"}) {
    setenv("SPINDLE_HOST_ADAMW_SHARE", bad, 1);
    EXPECT_ERROR(host_adamw_host_share(), "SPINDLE_HOST_ADAMW_SHARE must be a number in (0, 1]");
  }
  unsetenv("SPINDLE_HOST_ADAMW_SHARE");
}

// ---------------------------------------------------------------------------------------------
// Clipping and accumulation

TEST(GradClip, GlobalNormSkipsRouterBiasAndScalesLikePyTorch) {
  const ModelConfig config = tiny_config();
  ModelWeights grads = allocate_weights(config, DType::F64);
  fill_model(config, grads, 21, 0.1);
  double sum = 0;
  for (Param& p : parameter_table(config, grads)) {
    if (p.role == ParamRole::RouterBias) {
      for (int64_t i = 0; i < p.tensor.numel(); ++i) p.tensor.data<double>()[i] = 1e6;  // ignored
      continue;
    }
    for (double x : values(p.tensor)) sum += x * x;
  }
  const double norm = std::sqrt(sum);
  EXPECT_NEAR(global_grad_norm(config, grads), norm, 1e-12 * norm);

  // max_norm above the norm, or 0: nothing changes.
  std::map<std::string, std::vector<double>> before;
  for (Param& p : parameter_table(config, grads)) before[p.name] = values(p.tensor);
  EXPECT_NEAR(clip_grad_norm(config, grads, 2 * norm), norm, 1e-12 * norm);
  EXPECT_NEAR(clip_grad_norm(config, grads, 0.0), norm, 1e-12 * norm);
  for (Param& p : parameter_table(config, grads)) EXPECT_EQ(values(p.tensor), before[p.name]) << p.name;

  // Below: every trained gradient times max_norm / (norm + 1e-6); RouterBias untouched.
  const double max_norm = norm / 4;
  const double returned = clip_grad_norm(config, grads, max_norm);
  EXPECT_NEAR(returned, norm, 1e-12 * norm);
  const double coef = max_norm / (returned + 1e-6);
  for (Param& p : parameter_table(config, grads)) {
    const std::vector<double> now = values(p.tensor);
    for (size_t k = 0; k < now.size(); ++k) {
      const double expected = p.role == ParamRole::RouterBias ? 1e6 : before[p.name][k] * coef;
      ASSERT_EQ(now[k], expected) << p.name;
    }
  }
  EXPECT_NEAR(global_grad_norm(config, grads), max_norm * norm / (norm + 1e-6), 1e-12);

  // A non-finite norm is returned and the gradients are left for the caller to skip.
  parameter_table(config, grads)[0].tensor.data<double>()[0] = NAN;
  EXPECT_TRUE(std::isnan(clip_grad_norm(config, grads, 1.0)));
  EXPECT_ERROR(clip_grad_norm(config, grads, -1.0), "max_norm");
}

TEST(GradAccum, MeanOverMicroBatches) {
  const ModelConfig config = tiny_config();
  ModelWeights total = allocate_weights(config, DType::F32);
  fill_model(config, total, 1, 1.0);  // garbage that zero_grads must clear
  zero_grads(config, total);
  for (Param& p : parameter_table(config, total))
    for (double x : values(p.tensor)) ASSERT_EQ(x, 0.0) << p.name;

  const int micro = 3;
  std::vector<ModelWeights> parts;
  for (int i = 0; i < micro; ++i) {
    parts.push_back(allocate_weights(config, i == 1 ? DType::F64 : DType::F32));  // dtypes may mix
    fill_model(config, parts.back(), 100 + static_cast<uint64_t>(i), 1.0);
    add_grads(config, total, parts.back(), 1.0 / micro);
  }
  std::vector<std::vector<Param>> tables;
  for (auto& part : parts) tables.push_back(parameter_table(config, part));
  const std::vector<Param> sum = parameter_table(config, total);
  for (size_t i = 0; i < sum.size(); ++i) {
    const std::vector<double> got = values(sum[i].tensor);
    for (size_t k = 0; k < got.size(); ++k) {
      double mean = 0, magnitude = 0;
      for (int m = 0; m < micro; ++m) {
        const double x = tables[static_cast<size_t>(m)][i].tensor.item_as_double(static_cast<int64_t>(k));
        mean += x / micro;
        magnitude += std::abs(x) / micro;
      }
      // One fp32 rounding per addition, relative to the summands (they may cancel).
      ASSERT_NEAR(got[k], mean, 2e-7 * magnitude + 1e-12) << sum[i].name;
    }
  }
  // An f64 destination accumulates f32 sources exactly (in double).
  ModelWeights exact = allocate_weights(config, DType::F64);
  zero_grads(config, exact);
  add_grads(config, exact, parts[0], 1.0);
  add_grads(config, exact, parts[0], -1.0);
  for (Param& p : parameter_table(config, exact))
    for (double x : values(p.tensor)) ASSERT_EQ(x, 0.0);

  ModelWeights wrong = allocate_weights(tiny_config({{"hidden_size", 64}}), DType::F32);
  EXPECT_ERROR(add_grads(config, total, wrong, 1.0), "add_grads");
}

// ---------------------------------------------------------------------------------------------
// Schedule

TEST(Schedule, WarmupThenCosineByHand) {
  const double P = 1e-3, M = 1e-4;
  const LrSchedule s({P, M, 4, 12});
  // Warmup: P * (s + 1) / W.
  EXPECT_DOUBLE_EQ(s.lr(0), P * 0.25);
  EXPECT_DOUBLE_EQ(s.lr(1), P * 0.5);
  EXPECT_DOUBLE_EQ(s.lr(3), P);
  // Decay: M + (P - M) (1 + cos(pi (s - W + 1) / (T - W))) / 2, T - W = 8.
  EXPECT_DOUBLE_EQ(s.lr(4), M + (P - M) * 0.5 * (1 + std::cos(std::numbers::pi / 8)));
  EXPECT_DOUBLE_EQ(s.lr(7), M + (P - M) * 0.5);  // halfway: cos(pi / 2) = 0
  EXPECT_DOUBLE_EQ(s.lr(11), M);                 // the last step reaches the floor
  EXPECT_DOUBLE_EQ(s.lr(12), M);
  EXPECT_DOUBLE_EQ(s.lr(1000), M);
  for (int64_t i = 4; i < 12; ++i) EXPECT_LT(s.lr(i), s.lr(i - 1)) << i;

  const LrSchedule no_warmup({P, 0.0, 0, 2});
  EXPECT_DOUBLE_EQ(no_warmup.lr(0), P * 0.5 * (1 + std::cos(std::numbers::pi / 2)));
  EXPECT_DOUBLE_EQ(no_warmup.lr(1), 0.0);
  const LrSchedule all_warmup({P, M, 5, 5});
  EXPECT_DOUBLE_EQ(all_warmup.lr(4), P);
  EXPECT_DOUBLE_EQ(all_warmup.lr(5), M);

  EXPECT_ERROR(LrSchedule({P, 2 * P, 1, 10}), "min lr");
  EXPECT_ERROR(LrSchedule({P, M, 11, 10}), "warmup");
  EXPECT_ERROR(LrSchedule({P, M, 0, 0}), "total steps");
  EXPECT_ERROR(s.lr(-1), "step");
}

// ---------------------------------------------------------------------------------------------
// RUN.toml

class RunConfigTest : public TrainDir {
 protected:
  std::string write(const std::string& text, const std::string& name = "sub/RUN.toml") {
    const fs::path path = dir_ / name;
    fs::create_directories(path.parent_path());
    std::ofstream(path) << text;
    return path.string();
  }
  RunConfig parse(const std::string& text) { return load_run_config(write(text)); }
};

const char* kMinimal = R"(
[model]
config = "configs/tiny.json"
[data]
train = "data/chr22.fa.gz"
[train]
seq_len = 128
steps = 20
[checkpoint]
dir = "runs/a"
)";

TEST_F(RunConfigTest, FullFileAndRelativePaths) {
  const std::string path = write(R"(# a full run
[model]
dir = "../models/glm"

[data]
train = "/data/genome.fa"
chromosomes = ["chr1", "chr2"]
max_n_fraction = 0.05
eval = "held/out.fasta"
eval_chromosomes = ["chr22"]

[train]
seq_len = 4096
batch = 2
accumulate = 4
steps = 500
seed = 7
dtype = "f64"

[optim]
lr = 1e-3
min_lr = 0.0
warmup = 50
beta1 = 0.8
beta2 = 0.99
eps = 1e-6
weight_decay = 0
clip = 2

[indexer]
kl_coef = 0.5
freeze = true

[moe]
bias_update_rate = 2e-3
aux_loss_coef = 1e-4

[checkpoint]
dir = "runs/full"
every = 25
keep = 3
optimizer = false

[eval]
every = 100
windows = 4
bucket = 32768
)");
  const RunConfig c = load_run_config(path);
  const fs::path sub = fs::absolute(dir_ / "sub");
  EXPECT_EQ(c.model.dir, (dir_ / "models/glm").lexically_normal().string());
  EXPECT_TRUE(c.model.config.empty());
  EXPECT_EQ(c.data.train, "/data/genome.fa");
  EXPECT_EQ(c.data.format, "fasta");
  EXPECT_EQ(c.data.chromosomes, (std::vector<std::string>{"chr1", "chr2"}));
  EXPECT_EQ(c.data.max_n_fraction, 0.05);
  EXPECT_EQ(c.data.eval, (sub / "held/out.fasta").string());
  EXPECT_EQ(c.data.eval_format, "fasta");
  EXPECT_EQ(c.data.eval_chromosomes, std::vector<std::string>{"chr22"});
  EXPECT_EQ(c.train.seq_len, 4096);
  EXPECT_EQ(c.train.batch, 2);
  EXPECT_EQ(c.train.accumulate, 4);
  EXPECT_EQ(c.train.steps, 500);
  EXPECT_EQ(c.train.seed, 7u);
  EXPECT_EQ(c.train.dtype, DType::F64);
  EXPECT_EQ(c.optim.lr, 1e-3);
  EXPECT_EQ(c.optim.min_lr, 0.0);
  EXPECT_EQ(c.optim.warmup, 50);
  EXPECT_EQ(c.optim.beta1, 0.8);
  EXPECT_EQ(c.optim.beta2, 0.99);
  EXPECT_EQ(c.optim.eps, 1e-6);
  EXPECT_EQ(c.optim.weight_decay, 0.0);
  EXPECT_EQ(c.optim.clip, 2.0);  // an integer where a float is expected is fine
  EXPECT_EQ(c.indexer.kl_coef, 0.5);
  EXPECT_TRUE(c.indexer.freeze);
  EXPECT_EQ(c.moe.bias_update_rate, 2e-3);
  EXPECT_EQ(c.moe.aux_loss_coef, 1e-4);
  EXPECT_EQ(c.checkpoint.dir, (sub / "runs/full").string());
  EXPECT_EQ(c.checkpoint.every, 25);
  EXPECT_EQ(c.checkpoint.keep, 3);
  EXPECT_FALSE(c.checkpoint.optimizer);
  EXPECT_EQ(c.eval.every, 100);
  EXPECT_EQ(c.eval.windows, 4);
  EXPECT_EQ(c.eval.bucket, 32768);

  // describe() is TOML that parses back to the same configuration.
  const std::string text = describe(c);
  const RunConfig again = parse_run_config(text, (dir_ / "elsewhere/RUN.toml").string());
  const std::string text_again = describe(again);  // the first line names the source file
  EXPECT_EQ(text_again.substr(text_again.find('\n')), text.substr(text.find('\n')));
  EXPECT_EQ(config_hash(again), config_hash(c));
}

TEST_F(RunConfigTest, DefaultsAndInference) {
  const RunConfig c = parse(kMinimal);
  const fs::path sub = fs::absolute(dir_ / "sub");
  EXPECT_EQ(c.model.config, (sub / "configs/tiny.json").string());
  EXPECT_EQ(c.model.seed, 0u);
  EXPECT_EQ(c.data.format, "fasta");
  EXPECT_TRUE(c.data.chromosomes.empty());
  EXPECT_EQ(c.data.max_n_fraction, 0.01);
  EXPECT_TRUE(c.data.eval.empty());
  EXPECT_EQ(c.train.batch, 1);
  EXPECT_EQ(c.train.accumulate, 1);
  EXPECT_EQ(c.train.seed, 0u);
  EXPECT_EQ(c.train.dtype, DType::F32);
  EXPECT_EQ(c.optim.lr, 3e-4);
  EXPECT_EQ(c.optim.min_lr, 3e-5);
  EXPECT_EQ(c.optim.warmup, 10);
  EXPECT_EQ(c.optim.beta1, 0.9);
  EXPECT_EQ(c.optim.beta2, 0.95);
  EXPECT_EQ(c.optim.eps, 1e-8);
  EXPECT_EQ(c.optim.weight_decay, 0.1);
  EXPECT_EQ(c.optim.clip, 1.0);
  EXPECT_EQ(c.indexer.kl_coef, 1.0);
  EXPECT_FALSE(c.indexer.freeze);
  EXPECT_EQ(c.indexer.freeze_steps, 0);
  EXPECT_FALSE(c.indexer.frozen_at(0));
  EXPECT_EQ(describe(c).find("freeze_steps"), std::string::npos);  // the default is not written out
  EXPECT_TRUE(c.checkpoint.optimizer);
  // The default is not written out: runs from before the key keep their settings' hash.
  EXPECT_EQ(describe(c).find("optimizer"), std::string::npos);
  EXPECT_EQ(c.moe.bias_update_rate, 1e-3);
  EXPECT_EQ(c.moe.aux_loss_coef, 0.0);
  EXPECT_EQ(c.checkpoint.every, 100);
  EXPECT_EQ(c.checkpoint.keep, 2);
  EXPECT_EQ(c.eval.every, 0);
  EXPECT_EQ(c.eval.windows, 8);
  EXPECT_EQ(c.eval.bucket, 1024);

  auto with_train = [&](const std::string& train) {
    std::string text = kMinimal;
    text.replace(text.find("data/chr22.fa.gz"), 16, train);
    return parse(text);
  };
  EXPECT_EQ(with_train("tokens.u32").data.format, "u32");
  EXPECT_EQ(with_train("corpus_text_document.bin").data.format, "megatron");
  EXPECT_EQ(with_train("G.FASTA").data.format, "fasta");
  EXPECT_ERROR(with_train("tokens.dat"), "cannot infer data.format", "tokens.dat", "set data.format");

  // A short run shortens the default warmup; eval_chromosomes alone evaluate on the train file.
  std::string text = kMinimal;
  text.replace(text.find("steps = 20"), 10, "steps = 3");
  EXPECT_EQ(parse(text).optim.warmup, 3);
  EXPECT_ERROR(parse(text + "[data]\n"), "RUN.toml", "invalid TOML");  // a section twice
  text = std::string(kMinimal);
  text.replace(text.find("[train]"), 7, "eval_chromosomes = [\"chr20\"]\n[train]");
  const RunConfig e = parse(text);
  EXPECT_EQ(e.data.eval, e.data.train);
  EXPECT_EQ(e.data.eval_format, "fasta");
}

// Appends `line` to section [`section`] of the minimal file.
std::string with_line(const std::string& section, const std::string& line) {
  std::string text = kMinimal;
  const std::string header = "[" + section + "]\n";
  const size_t at = text.find(header);
  if (at == std::string::npos) return text + header + line + "\n";
  text.insert(at + header.size(), line + "\n");
  return text;
}

TEST_F(RunConfigTest, UnknownKeysAndSectionsAreErrors) {
  // Line 6 of the minimal file is "[train]"; the typo lands on line 7.
  EXPECT_ERROR(parse(with_line("train", "stpes = 5")), "RUN.toml:7", "unknown key 'stpes'", "[train]",
               "known keys: seq_len");
  EXPECT_ERROR(parse(with_line("trian", "steps = 5")), "RUN.toml", "unknown section [trian]",
               "known sections");
  EXPECT_ERROR(parse(std::string("steps = 5\n") + kMinimal), "RUN.toml:1",
               "unknown key 'steps' outside any section");
  EXPECT_ERROR(parse(with_line("optim", "lr_max = 1.0")), "unknown key 'lr_max'", "[optim]");
  EXPECT_ERROR(parse(with_line("train", "extra.deep = 1")), "unknown key 'extra'");
  EXPECT_ERROR(parse("eval = 3\n" + std::string(kMinimal)), "'eval' = 3", "expected a table");
  EXPECT_ERROR(parse("[train\nsteps = 1\n"), "RUN.toml:1", "invalid TOML");
}

TEST_F(RunConfigTest, WrongTypesAndValuesAreErrors) {
  EXPECT_ERROR(parse(with_line("optim", "warmup = \"100\"")), "optim.warmup = '100'", "is a string",
               "expected an integer");
  EXPECT_ERROR(parse(with_line("optim", "warmup = 1.5")), "optim.warmup = 1.5", "is a float",
               "expected an integer");
  EXPECT_ERROR(parse(with_line("optim", "lr = \"fast\"")), "optim.lr = 'fast'", "expected a number");
  EXPECT_ERROR(parse(with_line("indexer", "freeze = 1")), "indexer.freeze = 1", "expected a boolean");
  EXPECT_ERROR(parse(with_line("indexer", "freeze_steps = -1")), "indexer.freeze_steps = -1", ">= 0");
  EXPECT_ERROR(parse(with_line("indexer", "freeze_steps = 21")), "indexer.freeze_steps = 21",
               "train.steps = 20");
  EXPECT_ERROR(parse(with_line("indexer", "freeze = true\nfreeze_steps = 3")), "freeze_steps",
               "one of the two");
  EXPECT_ERROR(parse(with_line("data", "chromosomes = [\"chr1\", 2]")), "data.chromosomes[1] = 2",
               "expected a string");
  EXPECT_ERROR(parse(with_line("data", "chromosomes = \"chr1\"")), "data.chromosomes", "expected an array");
  EXPECT_ERROR(parse(with_line("optim", "lr = -1e-3")), "optim.lr = -", "must be > 0");
  EXPECT_ERROR(parse(with_line("optim", "beta1 = 1.0")), "optim.beta1", "[0, 1)");
  EXPECT_ERROR(parse(with_line("optim", "warmup = 21")), "optim.warmup = 21", "train.steps = 20");
  EXPECT_ERROR(parse(with_line("optim", "min_lr = 1.0")), "min_lr", "exceeds optim.lr");
  EXPECT_ERROR(parse(with_line("train", "dtype = \"bf17\"")), "train.dtype = 'bf17'", "\"f32\" or \"f64\"");
  EXPECT_ERROR(parse(with_line("train", "batch = 0")), "train.batch = 0", ">= 1");
  EXPECT_ERROR(parse(with_line("data", "format = \"csv\"")), "data.format = 'csv'", "fasta");
  EXPECT_ERROR(parse(with_line("data", "format = \"u32\"\nchromosomes = [\"chr1\"]")),
               "chromosomes only apply");
  EXPECT_ERROR(parse(with_line("model", "dir = \"m\"")), "both dir and config");
  EXPECT_ERROR(parse(with_line("checkpoint", "keep = 0")), "checkpoint.keep = 0");
}

TEST_F(RunConfigTest, MissingRequiredKeys) {
  auto without = [&](const std::string& line) {
    std::string text = kMinimal;
    text.erase(text.find(line), line.size() + 1);
    return text;
  };
  EXPECT_ERROR(parse(without("steps = 20")), "RUN.toml", "missing required key train.steps");
  EXPECT_ERROR(parse(without("seq_len = 128")), "missing required key train.seq_len");
  EXPECT_ERROR(parse(without("train = \"data/chr22.fa.gz\"")), "missing required key data.train");
  EXPECT_ERROR(parse(without("dir = \"runs/a\"")), "missing required key checkpoint.dir");
  EXPECT_ERROR(parse(without("config = \"configs/tiny.json\"")), "[model] needs dir");
  EXPECT_ERROR(load_run_config((dir_ / "absent.toml").string()), "cannot open run config", "absent.toml");
}

TEST_F(RunConfigTest, IndexersFrozenForTheFirstSteps) {
  const RunConfig c = parse(with_line("indexer", "freeze_steps = 3"));
  EXPECT_EQ(c.indexer.freeze_steps, 3);
  EXPECT_TRUE(c.indexer.frozen_at(0));
  EXPECT_TRUE(c.indexer.frozen_at(2));
  EXPECT_FALSE(c.indexer.frozen_at(3));
  EXPECT_NE(describe(c).find("freeze_steps = 3\n"), std::string::npos);
  EXPECT_NE(config_hash(c), config_hash(parse(kMinimal)));
  const RunConfig always = parse(with_line("indexer", "freeze = true"));
  EXPECT_TRUE(always.indexer.frozen_at(0) && always.indexer.frozen_at(1000));
}

TEST_F(RunConfigTest, HashFollowsSettings) {
  const RunConfig a = parse(kMinimal);
  const RunConfig b = parse(with_line("optim", "lr = 1e-3"));
  EXPECT_NE(config_hash(a), config_hash(b));
  EXPECT_EQ(config_hash(a).size(), 16u);
  EXPECT_NE(describe(b).find("lr = 0.001\n"), std::string::npos);
}

// ---------------------------------------------------------------------------------------------
// Training state and checkpoints

struct Trainable {
  ModelConfig config;
  ModelWeights weights;
  ModelWeights grads;
  std::unique_ptr<AdamW> adamw;

  Trainable(const ModelConfig& c, DType dtype, uint64_t seed)
      : config(c), weights(allocate_weights(c, dtype)), grads(allocate_weights(c, dtype)) {
    fill_model(config, weights, seed, 0.5);
    adamw = std::make_unique<AdamW>(config, weights, AdamWOptions{1e-2, 0.9, 0.95, 1e-8, 0.1});
  }
  void step(uint64_t seed) {
    fill_model(config, grads, seed, 1.0);
    adamw->step(grads);
  }
  void save(const std::string& dir) { save_model(dir, config, weights, weights.dtype); }
};

void expect_bit_equal(const Tensor& a, const Tensor& b, const std::string& what) {
  ASSERT_EQ(a.dtype(), b.dtype()) << what;
  ASSERT_EQ(a.shape(), b.shape()) << what;
  ASSERT_EQ(std::memcmp(a.raw(), b.raw(), a.nbytes()), 0) << what;
}

void expect_same_optimizer(const AdamW& a, const AdamW& b) {
  ASSERT_EQ(a.steps(), b.steps());
  ASSERT_EQ(a.slots().size(), b.slots().size());
  for (size_t i = 0; i < a.slots().size(); ++i) {
    const AdamW::Slot &x = a.slots()[i], &y = b.slots()[i];
    ASSERT_EQ(x.name, y.name);
    expect_bit_equal(x.master, y.master, x.name + ".master");
    expect_bit_equal(x.exp_avg, y.exp_avg, x.name + ".exp_avg");
    expect_bit_equal(x.exp_avg_sq, y.exp_avg_sq, x.name + ".exp_avg_sq");
    expect_bit_equal(x.weight, y.weight, x.name);
  }
}

class TrainStateTest : public TrainDir {};

void check_round_trip(const fs::path& root, DType dtype) {
  const ModelConfig config = tiny_config();
  Trainable a(config, dtype, 1);
  a.step(10);
  a.step(11);
  Random rng(42);
  for (int i = 0; i < 5; ++i) rng.next();
  TrainState state;
  state.step = 2;
  state.schedule_step = 2;
  state.data_position = (uint64_t{1} << 62) + 12345;
  state.rng = rng.state();
  state.loss_history = {0.1, 1.0 / 3.0, 1e-300, 2.5};
  state.config_hash = "0123456789abcdef";
  CheckpointWriter writer(root.string(), 2);
  const std::string dir = save_checkpoint(writer, state, *a.adamw, [&](const std::string& d) { a.save(d); });
  EXPECT_EQ(fs::path(dir).filename(), "step-000002");
  EXPECT_TRUE(fs::exists(fs::path(dir) / "model.safetensors"));

  // A fresh process would load the model from the checkpoint, then the optimizer state.
  Model model = load_model(dir, dtype);
  AdamW b(model.config, model.weights, a.adamw->options());
  const std::optional<LoadedCheckpoint> loaded = load_latest(root.string(), b);
  ASSERT_TRUE(loaded.has_value());
  EXPECT_EQ(loaded->dir, dir);
  const TrainState& s = loaded->state;
  EXPECT_EQ(s.step, state.step);
  EXPECT_EQ(s.schedule_step, state.schedule_step);
  EXPECT_EQ(s.data_position, state.data_position);
  EXPECT_EQ(s.rng, state.rng);
  EXPECT_EQ(s.config_hash, state.config_hash);
  ASSERT_EQ(s.loss_history.size(), state.loss_history.size());
  for (size_t i = 0; i < s.loss_history.size(); ++i)
    EXPECT_EQ(std::memcmp(&s.loss_history[i], &state.loss_history[i], sizeof(double)), 0);
  expect_same_optimizer(*a.adamw, b);
  Random resumed(0);
  resumed.set_state(s.rng);
  for (int i = 0; i < 10; ++i) ASSERT_EQ(resumed.next(), rng.next());

  // Training on from the loaded state is bit-identical to training on without the checkpoint.
  ModelWeights grads = allocate_weights(config, dtype);
  fill_model(config, grads, 12, 1.0);
  a.step(12);
  b.step(grads);
  expect_same_optimizer(*a.adamw, b);
}

TEST_F(TrainStateTest, RoundTripIsBitExactF32) { check_round_trip(dir_, DType::F32); }
TEST_F(TrainStateTest, RoundTripIsBitExactF64) { check_round_trip(dir_, DType::F64); }

TEST_F(TrainStateTest, MismatchedCheckpointsAreErrors) {
  const ModelConfig config = tiny_config();
  Trainable a(config, DType::F32, 1);
  TrainState state;
  state.step = 1;
  state.rng = Random(1).state();
  const fs::path one = dir_ / "one", two = dir_ / "two";
  fs::create_directories(one);
  fs::create_directories(two);
  save_train_state(one.string(), state, *a.adamw);
  state.step = 2;
  save_train_state(two.string(), state, *a.adamw);

  Trainable other(tiny_config({{"hidden_size", 64}}), DType::F32, 1);
  EXPECT_ERROR(load_train_state(one.string(), *other.adamw), "optimizer.safetensors",
               "embed_tokens.weight.master", "expected f32[16, 64]");
  fs::copy_file(two / kOptimizerFile, one / kOptimizerFile, fs::copy_options::overwrite_existing);
  EXPECT_ERROR(load_train_state(one.string(), *a.adamw), "written at step 2", "step 1", "mixed");
  EXPECT_ERROR(load_train_state((dir_ / "none").string(), *a.adamw), "trainer_state.json");

  nlohmann::json j;
  std::ifstream(two / kTrainerStateFile) >> j;
  j["surprise"] = 1;
  std::ofstream(two / kTrainerStateFile) << j.dump();
  EXPECT_ERROR(load_train_state(two.string(), *a.adamw), "unknown field 'surprise'");
}

// [checkpoint] optimizer = false: the model and the trainer state only, and a resume that says why
// it cannot.
TEST_F(TrainStateTest, WithoutTheOptimizerLoadsAsAModelOnly) {
  const ModelConfig config = tiny_config();
  Trainable a(config, DType::F32, 1);
  a.step(10);
  TrainState state;
  state.step = 1;
  state.rng = Random(1).state();
  CheckpointWriter writer(dir_.string(), 1);
  const std::string dir = save_checkpoint(
      writer, state, *a.adamw, [&](const std::string& d) { a.save(d); }, false);
  EXPECT_TRUE(fs::exists(fs::path(dir) / "model.safetensors"));
  EXPECT_FALSE(fs::exists(fs::path(dir) / kOptimizerFile));
  Model model = load_model(dir, DType::F32);  // the trained weights, bit for bit
  const auto table = parameter_table(config, model.weights);
  for (const AdamW::Slot& slot : a.adamw->slots())
    for (const auto& p : table)
      if (p.name == slot.name) expect_bit_equal(p.tensor, slot.weight, slot.name);
  Trainable b(config, DType::F32, 2);
  EXPECT_ERROR(load_train_state(dir, *b.adamw), "holds no optimizer state", "optimizer = false",
               "cannot be resumed");
}

// Writes a small checkpoint of `step` whose files all carry `step`, through the real writer.
std::string write_marked(CheckpointWriter& writer, int64_t step) {
  return writer.write(
      step, [&](const std::string& dir) { std::ofstream(fs::path(dir) / "marker.txt") << step << "\n"; });
}

int64_t marker_of(const std::string& dir) {
  int64_t step = -1;
  std::ifstream(fs::path(dir) / "marker.txt") >> step;
  return step;
}

std::vector<std::string> listing(const fs::path& dir) {
  std::vector<std::string> names;
  for (const auto& entry : fs::directory_iterator(dir)) names.push_back(entry.path().filename().string());
  std::sort(names.begin(), names.end());
  return names;
}

TEST_F(TrainStateTest, LeftoverTemporariesAreIgnoredAndRemoved) {
  CheckpointWriter writer(dir_.string(), 5);
  EXPECT_FALSE(latest_checkpoint(dir_.string()).has_value());
  write_marked(writer, 1);
  write_marked(writer, 2);
  // A crash while writing step 3: its temporary directory, half written, is all that is left.
  // pid_max is at most 2^22, so this writer is certainly dead.
  const fs::path crashed = dir_ / ("step-000003.tmp-" + std::to_string((1 << 22) + 7));
  fs::create_directories(crashed);
  std::ofstream(crashed / "marker.txt") << "3\n";
  std::ofstream(crashed / "optimizer.safetensors") << "truncated";
  // A temporary of a live writer (our parent process) is left alone.
  const fs::path live = dir_ / ("step-000004.tmp-" + std::to_string(::getppid()));
  fs::create_directories(live);
  std::ofstream(dir_ / ("latest.tmp-" + std::to_string((1 << 22) + 8))) << "step-000003\n";

  const std::optional<std::string> latest = latest_checkpoint(dir_.string());
  ASSERT_TRUE(latest.has_value());
  EXPECT_EQ(checkpoint_step(*latest), 2);
  EXPECT_EQ(marker_of(*latest), 2);
  EXPECT_EQ(listing(dir_),
            (std::vector<std::string>{"latest", "step-000001", "step-000002", live.filename().string()}));

  // A crash after the rename but before `latest` moved: `latest` still rules.
  write_marked(writer, 3);
  std::ofstream(dir_ / "latest") << "step-000002\n";
  EXPECT_EQ(checkpoint_step(*latest_checkpoint(dir_.string())), 2);
  // A dangling or missing pointer falls back to the newest complete directory.
  std::ofstream(dir_ / "latest") << "step-000009\n";
  EXPECT_EQ(checkpoint_step(*latest_checkpoint(dir_.string())), 3);
  fs::remove(dir_ / "latest");
  EXPECT_EQ(checkpoint_step(*latest_checkpoint(dir_.string())), 3);
  std::ofstream(dir_ / "latest") << "../../etc\n";
  EXPECT_ERROR(latest_checkpoint(dir_.string()), "latest", "step-<N>");
}

TEST_F(TrainStateTest, KeepsTheNewestAndSurvivesAFailingFill) {
  CheckpointWriter writer(dir_.string(), 2);
  for (int64_t s = 1; s <= 5; ++s) write_marked(writer, s * 10);
  EXPECT_EQ(listing(dir_), (std::vector<std::string>{"latest", "step-000040", "step-000050"}));

  // A fill that throws leaves nothing behind and the previous checkpoint current.
  EXPECT_THROW(writer.write(60,
                            [](const std::string& dir) {
                              std::ofstream(fs::path(dir) / "partial") << "x";
                              fail("disk full");
                            }),
               Error);
  EXPECT_EQ(listing(dir_), (std::vector<std::string>{"latest", "step-000040", "step-000050"}));
  EXPECT_EQ(marker_of(*latest_checkpoint(dir_.string())), 50);

  // Rewriting an existing step replaces it.
  writer.write(50, [](const std::string& dir) { std::ofstream(fs::path(dir) / "marker.txt") << 51 << "\n"; });
  EXPECT_EQ(marker_of(*latest_checkpoint(dir_.string())), 51);
  EXPECT_EQ(listing(dir_), (std::vector<std::string>{"latest", "step-000040", "step-000050"}));
  EXPECT_ERROR(CheckpointWriter(dir_.string(), 0), "keep");
}

// ---------------------------------------------------------------------------------------------
// SIGKILL: a child writes checkpoints of a few-MB state in a loop and is killed at random
// moments; every time, the newest checkpoint must load completely and consistently.

// A config whose optimizer file is a few MB.
ModelConfig kill_config() {
  return tiny_config(
      {{"vocab_size", 512}, {"hidden_size", 64}, {"intermediate_size", 256}, {"moe_intermediate_size", 64}});
}

// Fills every master and moment with values that identify `step` (exact in fp32 for step < 2048).
void mark_optimizer(AdamW& adamw, int64_t step) {
  for (size_t i = 0; i < adamw.slots().size(); ++i) {
    AdamW::Slot& s = adamw.slots()[i];
    float *p = s.master.data<float>(), *m = s.exp_avg.data<float>(), *v = s.exp_avg_sq.data<float>();
    for (int64_t k = 0; k < s.master.numel(); ++k) {
      const float value =
          static_cast<float>(step * 8192 + static_cast<int64_t>((i * 31 + static_cast<size_t>(k)) % 8192));
      p[k] = value;
      m[k] = -value;
      v[k] = value * 0.5f;
    }
  }
  adamw.set_steps(step);
  adamw.write_weights();
}

TrainState marked_state(int64_t step) {
  TrainState s;
  s.step = s.schedule_step = step;
  s.data_position = static_cast<uint64_t>(step) * 1000003u;
  const uint64_t u = static_cast<uint64_t>(step);
  s.rng = {u, u ^ 0xdeadbeefcafef00dull, ~u, u * 0x9e3779b97f4a7c15ull};
  s.loss_history = {1.0 / static_cast<double>(step), static_cast<double>(step)};
  s.config_hash = "kill-test";
  return s;
}

[[noreturn]] void checkpoint_forever(const std::string& root) {
  try {
    const ModelConfig config = kill_config();
    ModelWeights weights = allocate_weights(config, DType::F32);
    zero_grads(config, weights);  // defined values everywhere, RouterBias included
    AdamW adamw(config, weights);
    int64_t step = 0;
    if (const auto loaded = load_latest(root, adamw)) step = loaded->state.step;
    CheckpointWriter writer(root, 2);
    for (;;) {
      ++step;
      mark_optimizer(adamw, step);
      save_checkpoint(writer, marked_state(step), adamw,
                      [&](const std::string& dir) { save_model(dir, config, weights, DType::F32); });
    }
  } catch (const std::exception& e) {
    std::fprintf(stderr, "checkpoint child: %s\n", e.what());
  }
  ::_exit(3);
}

TEST_F(TrainStateTest, SurvivesSigkillAtRandomMoments) {
  const ModelConfig config = kill_config();
  ModelWeights weights = allocate_weights(config, DType::F32);
  zero_grads(config, weights);
  AdamW probe(config, weights);
  int64_t bytes = 0;
  for (const AdamW::Slot& s : probe.slots()) bytes += 3 * static_cast<int64_t>(s.master.nbytes());
  EXPECT_GT(bytes, 2 << 20) << "the optimizer state should be a few MB";

  std::mt19937 rng(1234);
  std::uniform_int_distribution<int> delay_ms(5, 250);
  const auto start = std::chrono::steady_clock::now();
  int64_t last_step = 0;
  int kills = 0, mid_write = 0;  // kills that left a temporary behind (landed mid-write)
  while (kills < 16 && std::chrono::steady_clock::now() - start < std::chrono::seconds(6)) {
    const pid_t child = ::fork();
    ASSERT_GE(child, 0);
    if (child == 0) checkpoint_forever(dir_.string());
    std::this_thread::sleep_for(std::chrono::milliseconds(delay_ms(rng)));
    ASSERT_EQ(::kill(child, SIGKILL), 0);
    int status = 0;
    ASSERT_EQ(::waitpid(child, &status, 0), child);
    ASSERT_TRUE(WIFSIGNALED(status) && WTERMSIG(status) == SIGKILL)
        << "the child stopped by itself: " << status;
    ++kills;
    for (const std::string& name : listing(dir_))
      mid_write += name.find(".tmp-") != std::string::npos ? 1 : 0;

    ModelWeights loaded_weights = allocate_weights(config, DType::F32);
    zero_grads(config, loaded_weights);
    AdamW adamw(config, loaded_weights);
    const std::optional<LoadedCheckpoint> loaded = load_latest(dir_.string(), adamw);
    if (!loaded) {
      ASSERT_EQ(last_step, 0) << "a checkpoint disappeared";
      continue;
    }
    const TrainState& s = loaded->state;
    ASSERT_GE(s.step, last_step) << "the latest checkpoint went backwards";
    last_step = s.step;
    const TrainState expected = marked_state(s.step);
    ASSERT_EQ(s.schedule_step, expected.schedule_step);
    ASSERT_EQ(s.data_position, expected.data_position);
    ASSERT_EQ(s.rng, expected.rng);
    ASSERT_EQ(s.loss_history, expected.loss_history);
    ModelWeights marked_weights = allocate_weights(config, DType::F32);
    zero_grads(config, marked_weights);
    AdamW marked(config, marked_weights);
    mark_optimizer(marked, s.step);
    expect_same_optimizer(marked, adamw);
    // The model files of the same directory belong to the same step.
    Model model = load_model(loaded->dir, DType::F32);
    const std::vector<Param> got = parameter_table(config, model.weights);
    for (size_t i = 0, slot = 0; i < got.size(); ++i) {
      if (got[i].role == ParamRole::RouterBias) continue;
      expect_bit_equal(got[i].tensor, marked.slots()[slot++].weight, got[i].name);
    }
    // Leftovers of the dead child were cleaned up.
    for (const std::string& name : listing(dir_)) ASSERT_EQ(name.find(".tmp-"), std::string::npos) << name;
    // keep = 2, one more when the kill came between the rename and the pruning, and latest.
    const std::vector<std::string> names = listing(dir_);
    ASSERT_LE(names.size(), 4u) << ::testing::PrintToString(names);
  }
  EXPECT_GE(kills, 8);
  EXPECT_GT(mid_write, 0) << "no kill landed in the middle of a write";
  EXPECT_GT(last_step, 0) << "the child never completed a checkpoint";
  std::printf("SIGKILL test: %d kills (%d mid-write), last checkpoint step %lld, optimizer state %.1f MB\n",
              kills, mid_write, static_cast<long long>(last_step), static_cast<double>(bytes) / (1 << 20));
}

}  // namespace
}  // namespace spindle
