// The layer inputs of a training step in pinned host memory (plan/policy.h, OffloadLayerInputs):
// each copied out on a stream of its own once the forward has read it, and back ahead of the
// backward pass, one layer early, so that the copies run beside the compute. The pinned pool
// holds exactly one input per layer; every step of the same length reuses it (another length
// reallocates it, exactly: never rounded up).
#pragma once

#include <cuda_bf16.h>

#include <cstddef>
#include <memory>
#include <vector>

#include "backend/cuda/stream.h"

namespace spindle::cuda {

class OffloadedLayerInputs {
 public:
  OffloadedLayerInputs() = default;
  ~OffloadedLayerInputs();
  OffloadedLayerInputs(const OffloadedLayerInputs&) = delete;
  OffloadedLayerInputs& operator=(const OffloadedLayerInputs&) = delete;

  // Room for `layers` inputs of `elements` bf16 each.
  void reserve(size_t layers, size_t elements);
  // Copies layer i's input out once the work queued on `compute` so far is done.
  void send(size_t layer, const __nv_bfloat16* input, cudaStream_t compute);
  // Work queued on `compute` from now on waits for layer i's copy out (before its device buffer
  // is freed and reused).
  void wait_sent(size_t layer, cudaStream_t compute) const;
  // Copies layer i's input back into `device` once the work queued on `compute` so far is done
  // (the buffer may be memory that work still used).
  void fetch(size_t layer, __nv_bfloat16* device, cudaStream_t compute);
  // Work queued on `compute` from now on waits for layer i's copy back.
  void wait_fetched(size_t layer, cudaStream_t compute) const;
  size_t pool_bytes() const { return layers_ * elements_ * sizeof(__nv_bfloat16); }

 private:
  __nv_bfloat16* slot(size_t layer) const {
    return static_cast<__nv_bfloat16*>(pool_.get()) + layer * elements_;
  }

  Stream copies_;
  std::shared_ptr<void> pool_;  // pinned (backend/cuda/pinned_memory.h)
  size_t layers_ = 0, elements_ = 0;
  std::vector<std::unique_ptr<Event>> sent_, fetched_;
};

}  // namespace spindle::cuda
