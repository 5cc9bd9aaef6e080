// Loading and saving GLM-5.3-Flash checkpoints in Hugging Face form (config.json + safetensors).
// Reads both the on-disk names transformers writes and its in-memory names; writes the on-disk
// form, so that transformers loads what Spindle saves.
#pragma once

#include <string>

#include "model/config.h"
#include "model/weights.h"

namespace spindle {

struct Model {
  ModelConfig config;
  ModelWeights weights;
};

// Loads `dir` (config.json + safetensors) converting every weight to `dtype`. Missing or
// mis-shaped tensors are errors naming the tensor and the expected shape.
Model load_model(const std::string& dir, DType dtype);

// Loads only the weights of `dir` into `weights` (already allocated for `config`).
void load_weights(const std::string& dir, const ModelConfig& config, ModelWeights& weights);

// Writes config.json and the weights (converted to `dtype`) into `dir`, creating it.
void save_model(const std::string& dir, const ModelConfig& config, ModelWeights& weights, DType dtype);

// Checks that Spindle can run `config` and says why not (features transformers has that Spindle
// does not implement).
void check_supported(const ModelConfig& config);

}  // namespace spindle
