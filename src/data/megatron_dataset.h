// Megatron-LM indexed datasets (MMapIndexedDataset, `prefix.bin` + `prefix.idx`): reader and
// writer. Layout of the .idx (little-endian), as in megatron/core/datasets/indexed_dataset.py:
//   9 bytes "MMIDIDX\0\0", u64 version = 1, u8 dtype code, u64 sequence count S,
//   u64 document-index count D, int32 lengths[S], int64 byte offsets into .bin[S],
//   int64 document index[D] (0, then the sequence count after each document; last == S).
// The .bin holds the tokens of every sequence back to back in the dtype.
#pragma once

#include <cstdint>
#include <fstream>
#include <span>
#include <string>
#include <vector>

#include "data/mapped_file.h"
#include "data/sequence_source.h"

namespace spindle {

// Megatron's DType codes.
enum class MegatronDType : uint8_t {
  U8 = 1,
  I8 = 2,
  I16 = 3,
  I32 = 4,
  I64 = 5,
  F64 = 6,
  F32 = 7,
  U16 = 8,
};

const char* megatron_dtype_name(MegatronDType dtype);
// Bytes per element; an unknown code is an error.
int megatron_dtype_size(MegatronDType dtype);

// "data/x", "data/x.bin" and "data/x.idx" all name the dataset with prefix "data/x".
std::string megatron_prefix(const std::string& path);

// Each Megatron sequence is one token sequence, named "sequence I". Token ids are checked
// against `vocab_size` as they are read (0: only that they fit int32).
class MegatronDataset : public TokenSequences {
 public:
  MegatronDataset(const std::string& path, int64_t vocab_size);

  int64_t size() const override { return static_cast<int64_t>(lengths_.size()); }
  std::string name(int64_t i) const override;
  int64_t length(int64_t i) const override;
  void read(int64_t i, int64_t start, int64_t count, int32_t* out) const override;
  using TokenSequences::read;
  const std::string& source() const override { return bin_.path(); }

  MegatronDType dtype() const { return dtype_; }
  const std::vector<int64_t>& document_index() const { return document_index_; }

 private:
  MappedFile idx_;
  MappedFile bin_;
  int64_t vocab_size_;
  MegatronDType dtype_;
  std::vector<int32_t> lengths_;
  std::vector<int64_t> offsets_;
  std::vector<int64_t> document_index_;
};

// Streams sequences into `prefix.bin` and writes `prefix.idx` on finish(); both appear atomically
// (temporary files renamed at the end). Without finish() nothing is left behind.
class MegatronWriter {
 public:
  MegatronWriter(const std::string& prefix, MegatronDType dtype);
  ~MegatronWriter();
  MegatronWriter(const MegatronWriter&) = delete;
  MegatronWriter& operator=(const MegatronWriter&) = delete;

  // Appends one sequence; every id must fit the dtype.
  void add_sequence(std::span<const int32_t> tokens);
  // Closes the current document (the sequences added since the last call).
  void end_document();
  // Ends an open document, writes the index and renames both files into place.
  void finish();

 private:
  std::string prefix_;
  MegatronDType dtype_;
  std::ofstream bin_;
  std::vector<int32_t> lengths_;
  std::vector<int64_t> document_index_{0};
  bool finished_ = false;
};

// Writes each of `sequences` as one sequence and one document.
void write_megatron(const std::string& prefix, const std::vector<std::vector<int32_t>>& sequences,
                    MegatronDType dtype);

}  // namespace spindle
