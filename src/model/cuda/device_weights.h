// The model's parameters on the GPU, in one allocation: bf16 for the matrices, fp32 for the small
// parameters that feed fp32 math (WeightPrecision::Fp32), or fp32 throughout for gradients.
// Copies to and from the host walk parameter_table, so names, per-expert views and the tied
// lm_head are the CPU path's.
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <memory>

#include "core/tensor.h"
#include "model/config.h"
#include "model/weights.h"

namespace spindle::cuda {

class DeviceWeights {
 public:
  enum class Kind { Weights, Gradients };
  DeviceWeights(const ModelConfig& config, Kind kind);

  ModelWeights& tensors() { return weights_; }
  const ModelWeights& tensors() const { return weights_; }
  size_t bytes() const { return bytes_; }

  void zero(cudaStream_t stream);
  // Converting copies (any float dtype on the host); synchronous.
  void upload(const ModelWeights& host);
  void download(ModelWeights& host);

  // Tensors over `host` (bytes() of host memory) with this arena's layout: the same dtypes and
  // offsets, so that copy_to_host / copy_from_host move every parameter in one copy (at PCIe
  // speed when `host` is pinned); synchronous.
  ModelWeights host_view(const std::shared_ptr<void>& host) const;
  void copy_to_host(void* host) const;
  void copy_from_host(const void* host);

 private:
  DType dtype_of(WeightPrecision precision) const;
  ModelWeights laid_out(const std::shared_ptr<void>& base, Device device) const;

  ModelConfig config_;
  Kind kind_;
  std::shared_ptr<void> arena_;
  size_t bytes_ = 0;
  ModelWeights weights_;
};

// Typed device pointers of a device tensor, checked.
const __nv_bfloat16* bf16_data(const Tensor& t);
__nv_bfloat16* bf16_data(Tensor& t);
const float* f32_data(const Tensor& t);
float* f32_data(Tensor& t);

}  // namespace spindle::cuda
