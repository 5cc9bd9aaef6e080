// The tokens of one sequence for a run that reads a single window (bench, select, route): a token
// text file's first tokens, or an N-free window of a sequence file (FASTA, .u32, Megatron
// .bin/.idx) drawn with a fixed seed, the same window every run.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "data/sequence_source.h"

namespace spindle {

class TokenSource {
 public:
  explicit TokenSource(const std::string& path);

  // A token text file (its tokens are read whole), else a sequence file.
  bool is_text() const { return sequences_ == nullptr; }
  // The token text file's tokens (0 for a sequence file).
  int64_t text_size() const { return static_cast<int64_t>(text_.size()); }
  // `length` tokens: the text's first, or the sequence file's window. A text too short fails with
  // a message that names the file and `option`, the command line's name for the length.
  std::vector<int32_t> window(int64_t length, const std::string& option) const;

 private:
  std::string path_;
  std::vector<int32_t> text_;
  std::unique_ptr<TokenSequences> sequences_;
};

}  // namespace spindle
