// Pretokenized data as one raw stream of little-endian uint32 token ids (`.u32`), memory-mapped.
#pragma once

#include <cstdint>
#include <string>

#include "data/mapped_file.h"
#include "data/sequence_source.h"

namespace spindle {

// One sequence named after the file. Ids are checked against `vocab_size` as they are read
// (0: only that they fit int32), so opening a large file costs nothing.
class U32Sequences : public TokenSequences {
 public:
  U32Sequences(const std::string& path, int64_t vocab_size);

  int64_t size() const override { return 1; }
  std::string name(int64_t i) const override;
  int64_t length(int64_t i) const override;
  void read(int64_t i, int64_t start, int64_t count, int32_t* out) const override;
  using TokenSequences::read;
  const std::string& source() const override { return file_.path(); }

 private:
  MappedFile file_;
  int64_t vocab_size_;
  int64_t tokens_;
};

// Writes `tokens` as a .u32 stream (atomic: temporary file, then rename).
void write_u32_tokens(const std::string& path, const std::vector<int32_t>& tokens);

}  // namespace spindle
