#include "devils_dictionary.hpp"

#include <zlib.h>

#include <stdexcept>

namespace kvsift::apps {

std::string read_devils_dictionary() {
  gzFile gz = gzopen(kDevilsDictionaryPath, "rb");
  if (gz == nullptr)
    throw std::runtime_error(std::string("cannot open ") + kDevilsDictionaryPath +
                             " (install the Debian package dict-devil)");
  std::string text;
  char buffer[65536];
  int n;
  while ((n = gzread(gz, buffer, sizeof buffer)) > 0) text.append(buffer, n);
  const bool failed = n < 0;
  gzclose(gz);
  const std::size_t begin = text.find("PREFACE");
  if (failed || begin == std::string::npos || text.size() - begin < 100000)
    throw std::runtime_error(std::string(kDevilsDictionaryPath) +
                             " does not hold The Devil's Dictionary (reinstall dict-devil)");
  return text.substr(begin);
}

}  // namespace kvsift::apps
