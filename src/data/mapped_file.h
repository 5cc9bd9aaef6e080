// A whole file mapped read-only into memory (token streams, Megatron .bin/.idx).
#pragma once

#include <cstddef>
#include <string>

namespace spindle {

class MappedFile {
 public:
  // `what` describes the file in messages ("token file", "Megatron index").
  MappedFile(const std::string& path, const std::string& what);
  ~MappedFile();
  MappedFile(const MappedFile&) = delete;
  MappedFile& operator=(const MappedFile&) = delete;

  const unsigned char* data() const { return data_; }
  size_t size() const { return size_; }
  const std::string& path() const { return path_; }

 private:
  std::string path_;
  const unsigned char* data_ = nullptr;
  size_t size_ = 0;
};

}  // namespace spindle
