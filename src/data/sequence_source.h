// Token sequences with random access: the common face of FASTA files, raw token streams and
// Megatron indexed datasets, so that samplers never care where the tokens come from.
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

namespace spindle {

class TokenSequences {
 public:
  virtual ~TokenSequences() = default;

  // Number of sequences (chromosomes, documents).
  virtual int64_t size() const = 0;
  virtual std::string name(int64_t i) const = 0;
  // Length of sequence i in tokens.
  virtual int64_t length(int64_t i) const = 0;
  // Writes tokens [start, start + count) of sequence i to `out`. Thread-safe. A range outside the
  // sequence, or a token the source cannot represent, is an error naming the source and position.
  virtual void read(int64_t i, int64_t start, int64_t count, int32_t* out) const = 0;
  // The file the tokens come from, for messages.
  virtual const std::string& source() const = 0;

  int64_t total_length() const;
  std::vector<int32_t> read(int64_t i, int64_t start, int64_t count) const;

 protected:
  // Fails unless 0 <= i < size() and [start, start + count) lies inside sequence i.
  void check_range(int64_t i, int64_t start, int64_t count) const;
  // Fails unless 0 <= i < size().
  void check_index(int64_t i) const;
};

struct SequenceOptions {
  // "auto" (by file name: .fa/.fasta/.fna[.gz|.bgz], .u32, .bin/.idx), "fasta", "u32" or "megatron".
  std::string format = "auto";
  // FASTA: the sequences to keep, in this order (all, in file order, when empty).
  std::vector<std::string> names;
  // FASTA: characters that are not bases become <unk> instead of an error.
  bool lenient = false;
  // u32 and Megatron: every id must be below this (the model's vocabulary size); 0 checks only
  // that ids fit int32.
  int64_t vocab_size = 0;
};

std::unique_ptr<TokenSequences> open_sequences(const std::string& path, const SequenceOptions& options = {});

// The format "auto" picks for `path` ("fasta", "u32", "megatron"), or none for an unknown name.
std::optional<std::string> sequence_format_of(const std::string& path);
// The same; an unknown name is an error.
std::string detect_sequence_format(const std::string& path);

}  // namespace spindle
