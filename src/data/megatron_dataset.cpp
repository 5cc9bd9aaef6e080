#include "data/megatron_dataset.h"

#include <cstring>
#include <filesystem>
#include <limits>

#include "core/error.h"

namespace spindle {
namespace {

constexpr unsigned char kMagic[9] = {'M', 'M', 'I', 'D', 'I', 'D', 'X', 0, 0};
constexpr size_t kHeaderBytes = 9 + 8 + 1 + 8 + 8;

uint64_t load_le(const unsigned char* p, int bytes) {
  uint64_t v = 0;
  for (int b = bytes - 1; b >= 0; --b) v = (v << 8) | p[b];
  return v;
}

void store_le(unsigned char* p, uint64_t v, int bytes) {
  for (int b = 0; b < bytes; ++b) p[b] = static_cast<unsigned char>(v >> (8 * b));
}

bool known_dtype(uint8_t code) { return code >= 1 && code <= 8; }

bool is_float(MegatronDType dtype) { return dtype == MegatronDType::F32 || dtype == MegatronDType::F64; }

// The integer range a dtype holds.
void dtype_range(MegatronDType dtype, int64_t& low, int64_t& high) {
  switch (dtype) {
    case MegatronDType::U8:
      low = 0, high = 255;
      return;
    case MegatronDType::I8:
      low = -128, high = 127;
      return;
    case MegatronDType::I16:
      low = -32768, high = 32767;
      return;
    case MegatronDType::U16:
      low = 0, high = 65535;
      return;
    case MegatronDType::I32:
    case MegatronDType::I64:
      low = std::numeric_limits<int32_t>::min(), high = std::numeric_limits<int32_t>::max();
      return;
    default:
      fail("Megatron dtype ", megatron_dtype_name(dtype), " cannot hold token ids");
  }
}

// One element of `dtype` at `p`, sign-extended.
int64_t load_element(const unsigned char* p, MegatronDType dtype) {
  switch (dtype) {
    case MegatronDType::U8:
      return p[0];
    case MegatronDType::I8:
      return static_cast<int8_t>(p[0]);
    case MegatronDType::I16:
      return static_cast<int16_t>(load_le(p, 2));
    case MegatronDType::U16:
      return static_cast<int64_t>(load_le(p, 2));
    case MegatronDType::I32:
      return static_cast<int32_t>(load_le(p, 4));
    case MegatronDType::I64:
      return static_cast<int64_t>(load_le(p, 8));
    default:
      fail("Megatron dtype ", megatron_dtype_name(dtype), " cannot hold token ids");
  }
}

}  // namespace

const char* megatron_dtype_name(MegatronDType dtype) {
  switch (dtype) {
    case MegatronDType::U8:
      return "uint8";
    case MegatronDType::I8:
      return "int8";
    case MegatronDType::I16:
      return "int16";
    case MegatronDType::I32:
      return "int32";
    case MegatronDType::I64:
      return "int64";
    case MegatronDType::F64:
      return "float64";
    case MegatronDType::F32:
      return "float32";
    case MegatronDType::U16:
      return "uint16";
  }
  return "unknown";
}

int megatron_dtype_size(MegatronDType dtype) {
  switch (dtype) {
    case MegatronDType::U8:
    case MegatronDType::I8:
      return 1;
    case MegatronDType::I16:
    case MegatronDType::U16:
      return 2;
    case MegatronDType::I32:
    case MegatronDType::F32:
      return 4;
    case MegatronDType::I64:
    case MegatronDType::F64:
      return 8;
  }
  fail("unknown Megatron dtype code ", static_cast<int>(dtype), " (expected 1-8)");
}

std::string megatron_prefix(const std::string& path) {
  for (const char* ext : {".bin", ".idx"}) {
    const size_t n = std::strlen(ext);
    if (path.size() > n && path.compare(path.size() - n, n, ext) == 0) return path.substr(0, path.size() - n);
  }
  return path;
}

MegatronDataset::MegatronDataset(const std::string& path, int64_t vocab_size)
    : idx_(megatron_prefix(path) + ".idx", "Megatron index"),
      bin_(megatron_prefix(path) + ".bin", "Megatron data file"),
      vocab_size_(vocab_size) {
  check(vocab_size >= 0, "vocabulary size must be >= 0, got ", vocab_size);
  const std::string& where = idx_.path();
  const unsigned char* p = idx_.data();
  check(idx_.size() >= kHeaderBytes, "Megatron index ", where, " is ", idx_.size(),
        " bytes, shorter than its ", kHeaderBytes, "-byte header");
  check(std::memcmp(p, kMagic, sizeof kMagic) == 0, "Megatron index ", where,
        " does not start with MMIDIDX\\0\\0: not an MMapIndexedDataset index");
  const uint64_t version = load_le(p + 9, 8);
  check(version == 1, "Megatron index ", where, ": version ", version, ", expected 1");
  const uint8_t code = p[17];
  check(known_dtype(code), "Megatron index ", where, ": unknown dtype code ", static_cast<int>(code),
        " (expected 1-8)");
  dtype_ = static_cast<MegatronDType>(code);
  check(!is_float(dtype_), "Megatron index ", where, ": dtype ", megatron_dtype_name(dtype_),
        " holds no token ids (expected an integer dtype)");
  const uint64_t sequences = load_le(p + 18, 8);
  const uint64_t documents = load_le(p + 26, 8);
  // Compare in sizes that cannot overflow before trusting the counts.
  const uint64_t room = idx_.size() - kHeaderBytes;
  check(sequences <= room / 12 && documents <= (room - 12 * sequences) / 8, "Megatron index ", where, " is ",
        idx_.size(), " bytes, too short for ", sequences, " sequences and ", documents,
        " document entries: truncated?");

  const int item = megatron_dtype_size(dtype_);
  const unsigned char* q = p + kHeaderBytes;
  lengths_.resize(sequences);
  offsets_.resize(sequences);
  document_index_.resize(documents);
  for (uint64_t s = 0; s < sequences; ++s) lengths_[s] = static_cast<int32_t>(load_le(q + 4 * s, 4));
  q += 4 * sequences;
  for (uint64_t s = 0; s < sequences; ++s) offsets_[s] = static_cast<int64_t>(load_le(q + 8 * s, 8));
  q += 8 * sequences;
  for (uint64_t d = 0; d < documents; ++d) document_index_[d] = static_cast<int64_t>(load_le(q + 8 * d, 8));

  const auto bin_bytes = static_cast<int64_t>(bin_.size());
  for (uint64_t s = 0; s < sequences; ++s) {
    check(lengths_[s] >= 0 && offsets_[s] >= 0 && offsets_[s] % item == 0 && offsets_[s] <= bin_bytes &&
              lengths_[s] <= (bin_bytes - offsets_[s]) / item,
          "Megatron index ", where, ": sequence ", s, " (", lengths_[s], " tokens at byte ", offsets_[s],
          ") lies outside ", bin_.path(), " (", bin_bytes, " bytes of ", megatron_dtype_name(dtype_), ")");
  }
  check(!document_index_.empty() && document_index_.front() == 0 &&
            document_index_.back() == static_cast<int64_t>(sequences),
        "Megatron index ", where, ": the document index must run from 0 to the sequence count ", sequences);
  check(sequences > 0, "Megatron dataset ", where, " holds no sequences");
}

std::string MegatronDataset::name(int64_t i) const {
  check_index(i);
  return "sequence " + std::to_string(i);
}

int64_t MegatronDataset::length(int64_t i) const {
  check_index(i);
  return lengths_[static_cast<size_t>(i)];
}

void MegatronDataset::read(int64_t i, int64_t start, int64_t count, int32_t* out) const {
  check_range(i, start, count);
  const int item = megatron_dtype_size(dtype_);
  const int64_t limit = vocab_size_ > 0 ? vocab_size_ : int64_t{std::numeric_limits<int32_t>::max()} + 1;
  const unsigned char* p = bin_.data() + offsets_[static_cast<size_t>(i)] + item * start;
  for (int64_t k = 0; k < count; ++k, p += item) {
    const int64_t id = load_element(p, dtype_);
    if (id < 0 || id >= limit) {
      fail("Megatron dataset ", source(), ": token id ", id, " at position ", start + k, " of sequence ", i,
           " is outside the vocabulary of ", limit);
    }
    out[k] = static_cast<int32_t>(id);
  }
}

MegatronWriter::MegatronWriter(const std::string& prefix, MegatronDType dtype)
    : prefix_(megatron_prefix(prefix)), dtype_(dtype) {
  int64_t low = 0, high = 0;
  dtype_range(dtype, low, high);  // rejects float dtypes
  bin_.open(prefix_ + ".bin.tmp.megatron", std::ios::binary | std::ios::trunc);
  check(bin_.good(), "cannot write Megatron data file ", prefix_, ".bin.tmp.megatron");
}

MegatronWriter::~MegatronWriter() {
  if (!finished_) {
    bin_.close();
    std::error_code ignored;
    std::filesystem::remove(prefix_ + ".bin.tmp.megatron", ignored);
    std::filesystem::remove(prefix_ + ".idx.tmp.megatron", ignored);
  }
}

void MegatronWriter::add_sequence(std::span<const int32_t> tokens) {
  check(!finished_, "Megatron writer for ", prefix_, " is already finished");
  check(tokens.size() <= static_cast<size_t>(std::numeric_limits<int32_t>::max()), "sequence ",
        lengths_.size(), " has ", tokens.size(), " tokens; Megatron stores lengths as int32");
  int64_t low = 0, high = 0;
  dtype_range(dtype_, low, high);
  const int item = megatron_dtype_size(dtype_);
  std::vector<unsigned char> bytes(tokens.size() * static_cast<size_t>(item));
  for (size_t k = 0; k < tokens.size(); ++k) {
    check(tokens[k] >= low && tokens[k] <= high, "token id ", tokens[k], " at position ", k, " of sequence ",
          lengths_.size(), " does not fit Megatron dtype ", megatron_dtype_name(dtype_));
    store_le(bytes.data() + k * item, static_cast<uint64_t>(static_cast<int64_t>(tokens[k])), item);
  }
  bin_.write(reinterpret_cast<const char*>(bytes.data()), static_cast<std::streamsize>(bytes.size()));
  check(bin_.good(), "failed writing Megatron data file ", prefix_, ".bin.tmp.megatron");
  lengths_.push_back(static_cast<int32_t>(tokens.size()));
}

void MegatronWriter::end_document() {
  check(!finished_, "Megatron writer for ", prefix_, " is already finished");
  document_index_.push_back(static_cast<int64_t>(lengths_.size()));
}

void MegatronWriter::finish() {
  check(!finished_, "Megatron writer for ", prefix_, " is already finished");
  if (document_index_.back() != static_cast<int64_t>(lengths_.size())) end_document();
  bin_.close();
  check(!bin_.fail(), "failed writing Megatron data file ", prefix_, ".bin.tmp.megatron");

  const size_t s = lengths_.size(), d = document_index_.size();
  std::vector<unsigned char> idx(kHeaderBytes + 12 * s + 8 * d);
  unsigned char* p = idx.data();
  std::memcpy(p, kMagic, sizeof kMagic);
  store_le(p + 9, 1, 8);
  p[17] = static_cast<unsigned char>(dtype_);
  store_le(p + 18, s, 8);
  store_le(p + 26, d, 8);
  p += kHeaderBytes;
  const int item = megatron_dtype_size(dtype_);
  int64_t offset = 0;
  for (size_t k = 0; k < s; ++k) {
    store_le(p + 4 * k, static_cast<uint32_t>(lengths_[k]), 4);
    store_le(p + 4 * s + 8 * k, static_cast<uint64_t>(offset), 8);
    offset += int64_t{lengths_[k]} * item;
  }
  p += 12 * s;
  for (size_t k = 0; k < d; ++k) store_le(p + 8 * k, static_cast<uint64_t>(document_index_[k]), 8);

  const std::string idx_temp = prefix_ + ".idx.tmp.megatron";
  std::ofstream file(idx_temp, std::ios::binary | std::ios::trunc);
  file.write(reinterpret_cast<const char*>(idx.data()), static_cast<std::streamsize>(idx.size()));
  file.close();
  check(!file.fail(), "failed writing Megatron index ", idx_temp);
  // The data file first: an index never points into a missing or stale .bin.
  std::filesystem::rename(prefix_ + ".bin.tmp.megatron", prefix_ + ".bin");
  std::filesystem::rename(idx_temp, prefix_ + ".idx");
  finished_ = true;
}

void write_megatron(const std::string& prefix, const std::vector<std::vector<int32_t>>& sequences,
                    MegatronDType dtype) {
  MegatronWriter writer(prefix, dtype);
  for (const auto& sequence : sequences) {
    writer.add_sequence(sequence);
    writer.end_document();
  }
  writer.finish();
}

}  // namespace spindle
