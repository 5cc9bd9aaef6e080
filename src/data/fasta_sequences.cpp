#include "data/fasta_sequences.h"

#include <htslib/bgzf.h>
#include <htslib/faidx.h>
#include <htslib/hts_log.h>
#include <htslib/kstring.h>

#include <algorithm>
#include <cctype>
#include <cstdlib>
#include <filesystem>
#include <map>
#include <memory>
#include <set>
#include <sstream>

#include "core/error.h"
#include "core/log.h"

namespace spindle {
namespace {

namespace fs = std::filesystem;

// htslib's compression codes (enum htsCompression).
constexpr int kNoCompression = 0;
constexpr int kGzip = 1;
constexpr int kBgzf = 2;

std::string list_names(const std::vector<std::string>& names) {
  std::ostringstream out;
  const size_t shown = std::min<size_t>(names.size(), 40);
  for (size_t k = 0; k < shown; ++k) out << (k ? ", " : "") << names[k];
  if (shown < names.size()) out << ", ... (" << names.size() - shown << " more)";
  return out.str();
}

// Indices into `available` of the selected names, in selection order (all when none selected).
std::vector<size_t> select(const std::vector<std::string>& available, const std::vector<std::string>& wanted,
                           const std::string& path) {
  std::vector<size_t> chosen;
  if (wanted.empty()) {
    for (size_t k = 0; k < available.size(); ++k) chosen.push_back(k);
    return chosen;
  }
  std::map<std::string, size_t> position;
  for (size_t k = 0; k < available.size(); ++k) position.emplace(available[k], k);
  std::set<std::string> seen;
  for (const auto& name : wanted) {
    check(seen.insert(name).second, "sequence '", name, "' is selected twice from ", path);
    auto it = position.find(name);
    check(it != position.end(), "no sequence named '", name, "' in ", path, "; it has ", available.size(),
          " sequence(s): ", list_names(available));
    chosen.push_back(it->second);
  }
  return chosen;
}

int compression_of(const std::string& path) {
  BGZF* fp = bgzf_open(path.c_str(), "r");
  check(fp != nullptr, "cannot open FASTA file ", path);
  const int compression = bgzf_compression(fp);
  bgzf_close(fp);
  return compression;
}

// htslib prints its own errors; our message says what failed and what happens next instead.
faidx_t* load_index_quietly(const std::string& path) {
  const htsLogLevel level = hts_get_log_level();
  hts_set_log_level(HTS_LOG_OFF);
  faidx_t* fai = fai_load3(path.c_str(), nullptr, nullptr, FAI_CREATE);
  // fai_load3 builds nothing when the .fai exists but the .gzi does not (as Debian's vt-examples
  // ships it); building both anew fixes that.
  if (fai == nullptr && fai_build3(path.c_str(), nullptr, nullptr) == 0) {
    fai = fai_load3(path.c_str(), nullptr, nullptr, 0);
  }
  hts_set_log_level(level);
  return fai;
}

}  // namespace

FastaSequences::FastaSequences(const std::string& path, const FastaOptions& options)
    : path_(path), tokenizer_(options.lenient) {
  std::error_code error;
  check(fs::exists(path, error), "FASTA file not found: ", path);
  check(fs::is_regular_file(path, error), "FASTA path ", path, " is not a regular file");
  const int compression = compression_of(path);

  if (compression == kGzip) {
    log_info(path, " is gzip-compressed, which cannot be read at random (bgzip can); reading the ",
             options.names.empty() ? "sequences" : "selected sequences", " into memory once");
    load_into_memory(options);
    return;
  }
  check(compression == kNoCompression || compression == kBgzf, "FASTA file ", path,
        " uses an unsupported compression (htslib code ", compression, ")");

  const bool had_index = fs::exists(path + ".fai") && (compression != kBgzf || fs::exists(path + ".gzi"));
  fai_ = load_index_quietly(path);
  if (fai_ == nullptr) {
    log_warn("cannot load or build the faidx index ", path, ".fai", compression == kBgzf ? " (and .gzi)" : "",
             " (read-only directory, or lines of unequal length?); reading the ",
             options.names.empty() ? "sequences" : "selected sequences", " into memory once instead");
    load_into_memory(options);
    return;
  }
  if (!had_index)
    log_info("indexed ", path, " (wrote ", path, ".fai", compression == kBgzf ? " and .gzi" : "", ")");

  std::vector<std::string> all;
  for (int k = 0; k < faidx_nseq(fai_); ++k) all.emplace_back(faidx_iseq(fai_, k));
  for (size_t k : select(all, options.names, path)) {
    const int n = faidx_seq_len(fai_, all[k].c_str());  // int in htslib 1.16: sequences < 2^31 bases
    check(n >= 0, "faidx index of ", path, " has no length for sequence '", all[k], "'");
    names_.push_back(all[k]);
    lengths_.push_back(n);
  }
  check(!names_.empty(), "FASTA file ", path, " holds no sequences");
}

FastaSequences::~FastaSequences() {
  if (fai_ != nullptr) fai_destroy(fai_);
}

void FastaSequences::load_into_memory(const FastaOptions& options) {
  BGZF* fp = bgzf_open(path_.c_str(), "r");  // plain, gzip and bgzip alike
  check(fp != nullptr, "cannot open FASTA file ", path_);
  std::unique_ptr<BGZF, int (*)(BGZF*)> closer(fp, bgzf_close);
  struct Line {  // frees htslib's line buffer however the loop ends
    kstring_t text = KS_INITIALIZE;
    ~Line() { ks_free(&text); }
  } buffer;
  kstring_t& line = buffer.text;

  const std::set<std::string> wanted(options.names.begin(), options.names.end());
  std::vector<std::string> all;  // every name in the file, for the selection and its errors
  std::set<std::string> seen;
  std::vector<std::string> kept_names;
  std::vector<std::vector<uint8_t>> kept;
  std::vector<uint8_t>* current = nullptr;
  bool in_record = false;
  int64_t line_number = 0;

  int status = 0;
  while ((status = bgzf_getline(fp, '\n', &line)) >= 0) {
    ++line_number;
    std::string_view text(line.s, line.l);
    while (!text.empty() && std::isspace(static_cast<unsigned char>(text.back()))) text.remove_suffix(1);
    if (text.empty()) continue;
    if (text.front() == '>') {
      const std::string_view header = text.substr(1);
      const std::string name(header.substr(0, header.find_first_of(" \t")));
      check(!name.empty(), path_, " line ", line_number, ": a '>' header without a sequence name");
      check(seen.insert(name).second, path_, " line ", line_number, ": sequence name '", name,
            "' appears twice");
      all.push_back(name);
      in_record = true;
      current = nullptr;
      if (wanted.empty() || wanted.count(name)) {
        kept_names.push_back(name);
        kept.emplace_back();
        current = &kept.back();
      }
      continue;
    }
    check(in_record, path_, " line ", line_number, ": sequence data before the first '>' header");
    if (current == nullptr) continue;  // a sequence that was not selected
    const size_t at = current->size();
    current->resize(at + text.size());
    try {
      tokenizer_.encode(text, current->data() + at, static_cast<int64_t>(at));
    } catch (const Error& e) {
      fail(path_, " line ", line_number, ", sequence '", kept_names.back(), "': ", e.what());
    }
  }
  check(status == -1, "failed reading FASTA file ", path_, " after line ", line_number,
        " (truncated or corrupt compressed data?)");

  std::map<std::string, size_t> index;
  for (size_t k = 0; k < kept_names.size(); ++k) index.emplace(kept_names[k], k);
  for (size_t k : select(all, options.names, path_)) {
    const size_t from = index.at(all[k]);
    kept[from].shrink_to_fit();
    names_.push_back(all[k]);
    lengths_.push_back(static_cast<int64_t>(kept[from].size()));
    tokens_.push_back(std::move(kept[from]));
  }
  check(!names_.empty(), "FASTA file ", path_, " holds no sequences");
  int64_t bases = 0;
  for (int64_t n : lengths_) bases += n;
  log_info("read ", names_.size(), " sequence(s), ", bases, " bases, of ", path_, " into memory");
}

std::string FastaSequences::name(int64_t i) const {
  check_index(i);
  return names_[static_cast<size_t>(i)];
}

int64_t FastaSequences::length(int64_t i) const {
  check_index(i);
  return lengths_[static_cast<size_t>(i)];
}

void FastaSequences::read(int64_t i, int64_t start, int64_t count, int32_t* out) const {
  check_range(i, start, count);
  if (count == 0) return;
  const auto s = static_cast<size_t>(i);
  if (fai_ == nullptr) {
    const uint8_t* from = tokens_[s].data() + start;
    std::copy(from, from + count, out);
    return;
  }
  hts_pos_t got = 0;
  char* bases = nullptr;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    bases = faidx_fetch_seq64(fai_, names_[s].c_str(), start, start + count - 1, &got);
  }
  std::unique_ptr<char, void (*)(void*)> owner(bases, std::free);
  check(bases != nullptr && got == count, "failed reading bases [", start, ", ", start + count,
        ") of sequence '", names_[s], "' from ", path_, " through its faidx index (got ", got,
        "; is the .fai stale?)");
  tokenizer_.encode(std::string_view(bases, static_cast<size_t>(count)), out, start,
                    path_ + ", sequence '" + names_[s] + "'");
}

}  // namespace spindle
