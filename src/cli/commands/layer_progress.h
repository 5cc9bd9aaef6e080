// Progress of a CPU forward pass over a long sequence (minutes of work): a line per finished
// layer, for the commands that run one (logprobs, route, select).
#pragma once

#include <cstdint>
#include <functional>

#include "core/log.h"
#include "model/config.h"

namespace spindle {

// A ForwardOptions::on_layer that logs each finished layer from 16384 tokens on; none below.
inline std::function<void(int64_t)> layer_progress(const ModelConfig& c, size_t tokens) {
  if (tokens < 16384) return {};
  return
      [layers = c.num_hidden_layers](int64_t layer) { log_info("layer ", layer + 1, "/", layers, " done"); };
}

}  // namespace spindle
