#include "backend/device_model.h"

#include <map>

namespace spindle {

namespace {

std::map<Device, DeviceModelFactory>& registry() {
  static std::map<Device, DeviceModelFactory> factories;
  return factories;
}

}  // namespace

void register_device_backend(Device device, DeviceModelFactory factory) {
  registry()[device] = std::move(factory);
}

std::unique_ptr<DeviceModel> open_device_model(Device device, const ModelConfig& config,
                                               const ModelWeights& host_weights,
                                               const DeviceModelOptions& options) {
  const auto found = registry().find(device);
  check(found != registry().end(), "this spindle was built without the ", device_name(device),
        " backend (nvcc was not found when it was configured); rebuild on a machine with the CUDA toolkit");
  return found->second(config, host_weights, options);
}

Device parse_device(const std::string& text, const std::string& option) {
  if (text == "cpu") return Device::CPU;
  if (text == "cuda") return Device::CUDA;
  fail(option, " must be cpu or cuda, got '", text, "'");
}

}  // namespace spindle
