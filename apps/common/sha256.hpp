// SHA-256 (FIPS 180-4) of a file, for kvsift-eval's provenance record (the model file's digest).
// Hand-written because nothing kvsift already depends on offers one: scripts/setup.sh's Debian
// packages hold no crypto library (OpenSSL, nettle and libgcrypt are not among them) and none of
// the libraries the apps link (oneDNN, ICU, libgomp, libstdc++) exports a hash. Checked against
// the FIPS 180-4 example vectors by apps/common/sha256_test.cpp.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>

namespace kvsift::apps {

class Sha256 {
 public:
  Sha256();
  void update(const void* data, std::size_t size);
  // The digest as 64 lowercase hex digits; the object is spent after it.
  std::string hex_digest();

 private:
  void compress(const uint8_t block[64]);
  uint32_t state_[8];
  uint8_t buffer_[64];
  std::size_t buffered_ = 0;
  uint64_t total_bytes_ = 0;
};

std::string sha256_hex(const std::string& bytes);
// Throws std::runtime_error naming the file when it cannot be read to its end.
std::string sha256_file_hex(const std::string& path);

}  // namespace kvsift::apps
