// Gradient buffers across micro-batches: zero, scale, and add one set of gradients into another
// (the mean over N micro-batches is add_grads(total, micro, 1.0 / N) for each micro-batch).
// Gradients live in a ModelWeights allocated for the same config; parameters are matched through
// parameter_table(), so a tied lm_head (not listed) and per-expert views are handled once.
#pragma once

#include "model/config.h"
#include "model/weights.h"

namespace spindle {

// Sets every listed tensor to zero (RouterBias included: callers may use that slot as a buffer).
void zero_grads(const ModelConfig& config, ModelWeights& grads);

// dst += scale * src over every listed tensor (f32 or f64, any mix), computed in double.
void add_grads(const ModelConfig& config, ModelWeights& dst, ModelWeights& src, double scale);

// grads *= factor; with trained_only, RouterBias is left alone (what clipping wants).
void scale_grads(const ModelConfig& config, ModelWeights& grads, double factor, bool trained_only = false);

}  // namespace spindle
