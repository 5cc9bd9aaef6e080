// spindle bench: forward + backward + optimizer steps of a model on the GPU at given sequence
// lengths, after warm-up, on real DNA tokens (random ids only when asked, and labelled so): the
// first L of bench/chr22_70k.tokens, or with --tokens FILE.fa[.gz] an N-free window of a genome.
// Prints one JSON object per length: tokens/s, step time split by layer kind, peak device memory
// by category, the process's peak host memory, and MFU from the analytic FLOP count
// (model/flops.h; when streamed, the streaming executor's extra forward is not counted). The memory policy
// per length is the planner's pick among those the executor runs (plan/execution.h), unless --chunk or
// --policy forces one; the JSON has the policy and its predicted peak next to the measured one.
// --gpu-mem GIB plans for less device memory than the GPU has (as spindle plan's: 2 GiB of it kept for
// the CUDA context and libraries), e.g. 123 holds the pick's peak to 121 GiB (129.9 GB).
#include <algorithm>
#include <chrono>
#include <fstream>
#include <iostream>
#include <map>
#include <nlohmann/json.hpp>
#include <optional>
#include <random>
#include <sstream>

#include "backend/device_model.h"
#include "cli/args.h"
#include "cli/commands.h"
#include "core/host_memory.h"
#include "core/log.h"
#include "core/median.h"
#include "data/token_source.h"
#include "model/checkpoint.h"
#include "model/flops.h"
#include "model/init.h"
#include "plan/execution.h"

namespace spindle {

namespace {

constexpr double kH200PeakBf16 = 989e12;  // dense bf16 tensor-core FLOP/s of an H100/H200 SXM

std::vector<int64_t> parse_lengths(const std::string& text) {
  std::vector<int64_t> lengths;
  std::stringstream in(text);
  std::string item;
  while (std::getline(in, item, ',')) {
    char* end = nullptr;
    const long long value = std::strtoll(item.c_str(), &end, 10);
    check(!item.empty() && *end == '\0' && value >= 2,
          "--seq-len takes lengths >= 2 separated by commas, got '", text, "'");
    lengths.push_back(value);
  }
  return lengths;
}

Model bench_model(const std::string& source) {
  if (source.size() > 5 && source.substr(source.size() - 5) == ".json") {
    Model model;
    model.config = load_model_config(source);
    model.weights = allocate_weights(model.config, DType::F32);
    log_info("initialising random weights for ", source);
    init_weights(model.config, model.weights, 1);
    return model;
  }
  return load_model(source, DType::F32);
}

// Where the benchmark's tokens come from: any sequence file (FASTA, u32, Megatron), from which
// each length takes one window free of N drawn with a fixed seed, or else a token text file
// (bench/chr22_70k.tokens), whose first tokens it takes.
nlohmann::json memory_json(const MemoryStats& stats) {
  nlohmann::json out = {{"peak_total_bytes", stats.peak_total}};
  for (int c = 0; c < kMemoryCategories; ++c)
    if (stats.peak[c] > 0) out[memory_category_name(static_cast<MemoryCategory>(c))] = stats.peak[c];
  return out;
}

}  // namespace

int run_bench(const std::vector<std::string>& argv) {
  const Args args(
      "bench", argv,
      {"model", "seq-len", "steps", "warmup", "tokens", "out", "mla", "chunk", "policy", "plan-policy",
       "gpu-mem"},
      {"random-tokens", "strict-kernels", "host-optimizer", "indexer-kl", "profile", "no-kind-times"});
  const std::string source = args.required("model");
  const std::vector<int64_t> lengths = parse_lengths(args.required("seq-len"));
  const int64_t steps = args.int_or("steps", 3), warmup = args.int_or("warmup", 1);
  check(steps >= 1 && warmup >= 0, "--steps must be >= 1 and --warmup >= 0");
  std::optional<int64_t> forced_chunk;
  if (args.optional("chunk")) {
    forced_chunk = args.int_or("chunk", 0);
    check(*forced_chunk >= 0, "--chunk must be a number of tokens >= 1 (or 0: the whole sequence), got ",
          *forced_chunk);
  }
  std::optional<plan::ActivationPolicy> forced_policy;
  if (const auto name = args.optional("policy")) forced_policy = plan::parse_site_policy(*name);
  check(!(forced_policy && forced_chunk), "--chunk and --policy exclude each other (--chunk N streams)");
  // Any policy the executor runs, by the name `spindle plan` prints (to compare two of them).
  const std::optional<std::string> forced_name = args.optional("plan-policy");
  const std::optional<int64_t> planned_gpu_bytes = args.gib_bytes("gpu-mem");  // checked once the GPU is open
  // The last step of each length inside a profiler's capture range (bench/step_profile.sh).
  const bool profile = args.flag("profile");
  // The timed steps without the GPU time by layer kind, as `spindle train` runs them: the timer's
  // events at each part's start and end sit between kernels that would otherwise launch as
  // programmatic dependents of each other (kernels/cuda/launch.cuh). What that costs is what a run
  // with and one without measure.
  const bool kind_times = !args.flag("no-kind-times");
  const bool random_tokens = args.flag("random-tokens");
  const std::string token_file = args.value_or("tokens", "bench/chr22_70k.tokens");
  check(!(random_tokens && args.optional("tokens")), "--random-tokens and --tokens exclude each other");

  // The one-time work before the first step, by phase (at 1M on the 4B model it is over a minute).
  nlohmann::json setup_seconds;
  double setup_total = 0;
  auto phase_start = std::chrono::steady_clock::now();
  const auto end_phase = [&](const char* phase) {
    const auto now = std::chrono::steady_clock::now();
    const double seconds = std::chrono::duration<double>(now - phase_start).count();
    setup_seconds[phase] = seconds;
    setup_total += seconds;
    phase_start = now;
  };
  // Every length's tokens before the minutes of initialising a large model: bad data fails first.
  std::map<int64_t, std::vector<int32_t>> dna;
  if (!random_tokens) {
    const TokenSource source(token_file);
    for (const int64_t L : lengths) dna[L] = source.window(L, "--seq-len");
  }
  end_phase("tokens");
  const Model model = bench_model(source);
  end_phase("weights");
  const ModelConfig& config = model.config;
  const std::string mla = args.value_or("mla", "absorbed");
  check(mla == "absorbed" || mla == "expanded", "--mla must be absorbed or expanded, got '", mla, "'");
  auto device = open_device_model(Device::CUDA, config, model.weights,
                                  {args.flag("strict-kernels"), mla == "absorbed"});
  end_phase("device");
  const plan::Machine machine = plan::this_machine(device->memory_capacity(), planned_gpu_bytes);
  plan::StepOptions plan_options;
  plan_options.absorbed = mla == "absorbed";
  // Training the indexers on their KL to the attention, as `spindle train` does by default.
  const bool indexer_kl = args.flag("indexer-kl");
  plan_options.indexer_kl = indexer_kl;
  // The optimizer's place, once for all lengths: the host when asked, else where the longest
  // length needs it.
  const bool optimizer_on_host =
      args.flag("host-optimizer") ||
      plan::plan_execution(config, *std::max_element(lengths.begin(), lengths.end()), machine, plan_options,
                           forced_chunk, std::nullopt, forced_policy, forced_name)
          .policy.optimizer_on_host;
  device->set_optimizer_on_host(optimizer_on_host);
  device->init_optimizer();
  end_phase("optimizer");
  log_info("bench: set up in ", setup_total, " s: ", setup_seconds.dump());
  AdamWOptions adam;

  std::ofstream file;
  if (const auto out = args.optional("out")) {
    file.open(*out, std::ios::app);
    check(file.good(), "cannot write --out file '", *out, "'");
  }
  for (const int64_t L : lengths) {
    std::vector<int32_t> tokens(static_cast<size_t>(L));
    if (random_tokens) {
      std::mt19937_64 engine(static_cast<uint64_t>(L));
      std::uniform_int_distribution<int32_t> id(0, static_cast<int32_t>(config.vocab_size - 1));
      for (int32_t& t : tokens) t = id(engine);
    } else {
      tokens = dna.at(L);
    }
    const plan::Execution execution = plan::plan_execution(config, L, machine, plan_options, forced_chunk,
                                                           optimizer_on_host, forced_policy, forced_name);
    log_info("bench L=", L, ": ", execution.summary);
    LossOptions loss_options;
    plan::set_memory_options(execution, loss_options);
    loss_options.indexer_kl_coef = indexer_kl ? 1.0 : 0.0;
    device->reset_memory_peak();
    std::vector<double> seconds;
    std::vector<int64_t> allocations, flushes;  // the allocator's driver calls in each timed step
    std::map<std::string, double> kind_ms;
    double loss = 0;
    for (int64_t step = 0; step < warmup + steps; ++step) {
      const bool timed = step >= warmup, profiled = profile && step + 1 == warmup + steps;
      device->set_timing(timed && kind_times);
      if (profiled) device->profile_range(true);
      const DeviceModel::AllocatorCounts before = device->allocator_counts();
      const auto start = std::chrono::steady_clock::now();
      device->zero_gradients();
      loss = device->loss_and_gradients(tokens, loss_options).loss;
      device->clip_gradients(1.0);
      device->optimizer_step(adam, 1e-5, step + 1);
      device->synchronize();
      const double elapsed = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
      if (profiled) device->profile_range(false);  // outside the step's time
      if (timed) {
        const DeviceModel::AllocatorCounts after = device->allocator_counts();
        seconds.push_back(elapsed);
        allocations.push_back(after.driver_allocations - before.driver_allocations);
        flushes.push_back(after.cache_flushes - before.cache_flushes);
      }
      log_info("bench L=", L, " step ", step + 1, "/", warmup + steps, timed ? "" : " (warm-up)", ": ",
               elapsed, " s, loss ", loss);
    }
    kind_ms = device->collect_timing();
    // The JSON keeps the steps in order too: the first pays one-time costs (--warmup leaves it out).
    const double median_seconds = median(seconds);
    const ModelFlops flops = model_flops(config, L);
    nlohmann::json by_kind = nlohmann::json::object();
    for (const auto& [kind, ms] : kind_ms) by_kind[kind] = ms / 1000.0 / static_cast<double>(steps);
    const nlohmann::json result = {
        {"engine", "spindle"},
        {"model", source},
        {"device", device->device_name()},
        {"mla", mla},
        {"indexer_kl", indexer_kl},
        {"seq_len", L},
        {"policy", execution.policy.name()},
        {"policy_forced", execution.forced},
        // Tokens per chunk of the streaming executor; 0: the sequence in one pass (no chunks).
        {"chunk_tokens", execution.chunk_tokens},
        {"predicted_peak_bytes", execution.predicted_peak_bytes},
        {"tokens", random_tokens ? "random ids (--random-tokens)" : "real DNA (" + token_file + ")"},
        {"steps", steps},
        {"warmup", warmup},
        {"step_seconds_median", median_seconds},
        {"step_seconds", seconds},
        // Per step: blocks the device allocator took from the driver, and its cache flushes (an
        // allocation that did not fit beside the cached blocks: a synchronisation, then the driver
        // again for every size).
        {"step_driver_allocations", allocations},
        {"step_cache_flushes", flushes},
        {"tokens_per_second", static_cast<double>(L) / median_seconds},
        {"seconds_by_layer_kind", by_kind},  // empty with --no-kind-times
        {"kind_times", kind_times},
        {"peak_memory", memory_json(device->memory())},
        // After the steps: the driver's total, and what is in use outside Spindle's allocator
        // (the CUDA context, the kernels' local memory, libraries), which the planner reserves.
        {"device_memory_total_bytes", device->memory_capacity()},
        {"device_memory_outside_allocator_bytes", device->memory_outside_allocator()},
        // The process's most resident host memory so far (all lengths of this run).
        {"peak_host_bytes", host_peak_resident_bytes()},
        {"model_tflops_per_step", flops.training() / 1e12},
        {"mfu", flops.training() / median_seconds / kH200PeakBf16},
        {"final_loss", loss},
        // Once per run, before the first length's first step (reading tokens, initialising or
        // loading weights, opening the device model, the optimizer's state).
        {"setup_seconds", setup_seconds},
        {"kernel_fallbacks", device->any_fallback()}};
    std::cout << result.dump() << std::endl;
    if (file.is_open()) file << result.dump() << '\n' << std::flush;
  }
  log_info("kernels:\n", device->kernel_report());
  return 0;
}

}  // namespace spindle
