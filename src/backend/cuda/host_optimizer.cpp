#include "backend/cuda/host_optimizer.h"

#include <algorithm>
#include <cmath>
#include <map>
#include <string>

#include "backend/cuda/pinned_memory.h"
#include "core/error.h"
#include "core/log.h"
#include "kernels/cuda/ops.h"

namespace spindle::cuda {

namespace {

// The device's current parameters, copied into `host` (laid out as `device`).
ModelWeights downloaded(CudaModel& model, const std::shared_ptr<void>& host) {
  model.context().synchronize();
  model.weights().copy_to_host(host.get());
  return model.weights().host_view(host);
}

void enqueue(void* to, const void* from, size_t bytes, cudaMemcpyKind kind, const Stream& stream) {
  SPINDLE_CUDA(cudaMemcpyAsync(to, from, bytes, kind, stream.get()));
}

}  // namespace

CudaModel& HostOptimizer::announced(CudaModel& model) {
  const double pinned = static_cast<double>(model.weights().bytes() + model.grads().bytes()),
               state = 3.0 * static_cast<double>(model.grads().bytes());  // fp32 master, m and v
  const auto gb = [](double bytes) { return std::round(bytes / 1e8) / 10; };
  log_info("host AdamW: pinning ", gb(pinned), " GB for the weights' and gradients' copies and building ",
           gb(state), " GB of fp32 state on the host");
  return model;
}

HostOptimizer::HostOptimizer(CudaModel& model, double host_share)
    : model_(announced(model)),
      weights_host_(allocate_pinned(model.weights().bytes(), "the host AdamW's copy of the weights")),
      grads_host_(allocate_pinned(model.grads().bytes(), "the host AdamW's copy of the gradients")),
      weights_(downloaded(model, weights_host_)),
      grads_(model.grads().host_view(grads_host_)),
      share_(device_share(model.config(), weights_, host_share)),
      adam_(model.config(), weights_, {}, share_.storage) {
  const ModelConfig& config = model.config();
  std::vector<Param> host_weights = parameter_table(config, weights_),
                     host_grads = parameter_table(config, grads_),
                     device_weights = parameter_table(config, model.weights().tensors()),
                     device_grads = parameter_table(config, model.grads().tensors());
  size_t slot = 0;
  for (size_t i = 0; i < host_weights.size(); ++i) {
    const Copy weight{host_weights[i].tensor.raw(), device_weights[i].tensor.raw(),
                      host_weights[i].tensor.nbytes()};
    if (!role_trained(host_weights[i].role)) {
      untrained_copies_.push_back(weight);
      continue;
    }
    check(slot < adam_.slots().size() && adam_.slots()[slot].name == host_weights[i].name,
          "host AdamW: parameter ", host_weights[i].name, " is not slot ", slot, " of the update");
    const bool on_device = slot++ >= share_.first_slot;  // in the device share
    weight_copies_.push_back(weight);
    gradient_copies_.push_back(
        {host_grads[i].tensor.raw(), device_grads[i].tensor.raw(), host_grads[i].tensor.nbytes()});
    landed_.emplace_back(cudaEventDisableTiming);
    device_weights_.push_back(device_weights[i].tensor);
    device_grads_.push_back(device_grads[i].tensor);
    if (on_device) {  // the device share's update writes the weight from f32 gradients
      const DType w = device_weights[i].tensor.dtype(), g = device_grads[i].tensor.dtype();
      check((w == DType::BF16 || w == DType::F32) && g == DType::F32, "host AdamW: the device's ",
            host_weights[i].name, " is ", dtype_name(w), " with a ", dtype_name(g),
            " gradient (the device share takes bf16 or f32 weights, f32 gradients)");
    }
  }
  check(slot == adam_.slots().size(), "host AdamW: ", slot, " trained parameters for ", adam_.slots().size(),
        " slots");
  if (share_.storage.owner)
    for (int e = 0; e < 6; ++e) share_events_.emplace_back(cudaEventDisableTiming);
}

HostOptimizer::DeviceShare HostOptimizer::device_share(const ModelConfig& config, ModelWeights& weights,
                                                       double host_share) {
  check(host_share > 0 && host_share <= 1, "host AdamW: the host's share must be in (0, 1], got ",
        host_share);
  std::vector<int64_t> sizes;  // of the AdamW slots: the trained parameters, in order
  int64_t total = 0;
  for (const Param& p : parameter_table(config, weights))
    if (role_trained(p.role)) total += sizes.emplace_back(p.tensor.numel());
  DeviceShare share;
  int64_t host_values = 0;
  while (share.first_slot < sizes.size() &&
         static_cast<double>(host_values) < host_share * static_cast<double>(total))
    host_values += sizes[share.first_slot++];
  const int64_t shared = total - host_values;
  if (shared == 0) return share;
  log_info("host AdamW: the device updates ", std::round(static_cast<double>(shared) / 1e7) / 100,
           " B of the values, their state pinned and streamed through it; the host ",
           std::round(static_cast<double>(host_values) / 1e7) / 100, " B");
  // A sixteenth of the share a piece, so that its copies overlap, up to 64 MB an array.
  share.piece_values = std::clamp<int64_t>(shared / 16, 256, int64_t{1} << 24);
  share.storage.owner =
      allocate_pinned(3 * static_cast<size_t>(shared) * sizeof(float), "the device share's AdamW state");
  std::vector<float*> places(sizes.size(), nullptr);
  float* next = static_cast<float*>(share.storage.owner.get());
  for (size_t i = share.first_slot; i < sizes.size(); ++i) {
    places[i] = next;
    next += 3 * sizes[i];
  }
  share.storage.at = [places](size_t slot, int64_t) { return slot < places.size() ? places[slot] : nullptr; };
  return share;
}

void HostOptimizer::load(const AdamW& host) {
  std::map<std::string, const AdamW::Slot*> by_name;
  for (const AdamW::Slot& s : host.slots()) by_name[s.name] = &s;
  for (AdamW::Slot& s : adam_.slots()) {
    const auto it = by_name.find(s.name);
    check(it != by_name.end(), "load_optimizer: the host optimizer has no state for ", s.name);
    s.frozen = it->second->frozen;
    s.master.copy_from(it->second->master);
    s.exp_avg.copy_from(it->second->exp_avg);
    s.exp_avg_sq.copy_from(it->second->exp_avg_sq);
  }
  adam_.set_steps(host.steps());
  adam_.write_weights();
  model_.weights().copy_from_host(weights_host_.get());
}

void HostOptimizer::set_frozen(const AdamW& host) {
  std::map<std::string, bool> frozen;
  for (const AdamW::Slot& s : host.slots()) frozen[s.name] = s.frozen;
  for (AdamW::Slot& s : adam_.slots()) {
    const auto it = frozen.find(s.name);
    check(it != frozen.end(), "set_frozen: the host optimizer has no slot for ", s.name);
    s.frozen = it->second;
  }
}

void HostOptimizer::save(AdamW& host) const {
  check(host.slots().size() == adam_.slots().size(), "save_optimizer: the host optimizer has ",
        host.slots().size(), " slots, this one ", adam_.slots().size());
  for (size_t i = 0; i < host.slots().size(); ++i) {
    const AdamW::Slot& from = adam_.slots()[i];
    AdamW::Slot& to = host.slots()[i];
    check(from.name == to.name, "save_optimizer: slot ", i, " is ", to.name, " on one side, ", from.name,
          " on the other");
    to.master.copy_from(from.master);
    to.exp_avg.copy_from(from.exp_avg);
    to.exp_avg_sq.copy_from(from.exp_avg_sq);
  }
  host.write_weights();
}

void HostOptimizer::start_device_share(double lr, int64_t step) {
  // Pieces through two staging buffers (master, m, v each), so that one piece's state comes up
  // while the one before it is updated and the one before that goes down.
  staging_.clear();
  for (int b = 0; b < 2; ++b)
    staging_.emplace_back(3 * static_cast<size_t>(share_.piece_values), MemoryCategory::Optimizer);
  Event *loaded = &share_events_[0], *updated = &share_events_[2], *freed = &share_events_[4];
  int64_t piece = 0;
  for (size_t i = share_.first_slot; i < adam_.slots().size(); ++i) {
    AdamW::Slot& s = adam_.slots()[i];
    if (s.frozen) continue;
    const AdamWConstants constants = adam_.constants(s.decays, lr, step);
    const bool bf16_weight = device_weights_[i].dtype() == DType::BF16;
    for (int64_t begin = 0; begin < s.master.numel(); begin += share_.piece_values, ++piece) {
      const int64_t count = std::min(share_.piece_values, s.master.numel() - begin);
      const size_t b = static_cast<size_t>(piece % 2), bytes = static_cast<size_t>(count) * sizeof(float);
      float* state = staging_[b].data();
      float* host[3] = {s.master.data<float>() + begin, s.exp_avg.data<float>() + begin,
                        s.exp_avg_sq.data<float>() + begin};
      if (piece >= 2) freed[b].make_wait(state_up_.get());  // the piece before last has gone down
      for (int k = 0; k < 3; ++k)
        enqueue(state + k * share_.piece_values, host[k], bytes, cudaMemcpyHostToDevice, state_up_);
      loaded[b].record(state_up_);
      loaded[b].make_wait(update_.get());
      unsigned char* weight = static_cast<unsigned char*>(device_weights_[i].raw()) +
                              begin * static_cast<int64_t>(dtype_size(device_weights_[i].dtype()));
      adamw_update_exact(constants, static_cast<const float*>(device_grads_[i].raw()) + begin, state,
                         state + share_.piece_values, state + 2 * share_.piece_values, weight, bf16_weight,
                         count, update_.get());
      updated[b].record(update_);
      updated[b].make_wait(state_down_.get());
      for (int k = 0; k < 3; ++k)
        enqueue(host[k], state + k * share_.piece_values, bytes, cudaMemcpyDeviceToHost, state_down_);
      freed[b].record(state_down_);
    }
  }
}

void HostOptimizer::step(const AdamWOptions& options, double lr, int64_t step) {
  model_.context().synchronize();  // the gradients are final
  adam_.set_options(options);
  adam_.set_steps(step - 1);  // the update below is number `step`, as on the device
  if (share_.storage.owner) start_device_share(lr, step);
  for (size_t i = 0; i < share_.first_slot; ++i) {
    const Copy& c = gradient_copies_[i];
    enqueue(c.host, c.device, c.bytes, cudaMemcpyDeviceToHost, down_);
    landed_[i].record(down_);
  }
  AdamWBatches batches;  // the new weights into weights_, rounded as the device's
  batches.slots = share_.first_slot;
  batches.elements = (static_cast<int64_t>(model_.grads().bytes() / sizeof(float)) + kHostAdamWBatches - 1) /
                     kHostAdamWBatches;
  batches.before = [&](size_t, size_t last) { landed_[last - 1].synchronize(); };  // copies land in order
  batches.after = [&](size_t first, size_t last) {
    for (size_t i = first; i < last; ++i)
      enqueue(weight_copies_[i].device, weight_copies_[i].host, weight_copies_[i].bytes,
              cudaMemcpyHostToDevice, up_);
  };
  adam_.step(grads_, lr, batches);
  for (const Copy& c : untrained_copies_) enqueue(c.device, c.host, c.bytes, cudaMemcpyHostToDevice, up_);
  up_.synchronize();
  state_down_.synchronize();  // and with it the device share's updates (their weights on the device)
  staging_.clear();
}

void HostOptimizer::set_router_biases(const ModelWeights& host) {
  for (size_t l = 0; l < weights_.layers.size(); ++l)
    if (weights_.layers[l].mlp == MlpKind::Sparse)
      weights_.layers[l].moe.correction_bias.copy_from(host.layers[l].moe.correction_bias);
}

}  // namespace spindle::cuda
