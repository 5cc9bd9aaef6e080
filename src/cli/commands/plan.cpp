// spindle plan: for a model config, a sequence length and a machine, every memory policy the
// planner knows with its predicted peak device and host memory and step time, and the pick: the
// fastest that fits (src/plan/planner.h; docs/PLANNER.md).
#include <algorithm>
#include <cstdio>
#include <iostream>
#include <string>

#include "cli/args.h"
#include "cli/commands.h"
#include "core/error.h"
#include "model/checkpoint.h"
#include "plan/execution.h"
#include "plan/planner.h"

namespace spindle {

namespace {

using plan::Candidate;

// "131072", "128k" or "1M" (k = 1024 tokens, M = 1024k).
int64_t parse_tokens(const std::string& text) {
  int64_t scale = 1;
  std::string digits = text;
  if (!digits.empty() && (digits.back() == 'k' || digits.back() == 'K')) scale = 1024;
  if (!digits.empty() && (digits.back() == 'm' || digits.back() == 'M')) scale = 1024 * 1024;
  if (scale > 1) digits.pop_back();
  size_t used = 0;
  long long value = 0;
  try {
    value = std::stoll(digits, &used);
  } catch (const std::exception&) {
    used = 0;
  }
  check(!digits.empty() && used == digits.size() && value >= 1 && value <= (int64_t{1} << 40) / scale &&
            value * scale >= 2,
        "--seq-len takes a length of at least 2 tokens (e.g. 131072, 128k, 1M), got '", text, "'");
  return value * scale;
}

int64_t bytes_of_gib(double gib) { return static_cast<int64_t>(gib * static_cast<double>(int64_t{1} << 30)); }
double in_gib(int64_t bytes) { return static_cast<double>(bytes) / static_cast<double>(int64_t{1} << 30); }

void print_row(const Candidate& x, int name_width, bool one_gpu) {
  const MemoryStats& d = x.memory.device;
  const auto category = [&](MemoryCategory c) { return in_gib(d.peak[static_cast<int>(c)]); };
  std::printf("  %-*s %8.1f %8.1f %6.1f %6.1f %6.1f %6.1f %8.1f %9.1f %6.2fx", name_width,
              x.policy.name().c_str(), in_gib(d.peak_total), category(MemoryCategory::Weights),
              category(MemoryCategory::Gradients), category(MemoryCategory::Optimizer),
              category(MemoryCategory::Activations), category(MemoryCategory::Workspace),
              in_gib(x.memory.host), x.time.total(), x.relative);
  if (x.time.copies > 0) {
    if (x.time.exposed_copies > 0)
      std::printf("  copies %.1f s, not hidden: +%.1f s", x.time.copies, x.time.exposed_copies);
    else
      std::printf("  copies %.1f s, hidden", x.time.copies);
  }
  if (one_gpu && !plan::executor_runs(x.policy))
    std::printf("  planned only: the executor does not run it yet");
  if (!x.fits()) std::printf("  does not fit: %s", x.infeasible.c_str());
  std::printf("\n");
}

}  // namespace

int run_plan(const std::vector<std::string>& argv) {
  const Args args("plan", argv, {"model", "seq-len", "gpus", "gpu-mem", "host-mem", "mfu", "mla"},
                  {"indexer-kl"});
  const std::string source = args.required("model");
  const ModelConfig config = load_model_config(source);
  check_supported(config);
  plan::PlanRequest request;
  request.tokens = parse_tokens(args.required("seq-len"));
  request.machine.gpus = args.int_or("gpus", 1);
  check(request.machine.gpus >= 1, "--gpus must be at least 1, got ", request.machine.gpus);
  const char* size = "a positive size in GB (GiB: nvidia-smi's MiB / 1024)";
  const double gpu_gib = args.positive_or("gpu-mem", "141", size);
  const double host_gib = args.positive_or("host-mem", "128", size);
  request.machine.gpu_bytes = bytes_of_gib(gpu_gib);
  request.machine.host_bytes = bytes_of_gib(host_gib);
  if (const auto mfu = args.optional("mfu"))
    request.hardware.mfu = args.positive_or("mfu", *mfu, "a fraction in (0, 1]");
  const std::string mla = args.value_or("mla", "absorbed");
  check(mla == "expanded" || mla == "absorbed", "--mla must be expanded or absorbed, got '", mla, "'");
  request.options.absorbed = mla == "absorbed";
  request.options.indexer_kl = args.flag("indexer-kl");
  const plan::Plan result = plan::make_plan(config, request);

  const int64_t usable = request.machine.gpu_bytes - plan::kDeviceReserveBytes;
  std::printf(
      "spindle plan: %s, %lld tokens, %lld GPU%s of %.0f GiB (%.1f usable: %.0f GiB kept for the CUDA "
      "context, cuBLASLt and allocator slack), host %.0f GiB per GPU\n",
      source.c_str(), static_cast<long long>(request.tokens), static_cast<long long>(request.machine.gpus),
      request.machine.gpus > 1 ? "s" : "", gpu_gib, in_gib(usable), in_gib(plan::kDeviceReserveBytes),
      host_gib);
  std::string kl_rate;
  if (request.options.indexer_kl) {
    char text[96];
    std::snprintf(text, sizeof text, "; its KL training as the sparse attention's FLOPs at %.0f%%",
                  100 * request.hardware.indexer_kl_mfu);
    kl_rate = text;
  }
  std::printf(
      "assumes: %s MLA, indexer KL %s; one training step = forward + backward + AdamW (bf16 weights, fp32 "
      "gradients and AdamW state); time at the measured MFU %.2f%% of %.0f TFLOP/s (the indexer's scores, "
      "once per step, %.0f%%%s), PCIe %.0f GB/s (%.0f each way with both busy), host AdamW %.0f GB/s\n",
      mla.c_str(), request.options.indexer_kl ? "trained" : "off", 100 * request.hardware.mfu,
      request.hardware.peak_flops / 1e12, 100 * request.hardware.indexer_mfu, kl_rate.c_str(),
      request.hardware.pcie_bytes_per_s / 1e9, request.hardware.pcie_both_ways_bytes_per_s / 1e9,
      request.hardware.host_adam_bytes_per_s / 1e9);
  std::printf("parallel: %s\n", plan::Parallel{request.machine.gpus, 1}.describe(config).c_str());
  int name_width = 6;
  for (const Candidate& x : result.candidates)
    name_width = std::max(name_width, static_cast<int>(x.policy.name().size()));
  std::printf("\n  %-*s %8s %8s %6s %6s %6s %6s %8s %9s %7s\n", name_width, "policy", "device", "weights",
              "grads", "adam", "acts", "work", "host", "step s", "relative");
  std::printf("  %-*s %8s %8s %6s %6s %6s %6s %8s %9s %7s\n", name_width, "", "GiB", "GiB", "GiB", "GiB",
              "GiB", "GiB", "GiB", "", "");
  const bool one_gpu = request.machine.gpus == 1;
  for (const Candidate& x : result.candidates) print_row(x, name_width, one_gpu);
  if (!result.pick) {
    std::printf("\npick: none fits (%lld policies tried; each line says why)\n",
                static_cast<long long>(result.candidates.size()));
    return 1;
  }
  const Candidate& pick = result.candidates[*result.pick];
  const Candidate* runs =
      one_gpu ? (plan::executor_runs(pick.policy) ? &pick : plan::fastest_runnable(result)) : nullptr;
  std::printf(
      "\npick: %s (tensor parallel %lld, expert parallel %lld): %.1f GiB device, %.1f GiB host, "
      "%.1f s per step, the fastest that fits\n",
      pick.policy.name().c_str(), static_cast<long long>(pick.policy.tensor_parallel),
      static_cast<long long>(request.machine.gpus), in_gib(pick.memory.device.peak_total),
      in_gib(pick.memory.host), pick.time.total());
  if (!one_gpu) {
    std::printf("planned only: the CUDA executor runs on one GPU today\n");
  } else if (!plan::executor_runs(pick.policy)) {
    if (const Candidate* runnable = plan::fastest_runnable(result))
      std::printf(
          "runs today: %s (%.1f GiB device, %.1f s per step), the fastest that fits of those the "
          "executor runs (spindle train and bench take it)\n",
          runnable->policy.name().c_str(), in_gib(runnable->memory.device.peak_total),
          runnable->time.total());
    else
      std::printf("runs today: none; every policy that fits is planned only\n");
  }
  if (runs != nullptr && runs->memory.pinned_pool > 0) {
    const double bytes = static_cast<double>(runs->memory.pinned_pool);
    std::printf(
        "first step: also pins the %.1f GiB pool of offloaded layer inputs in host memory, about %.0f s at "
        "the measured %.1f GB/s; later steps reuse it\n",
        in_gib(runs->memory.pinned_pool), bytes / request.hardware.pin_bytes_per_s,
        request.hardware.pin_bytes_per_s / 1e9);
  }
  return 0;
}

}  // namespace spindle
