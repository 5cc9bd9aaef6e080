// Runs a model over held-out windows and accumulates its next-token loss per position bucket.
#pragma once

#include <cstdint>
#include <functional>
#include <vector>

#include "backend/device_model.h"
#include "eval/bucket_loss.h"
#include "model/checkpoint.h"

namespace spindle {

struct WindowProgress {
  int64_t index = 0;     // 0-based window just finished
  int64_t count = 0;     // windows in all
  int64_t tokens = 0;    // tokens in this window
  double seconds = 0.0;  // this window's forward pass
  int64_t total_tokens = 0;
  double total_seconds = 0.0;
  double running_loss = 0.0;  // mean nats per token over the windows so far
};

struct BucketEvalOptions {
  int64_t bucket_size = 0;
  // Called after each window; long windows also report each layer (window, layer), 0-based.
  std::function<void(const WindowProgress&)> on_window;
  std::function<void(int64_t window, int64_t layer)> on_layer;
  // When set, the forward passes run on this device model (T must be float) instead of the CPU.
  DeviceModel* device = nullptr;
};

// Evaluates windows 0 .. count-1, fetched one at a time from `window` so that only one long
// window is held in memory. T (float or double) must match the dtype the model was loaded in.
template <class T>
BucketLoss evaluate_bucket_loss(const Model& model, int64_t count,
                                const std::function<std::vector<int32_t>(int64_t)>& window,
                                const BucketEvalOptions& options);

}  // namespace spindle
