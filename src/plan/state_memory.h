// The model's state on one GPU, as the CUDA backend allocates it: weights in one arena (bf16
// matrices, fp32 small parameters: model/cuda/device_weights.cpp), fp32 gradients in a second
// arena of the same layout, and per trained parameter fp32 AdamW m and v plus an fp32 master
// for each bf16 weight (backend/cuda/cuda_device_model.cpp, init_optimizer). Counted from the
// parameter table of the config, this GPU's share only (plan/parallel.h).
#pragma once

#include <cstdint>

#include "model/config.h"
#include "plan/parallel.h"

namespace spindle::plan {

struct StateBytes {
  int64_t weights = 0;                  // device: the weights arena
  int64_t gradients = 0;                // device: the fp32 gradient arena
  int64_t optimizer = 0;                // device: masters, m, v (each its own allocation)
  int64_t parameters = 0;               // values on this GPU (trained or not)
  int64_t largest_layer_gradients = 0;  // fp32 bytes of the largest layer's gradients
  // Host: the optimizer when it lives there (pinned copies of the weight and gradient arenas,
  // masters, m, v: backend/cuda/host_optimizer.h), or with the gradients sent out layer by layer
  // (masters, m, v and an fp32 gradient accumulator: predicted only), and the process's fp32 copy
  // of the weights it loaded.
  int64_t host_optimizer = 0;
  int64_t host_optimizer_with_gradients = 0;
  int64_t host_weights = 0;
};

StateBytes state_bytes(const ModelConfig& c, const Parallel& p);

}  // namespace spindle::plan
