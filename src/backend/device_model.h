// A model held by an accelerator backend: what the CLI and the trainer ask of it. The CUDA
// backend registers its factory from main() when Spindle is built with nvcc; asking for a
// device nobody registered fails with a message that says so (never a silent CPU run).
// Weights, gradients and optimizer state stay on the device; the host copies are written back on
// request (checkpoints, evaluation).
#pragma once

#include <functional>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "core/allocator.h"
#include "core/tensor.h"
#include "model/backward.h"
#include "model/config.h"
#include "model/weights.h"
#include "train/adamw.h"

namespace spindle {

struct DeviceModelOptions {
  bool strict_kernels = false;  // fail if any op falls back to a slow or dense path
  // DSA attention over the shared latent (MLA's absorbed form, on the tensor cores) instead of
  // per-head keys and values (CUDA cores); the default since it is the faster (docs/PERF.md).
  bool absorbed_mla = true;
  // log_probs a chunk of this many tokens at a time through all layers (the streaming executor,
  // docs/STREAMING.md); 0: the whole sequence at once. The loss takes LossOptions::chunk_tokens.
  int64_t chunk_tokens = 0;
};

class DeviceModel {
 public:
  virtual ~DeviceModel() = default;

  // log p(tokens[i] | tokens[<i]) for i = 1 .. n-1 (bf16 weights and activations, fp32 math), in
  // chunks of DeviceModelOptions::chunk_tokens.
  virtual std::vector<float> log_probs(const std::vector<int32_t>& tokens) = 0;
  // As log_probs, handing each DSA layer's selection (layers with their own indexer) to `seen` as
  // each chunk makes it: the layer, the chunk's first query and its rows [queries, width] on the
  // host, in cpu::indexer_select's layout (spindle select).
  using SelectionSink =
      std::function<void(int64_t layer, int64_t first, const std::vector<int32_t>& selection)>;
  virtual std::vector<float> log_probs_and_selections(const std::vector<int32_t>& tokens,
                                                      const SelectionSink& seen) = 0;

  // As spindle::loss_and_gradients, accumulating into the device's fp32 gradients.
  virtual LossResult loss_and_gradients(const std::vector<int32_t>& tokens, const LossOptions& options) = 0;
  virtual void zero_gradients() = 0;
  // torch's clip_grad_norm_ over the trained gradients; returns the norm before clipping.
  virtual double clip_gradients(double max_norm) = 0;
  // The gradients or the weights (as the device holds them), converted into `host` (allocated
  // for the same config).
  virtual void download_gradients(ModelWeights& host) = 0;
  virtual void download_weights(ModelWeights& host) = 0;
  // Replaces the device's gradients with `host`'s (converted): gradients reduced elsewhere, such as
  // across processes, or the same gradients for two optimizers under test.
  virtual void upload_gradients(const ModelWeights& host) = 0;

  // The optimizer: masters and moments copied from `host`'s slots (frozen slots are skipped by
  // step); step() takes update number `step` (1-based) at `lr`; save() writes the state back
  // into the host slots and the host model weights.
  // Where the next load_optimizer / init_optimizer keeps the AdamW state: the device (the
  // default) or the host (12 bytes per parameter less on the device; PCIe copies and a host
  // update per step). On the host, the host updates host_share of the values and the device the
  // rest, their state streamed through it (backend/cuda/host_optimizer.h).
  virtual void set_optimizer_on_host(bool on, double host_share = host_adamw_host_share()) = 0;
  virtual void load_optimizer(const AdamW& host) = 0;
  // Takes the frozen flags of `host`'s slots (the parameters load_optimizer took), keeping the
  // state: from the next step on, frozen slots are skipped and the others updated.
  virtual void set_frozen(const AdamW& host) = 0;
  virtual void optimizer_step(const AdamWOptions& options, double lr, int64_t step) = 0;
  virtual void save_optimizer(AdamW& host) = 0;
  // A fresh optimizer without a host copy (benchmarks): masters from the device weights, zero moments.
  virtual void init_optimizer() = 0;

  // Copies every MoE layer's router correction bias from `host` (updated outside gradient descent).
  virtual void set_router_biases(const ModelWeights& host) = 0;

  // Which implementation ran for each op, and device memory (current/peak by category).
  virtual std::string kernel_report() const = 0;
  virtual bool any_fallback() const = 0;
  virtual MemoryStats memory() const = 0;
  virtual int64_t memory_capacity() const = 0;  // the device's memory in bytes, as the driver reports it
  // Device memory in use that the allocator does not hold: the CUDA context, the kernels' local
  // memory, libraries' own allocations.
  virtual int64_t memory_outside_allocator() const = 0;
  // The device allocator's calls to the driver so far (cudaMalloc; cache flushes when an allocation
  // did not fit beside the cached blocks, each a device synchronisation).
  struct AllocatorCounts {
    int64_t driver_allocations = 0, cache_flushes = 0;
  };
  virtual AllocatorCounts allocator_counts() const = 0;
  virtual void reset_memory_peak() = 0;
  virtual std::string device_name() const = 0;

  // Device time by layer kind ("kda", "dsa", "mlp", "moe", "head"): recorded while timing is on,
  // summed in milliseconds and cleared by collect_timing().
  virtual void set_timing(bool on) = 0;
  virtual std::map<std::string, double> collect_timing() = 0;
  virtual void synchronize() = 0;
  // Opens (begin) or closes a profiler's capture range: nsys --capture-range=cudaProfilerApi records
  // only the device work queued in between (bench/step_profile.sh).
  virtual void profile_range(bool begin) = 0;
};

using DeviceModelFactory = std::function<std::unique_ptr<DeviceModel>(
    const ModelConfig& config, const ModelWeights& host_weights, const DeviceModelOptions& options)>;

void register_device_backend(Device device, DeviceModelFactory factory);

// Uploads `host_weights` (any float dtype) to a new device model.
std::unique_ptr<DeviceModel> open_device_model(Device device, const ModelConfig& config,
                                               const ModelWeights& host_weights,
                                               const DeviceModelOptions& options = {});

// "cpu" or "cuda".
Device parse_device(const std::string& text, const std::string& option);

}  // namespace spindle
