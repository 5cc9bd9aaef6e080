// AdamW with its state in host memory (the planner's "host AdamW"): the device keeps the bf16
// weights and fp32 gradients and no optimizer state; each step downloads the gradients, updates
// the fp32 masters and moments on the host with the CPU path's optimizer (train/adamw.h), and
// uploads the new weights. Saves the state's 12 bytes per parameter of device memory for two
// copies over PCIe and a host update per step. The host copies of the weights and gradients are
// pinned and laid out as the device's arenas. A step pipelines the copies with the update: the
// gradients come down parameter by parameter on one stream while the host updates those already
// there, in batches over all its cores, and each batch's new weights go up on another stream.
// Meanwhile the device updates the last slots (the device share, 1 - host_share of the values):
// their masters and moments, pinned on the host, go up piece by piece, the device updates them
// with its own gradients and weights (the host's arithmetic, bit for bit: adamw_update_exact), and
// they come back; PCIe carries each way at once what the host's update would have read and written.
#pragma once

#include <deque>
#include <memory>
#include <vector>

#include "backend/cuda/device_memory.h"
#include "backend/cuda/stream.h"
#include "model/cuda/model.h"
#include "model/weights.h"
#include "train/adamw.h"

namespace spindle::cuda {

class HostOptimizer {
 public:
  // From the device's current weights, with zero moments; the host updates the first slots, about
  // host_share of the values (1: all), the device the rest.
  HostOptimizer(CudaModel& model, double host_share);

  // The state of `host` (same config), by parameter name; the device gets its weights.
  void load(const AdamW& host);
  // The frozen flags of `host`'s slots, by parameter name; the state stays.
  void set_frozen(const AdamW& host);
  // Into `host` (same config), which then writes its model weights.
  void save(AdamW& host) const;
  // One update number `step` (1-based) with the device's gradients.
  void step(const AdamWOptions& options, double lr, int64_t step);
  // The router biases a separate rule set on the device, so the next upload keeps them.
  void set_router_biases(const ModelWeights& host);

 private:
  // Says what is about to be built (tens of seconds at billions of parameters); returns `model`.
  static CudaModel& announced(CudaModel& model);

  struct Copy {
    void* host;
    void* device;
    size_t bytes;
  };

  // The device share: slots [first_slot, end) and their state, in pinned memory from the start
  // (AdamW builds it there).
  struct DeviceShare {
    size_t first_slot = 0;
    int64_t piece_values = 0;  // values a piece of the share's state moves at a time
    AdamWStateStorage storage;
  };
  static DeviceShare device_share(const ModelConfig& config, ModelWeights& weights, double host_share);

  CudaModel& model_;
  std::shared_ptr<void> weights_host_, grads_host_;  // pinned, the device arenas' bytes
  ModelWeights weights_, grads_;                     // views of them (bf16 matrices, fp32 gradients)
  DeviceShare share_;
  AdamW adam_;  // its slots view weights_
  // Per AdamW slot: its gradient's copy down and its weight's copy up; then the parameters AdamW
  // does not train (the router biases), uploaded whole after each update as before it.
  std::vector<Copy> gradient_copies_, weight_copies_, untrained_copies_;
  Stream down_, up_;
  std::deque<Event> landed_;  // per slot: its gradient is on the host

  // Queues the device share's update number `step` at `lr` (state up, update, state down), done by
  // state_down_.
  void start_device_share(double lr, int64_t step);
  std::vector<Tensor> device_weights_, device_grads_;  // per slot
  Stream state_up_, update_, state_down_;
  std::deque<Event> share_events_;            // loaded, updated and freed, per staging buffer
  std::vector<DeviceBuffer<float>> staging_;  // during a step: two buffers of master, m and v
};

}  // namespace spindle::cuda
