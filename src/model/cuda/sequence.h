// One sequence's token ids and next-token targets on the device, as the plain and the streamed
// passes read them (a chunk reads its rows from `start` on).
#pragma once

#include <cstdint>
#include <vector>

#include "backend/cuda/device_memory.h"

namespace spindle::cuda {

struct DeviceSequence {
  explicit DeviceSequence(const std::vector<int32_t>& tokens)
      : ids(tokens.size(), MemoryCategory::Activations), targets(tokens.size(), MemoryCategory::Activations) {
    ids.upload(tokens);
    // Position i predicts tokens[i + 1]; the last position predicts nothing (-1).
    std::vector<int32_t> next(tokens.begin() + 1, tokens.end());
    next.push_back(-1);
    targets.upload(next);
  }
  DeviceBuffer<int32_t> ids, targets;
};

}  // namespace spindle::cuda
