#include "model/cuda/device_weights.h"

#include "backend/cuda/check.h"
#include "backend/cuda/device_memory.h"

namespace spindle::cuda {

namespace {

constexpr size_t kAlign = 256;

size_t aligned(size_t bytes) { return (bytes + kAlign - 1) / kAlign * kAlign; }

const void* checked(const Tensor& t, DType dtype) {
  check(t.defined() && t.device() == Device::CUDA, "expected a device tensor, got ", t.describe());
  check(t.dtype() == dtype, "device tensor ", t.describe(), " used as ", dtype_name(dtype));
  return t.raw();
}

}  // namespace

DeviceWeights::DeviceWeights(const ModelConfig& config, Kind kind) : config_(config), kind_(kind) {
  const MemoryCategory category = kind == Kind::Weights ? MemoryCategory::Weights : MemoryCategory::Gradients;
  // Pass 1 sizes the arena; pass 2 hands out its slices in the same order.
  build_weights(config, DType::BF16, [&](const Shape& shape, WeightPrecision precision) {
    bytes_ += aligned(static_cast<size_t>(shape_numel(shape)) * dtype_size(dtype_of(precision)));
    return Tensor::meta(shape, dtype_of(precision));
  });
  void* base = DeviceAllocator::instance().allocate(bytes_, category);
  arena_ = std::shared_ptr<void>(base, [](void* p) { DeviceAllocator::instance().release(p); });
  weights_ = laid_out(arena_, Device::CUDA);
}

DType DeviceWeights::dtype_of(WeightPrecision precision) const {
  return kind_ == Kind::Gradients || precision == WeightPrecision::Fp32 ? DType::F32 : DType::BF16;
}

ModelWeights DeviceWeights::laid_out(const std::shared_ptr<void>& base, Device device) const {
  size_t offset = 0;
  return build_weights(config_, DType::BF16, [&](const Shape& shape, WeightPrecision precision) {
    Tensor t =
        Tensor::borrow(base, static_cast<char*>(base.get()) + offset, shape, dtype_of(precision), device);
    offset += aligned(t.nbytes());
    return t;
  });
}

ModelWeights DeviceWeights::host_view(const std::shared_ptr<void>& host) const {
  return laid_out(host, Device::CPU);
}

void DeviceWeights::copy_to_host(void* host) const {
  SPINDLE_CUDA(cudaMemcpy(host, arena_.get(), bytes_, cudaMemcpyDeviceToHost));
}

void DeviceWeights::copy_from_host(const void* host) {
  SPINDLE_CUDA(cudaMemcpy(arena_.get(), host, bytes_, cudaMemcpyHostToDevice));
}

void DeviceWeights::zero(cudaStream_t stream) {
  SPINDLE_CUDA(cudaMemsetAsync(arena_.get(), 0, bytes_, stream));
}

void DeviceWeights::upload(const ModelWeights& host) {
  auto source = parameter_table(config_, const_cast<ModelWeights&>(host));
  auto target = parameter_table(config_, weights_);
  check(source.size() == target.size(), "upload: parameter tables differ");
  for (size_t i = 0; i < source.size(); ++i) {
    const Tensor staged = source[i].tensor.to(target[i].tensor.dtype());
    check(staged.numel() == target[i].tensor.numel(), "upload: ", source[i].name, " has shape ",
          source[i].tensor.describe(), ", the device expects ", target[i].tensor.describe());
    copy_to_device(target[i].tensor.raw(), staged.raw(), staged.nbytes());
  }
}

void DeviceWeights::download(ModelWeights& host) {
  auto source = parameter_table(config_, weights_);
  auto target = parameter_table(config_, host);
  check(source.size() == target.size(), "download: parameter tables differ");
  for (size_t i = 0; i < source.size(); ++i) {
    Tensor staged = Tensor::empty(source[i].tensor.shape(), source[i].tensor.dtype());
    SPINDLE_CUDA(cudaMemcpy(staged.raw(), source[i].tensor.raw(), staged.nbytes(), cudaMemcpyDeviceToHost));
    target[i].tensor.copy_from(staged);
  }
}

const __nv_bfloat16* bf16_data(const Tensor& t) {
  return static_cast<const __nv_bfloat16*>(checked(t, DType::BF16));
}
__nv_bfloat16* bf16_data(Tensor& t) {
  return const_cast<__nv_bfloat16*>(static_cast<const __nv_bfloat16*>(checked(t, DType::BF16)));
}
const float* f32_data(const Tensor& t) { return static_cast<const float*>(checked(t, DType::F32)); }
float* f32_data(Tensor& t) { return const_cast<float*>(static_cast<const float*>(checked(t, DType::F32))); }

}  // namespace spindle::cuda
