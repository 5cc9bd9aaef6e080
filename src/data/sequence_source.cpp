#include "data/sequence_source.h"

#include <cctype>
#include <filesystem>

#include "core/error.h"
#include "data/fasta_sequences.h"
#include "data/megatron_dataset.h"
#include "data/u32_sequences.h"

namespace spindle {
namespace {

bool ends_with(const std::string& text, const std::string& suffix) {
  return text.size() >= suffix.size() &&
         text.compare(text.size() - suffix.size(), suffix.size(), suffix) == 0;
}

}  // namespace

int64_t TokenSequences::total_length() const {
  int64_t total = 0;
  for (int64_t i = 0; i < size(); ++i) total += length(i);
  return total;
}

std::vector<int32_t> TokenSequences::read(int64_t i, int64_t start, int64_t count) const {
  check(count >= 0, source(), ": negative read length ", count);
  std::vector<int32_t> out(static_cast<size_t>(count));
  read(i, start, count, out.data());
  return out;
}

void TokenSequences::check_range(int64_t i, int64_t start, int64_t count) const {
  check_index(i);
  const int64_t n = length(i);
  // Not check(): its arguments, name(i) included, would be evaluated on every read.
  if (start < 0 || count < 0 || start > n || count > n - start) {
    fail(source(), ": tokens [", start, ", ", start + count, ") are outside sequence '", name(i),
         "' of length ", n);
  }
}

void TokenSequences::check_index(int64_t i) const {
  if (i < 0 || i >= size())
    fail(source(), ": sequence index ", i, " is out of range (", size(), " sequences)");
}

std::optional<std::string> sequence_format_of(const std::string& path) {
  std::string lower = path;
  for (char& c : lower) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  for (const char* compressed : {".gz", ".bgz", ".bgzf"}) {
    if (ends_with(lower, compressed)) lower.resize(lower.size() - std::string(compressed).size());
  }
  for (const char* fasta : {".fa", ".fasta", ".fna", ".fas"}) {
    if (ends_with(lower, fasta)) return "fasta";
  }
  if (ends_with(lower, ".u32")) return "u32";
  if (ends_with(lower, ".bin") || ends_with(lower, ".idx")) return "megatron";
  if (std::filesystem::exists(path + ".idx")) return "megatron";  // a Megatron path prefix
  return std::nullopt;
}

std::string detect_sequence_format(const std::string& path) {
  if (const auto format = sequence_format_of(path)) return *format;
  fail("cannot tell the format of '", path,
       "' from its name: expected .fa/.fasta/.fna (optionally .gz), .u32, or a Megatron .bin/.idx; "
       "or give the format (fasta, u32, megatron)");
}

std::unique_ptr<TokenSequences> open_sequences(const std::string& path, const SequenceOptions& options) {
  const std::string format = options.format == "auto" ? detect_sequence_format(path) : options.format;
  if (format == "fasta") {
    FastaOptions fasta;
    fasta.names = options.names;
    fasta.lenient = options.lenient;
    return std::make_unique<FastaSequences>(path, fasta);
  }
  check(options.names.empty(), "sequence names can only be selected in FASTA files, but '", path, "' is ",
        format);
  if (format == "u32") return std::make_unique<U32Sequences>(path, options.vocab_size);
  if (format == "megatron") return std::make_unique<MegatronDataset>(path, options.vocab_size);
  fail("unknown data format '", options.format, "' for '", path, "': expected auto, fasta, u32 or megatron");
}

}  // namespace spindle
