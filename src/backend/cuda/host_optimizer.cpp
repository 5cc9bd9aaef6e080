#include "backend/cuda/host_optimizer.h"

#include <map>
#include <string>

#include "backend/cuda/pinned_memory.h"
#include "core/error.h"

namespace spindle::cuda {

namespace {

// The device's current parameters, copied into `host` (laid out as `device`).
ModelWeights downloaded(CudaModel& model, const std::shared_ptr<void>& host) {
  model.context().synchronize();
  model.weights().copy_to_host(host.get());
  return model.weights().host_view(host);
}

}  // namespace

HostOptimizer::HostOptimizer(CudaModel& model)
    : model_(model),
      weights_host_(allocate_pinned(model.weights().bytes(), "the host AdamW's copy of the weights")),
      grads_host_(allocate_pinned(model.grads().bytes(), "the host AdamW's copy of the gradients")),
      weights_(downloaded(model, weights_host_)),
      grads_(model.grads().host_view(grads_host_)),
      adam_(model.config(), weights_) {}

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
  model_.context().synchronize();
  model_.grads().copy_to_host(grads_host_.get());
  adam_.set_options(options);
  adam_.set_steps(step - 1);  // the update below is number `step`, as on the device
  adam_.step(grads_, lr);     // and the new weights into weights_, rounded as the device's
  model_.weights().copy_from_host(weights_host_.get());
}

void HostOptimizer::set_router_biases(const ModelWeights& host) {
  for (size_t l = 0; l < weights_.layers.size(); ++l)
    if (weights_.layers[l].mlp == MlpKind::Sparse)
      weights_.layers[l].moe.correction_bias.copy_from(host.layers[l].moe.correction_bias);
}

}  // namespace spindle::cuda
