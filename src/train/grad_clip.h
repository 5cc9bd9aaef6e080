// Gradient clipping by global L2 norm, as PyTorch's torch.nn.utils.clip_grad_norm_.
#pragma once

#include "model/config.h"
#include "model/weights.h"

namespace spindle {

// The L2 norm over every trained gradient (RouterBias skipped), accumulated in double in a
// fixed order, so it is the same on every run.
double global_grad_norm(const ModelConfig& config, ModelWeights& grads);

// Scales the trained gradients by min(1, max_norm / (norm + 1e-6)) and returns the norm before
// clipping. max_norm = 0 disables clipping (the norm is still returned). A non-finite norm leaves
// the gradients untouched: the caller sees it and skips the step.
double clip_grad_norm(const ModelConfig& config, ModelWeights& grads, double max_norm);

}  // namespace spindle
