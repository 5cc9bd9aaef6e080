// safetensors files: memory-mapped reading (single file or sharded through
// model.safetensors.index.json) and writing (atomic: temporary file, then rename).
#pragma once

#include <map>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "core/tensor.h"

namespace spindle {

// All tensors of a checkpoint, each a read-only view into a mapped file, in the file's dtype.
class SafetensorsReader {
 public:
  // `path`: a .safetensors file, a model.safetensors.index.json, or a directory holding
  // model.safetensors or model.safetensors.index.json.
  static SafetensorsReader open(const std::string& path);

  const std::vector<std::string>& names() const { return names_; }
  bool contains(const std::string& name) const { return tensors_.count(name) != 0; }
  // Throws naming the tensor and the checkpoint when absent.
  const Tensor& get(const std::string& name) const;
  // The file that holds `name` (for error messages).
  const std::string& file_of(const std::string& name) const;
  const std::string& path() const { return path_; }
  // The "__metadata__" of the first file.
  const std::map<std::string, std::string>& metadata() const { return metadata_; }

 private:
  std::string path_;
  std::vector<std::string> names_;  // sorted
  std::map<std::string, Tensor> tensors_;
  std::map<std::string, std::string> files_;
  std::map<std::string, std::string> metadata_;
};

using NamedTensors = std::vector<std::pair<std::string, Tensor>>;

// Writes one safetensors file (tensors in the given order, their own dtypes) atomically.
void write_safetensors(const std::string& path, const NamedTensors& tensors,
                       const std::map<std::string, std::string>& metadata = {});

// Writes `dir`/model.safetensors, or, when the total exceeds `max_shard_bytes`, shards
// model-00001-of-0000N.safetensors plus model.safetensors.index.json. Each file is atomic.
void write_safetensors_checkpoint(const std::string& dir, const NamedTensors& tensors,
                                  int64_t max_shard_bytes = int64_t{5} << 30);

}  // namespace spindle
