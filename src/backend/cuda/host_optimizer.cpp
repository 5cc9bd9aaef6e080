#include "backend/cuda/host_optimizer.h"

#include <cmath>
#include <map>
#include <string>

#include "backend/cuda/pinned_memory.h"
#include "core/error.h"
#include "core/log.h"

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

HostOptimizer::HostOptimizer(CudaModel& model)
    : model_(announced(model)),
      weights_host_(allocate_pinned(model.weights().bytes(), "the host AdamW's copy of the weights")),
      grads_host_(allocate_pinned(model.grads().bytes(), "the host AdamW's copy of the gradients")),
      weights_(downloaded(model, weights_host_)),
      grads_(model.grads().host_view(grads_host_)),
      adam_(model.config(), weights_) {
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
    ++slot;
    weight_copies_.push_back(weight);
    gradient_copies_.push_back(
        {host_grads[i].tensor.raw(), device_grads[i].tensor.raw(), host_grads[i].tensor.nbytes()});
    landed_.emplace_back(cudaEventDisableTiming);
  }
  check(slot == adam_.slots().size(), "host AdamW: ", slot, " trained parameters for ", adam_.slots().size(),
        " slots");
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

void HostOptimizer::step(const AdamWOptions& options, double lr, int64_t step) {
  model_.context().synchronize();  // the gradients are final
  for (size_t i = 0; i < gradient_copies_.size(); ++i) {
    const Copy& c = gradient_copies_[i];
    enqueue(c.host, c.device, c.bytes, cudaMemcpyDeviceToHost, down_);
    landed_[i].record(down_);
  }
  adam_.set_options(options);
  adam_.set_steps(step - 1);  // the update below is number `step`, as on the device
  AdamWBatches batches;       // the new weights into weights_, rounded as the device's
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
}

void HostOptimizer::set_router_biases(const ModelWeights& host) {
  for (size_t l = 0; l < weights_.layers.size(); ++l)
    if (weights_.layers[l].mlp == MlpKind::Sparse)
      weights_.layers[l].moe.correction_bias.copy_from(host.layers[l].moe.correction_bias);
}

}  // namespace spindle::cuda
