// apps/common/sha256.cpp against the FIPS 180-4 example vectors (the empty message, "abc", the
// 448-bit message, a million 'a's) and coreutils sha256sum's digests at the padding's edges; exits
// 0 when all match.
#include <cstdio>
#include <string>

#include "common/sha256.hpp"

int main() {
  struct Vector {
    std::string message, digest;
  };
  const Vector vectors[] = {
      {"", "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855"},
      {"abc", "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad"},
      {"abcdbcdecdefdefgefghfghighijhijkijkljklmklmnlmnomnopnopq",
       "248d6a61d20638b8e5c026930c3e6039a33ce45964ff2167f6ecedd419db06c1"},
      {std::string(1000000, 'a'),
       "cdc76e5c9914fb9281a1c7e284d73e67f1809a48a497200e046d39ccc7112cd0"},
      // 55, 56 and 64 bytes, the padding's edges (one block, two, a full block): sha256sum's.
      {std::string(55, 'x'), "d5e285683cd4efc02d021a5c62014694958901005d6f71e89e0989fac77e4072"},
      {std::string(56, 'x'), "04c26261370ee7541549d16dee320c723e3fd14671e66a099afe0a377c16888e"},
      {std::string(64, 'x'), "7ce100971f64e7001e8fe5a51973ecdfe1ced42befe7ee8d5fd6219506b5393c"},
  };
  int failures = 0;
  for (const Vector& v : vectors) {
    const std::string got = kvsift::apps::sha256_hex(v.message);
    if (got != v.digest) {
      std::fprintf(stderr, "sha256 of %zu bytes: %s, expected %s\n", v.message.size(), got.c_str(),
                   v.digest.c_str());
      ++failures;
    }
  }
  return failures == 0 ? 0 : 1;
}
