// SHA-256 (FIPS 180-4), to check downloaded data against published checksums without OpenSSL.
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>

namespace spindle {

class Sha256 {
 public:
  Sha256();
  void update(const void* data, size_t size);
  void update(std::string_view text) { update(text.data(), text.size()); }
  // Finishes the hash; the object then starts over.
  std::array<uint8_t, 32> digest();
  std::string hex_digest();

 private:
  void block(const uint8_t* p);
  void reset();

  uint32_t state_[8];
  uint8_t buffer_[64];
  size_t buffered_ = 0;
  uint64_t bytes_ = 0;
};

std::string sha256_hex(std::string_view data);
// Hex digest of a whole file, read in pieces; a missing or unreadable file is an error naming it.
std::string sha256_file(const std::string& path);

}  // namespace spindle
