#include "model/cuda/layer_offload.h"

#include "backend/cuda/pinned_memory.h"
#include "core/error.h"
#include "core/log.h"

namespace spindle::cuda {

OffloadedLayerInputs::~OffloadedLayerInputs() {
  if (pool_ != nullptr) cudaStreamSynchronize(copies_.get());  // no copy may still use the pool
}

void OffloadedLayerInputs::reserve(size_t layers, size_t elements) {
  if (layers == layers_ && elements == elements_) return;
  if (pool_ != nullptr) {
    copies_.synchronize();
    pool_.reset();
  }
  layers_ = elements_ = 0;
  const size_t bytes = layers * elements * sizeof(__nv_bfloat16);
  log_info("pinning ", bytes, " bytes of host memory for ", layers, " offloaded layer inputs");
  pool_ = allocate_pinned(bytes, "the offloaded layer inputs");
  layers_ = layers;
  elements_ = elements;
  sent_.clear();
  fetched_.clear();
  for (size_t i = 0; i < layers; ++i) {
    sent_.push_back(std::make_unique<Event>(cudaEventDisableTiming));
    fetched_.push_back(std::make_unique<Event>(cudaEventDisableTiming));
  }
}

void OffloadedLayerInputs::send(size_t layer, const __nv_bfloat16* input, cudaStream_t compute) {
  check(layer < layers_, "offload of layer ", layer, " into a pool of ", layers_);
  Event ready(cudaEventDisableTiming);
  ready.record(compute);
  ready.make_wait(copies_.get());
  SPINDLE_CUDA(cudaMemcpyAsync(slot(layer), input, elements_ * sizeof(__nv_bfloat16), cudaMemcpyDeviceToHost,
                               copies_.get()));
  sent_[layer]->record(copies_);
}

void OffloadedLayerInputs::wait_sent(size_t layer, cudaStream_t compute) const {
  sent_[layer]->make_wait(compute);
}

void OffloadedLayerInputs::fetch(size_t layer, __nv_bfloat16* device, cudaStream_t compute) {
  check(layer < layers_, "fetch of layer ", layer, " from a pool of ", layers_);
  Event ready(cudaEventDisableTiming);
  ready.record(compute);
  ready.make_wait(copies_.get());
  SPINDLE_CUDA(cudaMemcpyAsync(device, slot(layer), elements_ * sizeof(__nv_bfloat16), cudaMemcpyHostToDevice,
                               copies_.get()));
  fetched_[layer]->record(copies_);
}

void OffloadedLayerInputs::wait_fetched(size_t layer, cudaStream_t compute) const {
  fetched_[layer]->make_wait(compute);
}

}  // namespace spindle::cuda
