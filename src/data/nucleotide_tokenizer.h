// Nucleotide tokenizer: one token per base over a fixed 9-entry vocabulary, special tokens first.
#pragma once

#include <cstdint>
#include <span>
#include <string>
#include <string_view>
#include <vector>

namespace spindle {

constexpr int kNucleotideVocab = 9;

// Token ids. Other IUPAC ambiguity codes (R Y K M S W B D H V) map to N; lower case folds to upper.
enum NucleotideToken : int32_t {
  kTokenPad = 0,
  kTokenBos = 1,
  kTokenEos = 2,
  kTokenUnk = 3,
  kTokenA = 4,
  kTokenC = 5,
  kTokenG = 6,
  kTokenT = 7,
  kTokenN = 8,
};

class NucleotideTokenizer {
 public:
  // `lenient`: characters that are not bases become <unk> instead of an error.
  explicit NucleotideTokenizer(bool lenient = false) : lenient_(lenient) {}

  bool lenient() const { return lenient_; }

  // One base; `position` and `where` (e.g. "file.fa, sequence 'chr1'") only name it in errors.
  int32_t encode(char base, int64_t position = 0, std::string_view where = {}) const;

  // `text[k]` is at `first_position + k` in `where`. Writes text.size() ids to `out`.
  void encode(std::string_view text, int32_t* out, int64_t first_position = 0,
              std::string_view where = {}) const;
  // The same, into one byte per token (compact in-memory storage).
  void encode(std::string_view text, uint8_t* out, int64_t first_position = 0,
              std::string_view where = {}) const;
  std::vector<int32_t> encode(std::string_view text) const;

  // Bases as letters; special tokens as "<pad>", "<bos>", "<eos>", "<unk>". Ids outside the
  // vocabulary are an error naming the id and its index.
  std::string decode(std::span<const int32_t> ids) const;

  // The spelling of one token ("A", "<bos>", ...).
  static std::string_view token_text(int32_t id);

 private:
  [[noreturn]] void invalid(char base, int64_t position, std::string_view where) const;
  bool lenient_;
};

}  // namespace spindle
