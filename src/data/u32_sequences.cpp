#include "data/u32_sequences.h"

#include <filesystem>
#include <fstream>
#include <limits>

#include "core/error.h"

namespace spindle {
namespace {

uint32_t load_le32(const unsigned char* p) {
  return uint32_t{p[0]} | (uint32_t{p[1]} << 8) | (uint32_t{p[2]} << 16) | (uint32_t{p[3]} << 24);
}

}  // namespace

U32Sequences::U32Sequences(const std::string& path, int64_t vocab_size)
    : file_(path, "token file"), vocab_size_(vocab_size) {
  check(vocab_size >= 0, "vocabulary size must be >= 0, got ", vocab_size);
  check(file_.size() % 4 == 0, "token file ", path, " is ", file_.size(),
        " bytes, not a multiple of 4: expected a raw stream of little-endian uint32 token ids");
  tokens_ = static_cast<int64_t>(file_.size() / 4);
  check(tokens_ > 0, "token file ", path, " is empty");
}

std::string U32Sequences::name(int64_t i) const {
  check_index(i);
  return std::filesystem::path(file_.path()).filename().string();
}

int64_t U32Sequences::length(int64_t i) const {
  check_index(i);
  return tokens_;
}

void U32Sequences::read(int64_t i, int64_t start, int64_t count, int32_t* out) const {
  check_range(i, start, count);
  const int64_t limit = vocab_size_ > 0 ? vocab_size_ : int64_t{std::numeric_limits<int32_t>::max()} + 1;
  const unsigned char* p = file_.data() + 4 * start;
  for (int64_t k = 0; k < count; ++k, p += 4) {
    const uint32_t id = load_le32(p);
    if (id >= limit) {
      fail("token file ", source(), ": token id ", id, " at position ", start + k, " (byte offset ",
           4 * (start + k), ") is outside the vocabulary of ", limit);
    }
    out[k] = static_cast<int32_t>(id);
  }
}

void write_u32_tokens(const std::string& path, const std::vector<int32_t>& tokens) {
  std::vector<unsigned char> bytes(tokens.size() * 4);
  for (size_t k = 0; k < tokens.size(); ++k) {
    check(tokens[k] >= 0, "cannot write negative token id ", tokens[k], " at position ", k, " to ", path);
    const auto v = static_cast<uint32_t>(tokens[k]);
    for (int b = 0; b < 4; ++b) bytes[4 * k + b] = static_cast<unsigned char>(v >> (8 * b));
  }
  const std::string temp = path + ".tmp.u32";
  {
    std::ofstream file(temp, std::ios::binary | std::ios::trunc);
    check(file.good(), "cannot write token file ", temp);
    file.write(reinterpret_cast<const char*>(bytes.data()), static_cast<std::streamsize>(bytes.size()));
    file.close();
    if (!file) {
      std::filesystem::remove(temp);
      fail("failed writing token file ", temp);
    }
  }
  std::filesystem::rename(temp, path);
}

}  // namespace spindle
