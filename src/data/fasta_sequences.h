// FASTA files (plain, gzip or bgzip) as nucleotide token sequences, read through htslib.
// Random access goes through a faidx index (.fai, plus .gzi for bgzip), which htslib builds when
// missing. Where that is impossible (plain gzip cannot be read at random; a read-only directory;
// lines of unequal length) the selected sequences are read into memory once, one byte per base,
// and a log line says so.
#pragma once

#include <cstdint>
#include <mutex>
#include <string>
#include <vector>

#include "data/nucleotide_tokenizer.h"
#include "data/sequence_source.h"

struct faidx_t;

namespace spindle {

struct FastaOptions {
  // Sequences to keep, in this order (all, in file order, when empty). An unknown name is an
  // error listing the names in the file.
  std::vector<std::string> names;
  // Characters that are not bases become <unk> instead of an error.
  bool lenient = false;
};

class FastaSequences : public TokenSequences {
 public:
  FastaSequences(const std::string& path, const FastaOptions& options = {});
  ~FastaSequences() override;
  FastaSequences(const FastaSequences&) = delete;
  FastaSequences& operator=(const FastaSequences&) = delete;

  int64_t size() const override { return static_cast<int64_t>(names_.size()); }
  std::string name(int64_t i) const override;
  int64_t length(int64_t i) const override;
  void read(int64_t i, int64_t start, int64_t count, int32_t* out) const override;
  using TokenSequences::read;
  const std::string& source() const override { return path_; }

  // True when the sequences were read into memory instead of being read through an index.
  bool in_memory() const { return fai_ == nullptr; }

 private:
  void load_into_memory(const FastaOptions& options);

  std::string path_;
  NucleotideTokenizer tokenizer_;
  faidx_t* fai_ = nullptr;
  std::vector<std::string> names_;
  std::vector<int64_t> lengths_;
  std::vector<std::vector<uint8_t>> tokens_;  // in memory only
  mutable std::mutex mutex_;                  // faidx handles are not thread-safe
};

}  // namespace spindle
