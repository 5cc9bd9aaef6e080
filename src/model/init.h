// Random initial weights following transformers' Glm5NextPreTrainedModel._init_weights.
#pragma once

#include <cstdint>

#include "model/config.h"
#include "model/weights.h"

namespace spindle {

void init_weights(const ModelConfig& config, ModelWeights& weights, uint64_t seed);

}  // namespace spindle
