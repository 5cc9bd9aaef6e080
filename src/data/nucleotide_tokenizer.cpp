#include "data/nucleotide_tokenizer.h"

#include <array>
#include <cstdio>

#include "core/error.h"

namespace spindle {
namespace {

constexpr int32_t kInvalid = -1;

// Byte -> token id, or kInvalid. Built at compile time so encoding is one lookup per base.
constexpr std::array<int32_t, 256> make_table() {
  std::array<int32_t, 256> table{};
  for (auto& entry : table) entry = kInvalid;
  auto set = [&](char upper, int32_t id) {
    table[static_cast<unsigned char>(upper)] = id;
    table[static_cast<unsigned char>(upper - 'A' + 'a')] = id;
  };
  set('A', kTokenA);
  set('C', kTokenC);
  set('G', kTokenG);
  set('T', kTokenT);
  set('N', kTokenN);
  for (char code : {'R', 'Y', 'K', 'M', 'S', 'W', 'B', 'D', 'H', 'V'}) set(code, kTokenN);
  return table;
}

constexpr std::array<int32_t, 256> kTable = make_table();

constexpr std::string_view kSpelling[kNucleotideVocab] = {"<pad>", "<bos>", "<eos>", "<unk>", "A",
                                                          "C",     "G",     "T",     "N"};

std::string printable(char c) {
  const auto byte = static_cast<unsigned char>(c);
  if (byte >= 0x20 && byte < 0x7f) return std::string(1, c);
  char text[8];
  std::snprintf(text, sizeof text, "\\x%02x", byte);
  return text;
}

}  // namespace

void NucleotideTokenizer::invalid(char base, int64_t position, std::string_view where) const {
  fail("invalid nucleotide '", printable(base), "' (byte ",
       static_cast<int>(static_cast<unsigned char>(base)), ") at position ", position,
       where.empty() ? "" : " of ", where,
       ": expected A, C, G, T, N or an IUPAC code (R Y K M S W B D H V), either case");
}

int32_t NucleotideTokenizer::encode(char base, int64_t position, std::string_view where) const {
  const int32_t id = kTable[static_cast<unsigned char>(base)];
  if (id != kInvalid) return id;
  if (lenient_) return kTokenUnk;
  invalid(base, position, where);
}

void NucleotideTokenizer::encode(std::string_view text, int32_t* out, int64_t first_position,
                                 std::string_view where) const {
  for (size_t k = 0; k < text.size(); ++k) {
    const int32_t id = kTable[static_cast<unsigned char>(text[k])];
    out[k] = id != kInvalid ? id : encode(text[k], first_position + static_cast<int64_t>(k), where);
  }
}

void NucleotideTokenizer::encode(std::string_view text, uint8_t* out, int64_t first_position,
                                 std::string_view where) const {
  for (size_t k = 0; k < text.size(); ++k) {
    const int32_t id = kTable[static_cast<unsigned char>(text[k])];
    out[k] = static_cast<uint8_t>(
        id != kInvalid ? id : encode(text[k], first_position + static_cast<int64_t>(k), where));
  }
}

std::vector<int32_t> NucleotideTokenizer::encode(std::string_view text) const {
  std::vector<int32_t> ids(text.size());
  encode(text, ids.data());
  return ids;
}

std::string_view NucleotideTokenizer::token_text(int32_t id) {
  check(id >= 0 && id < kNucleotideVocab, "token id ", id, " is outside the nucleotide vocabulary of ",
        kNucleotideVocab);
  return kSpelling[id];
}

std::string NucleotideTokenizer::decode(std::span<const int32_t> ids) const {
  std::string text;
  text.reserve(ids.size());
  for (size_t k = 0; k < ids.size(); ++k) {
    check(ids[k] >= 0 && ids[k] < kNucleotideVocab, "token id ", ids[k], " at index ", k,
          " is outside the nucleotide vocabulary of ", kNucleotideVocab);
    text += kSpelling[ids[k]];
  }
  return text;
}

}  // namespace spindle
