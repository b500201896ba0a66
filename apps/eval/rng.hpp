// The evaluation's random numbers: splitmix64, with bounded draws by rejection. Written by hand
// because std:: distributions differ between standard libraries, and a seed must give the same
// tasks everywhere.
#pragma once

#include <cstdint>
#include <string_view>
#include <utility>
#include <vector>

namespace kvsift::eval {

class Rng {
 public:
  explicit Rng(uint64_t seed) : state_(seed) {}

  uint64_t next() {
    uint64_t z = (state_ += 0x9E3779B97F4A7C15ull);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
  }
  // Uniform in [0, n), n > 0, without modulo bias.
  uint64_t below(uint64_t n) {
    const uint64_t limit = UINT64_MAX - UINT64_MAX % n;
    uint64_t x;
    do x = next();
    while (x >= limit);
    return x % n;
  }
  // Uniform in [lo, hi].
  uint64_t between(uint64_t lo, uint64_t hi) { return lo + below(hi - lo + 1); }
  // Uniform in [0, 1).
  double unit() { return static_cast<double>(next() >> 11) * 0x1.0p-53; }
  template <class T>
  void shuffle(std::vector<T>& v) {
    for (std::size_t i = v.size(); i > 1; --i) std::swap(v[i - 1], v[below(i)]);
  }

 private:
  uint64_t state_;
};

// A seed for one sample from the run's seed and what identifies the sample (FNV-1a over the
// name, mixed with the numbers), so adding a task or a length leaves the others' samples alone.
inline uint64_t sample_seed(uint64_t seed, std::string_view task, uint32_t length, uint32_t index) {
  uint64_t h = 0xCBF29CE484222325ull;
  for (const char c : task) h = (h ^ static_cast<uint8_t>(c)) * 0x100000001B3ull;
  Rng mix(seed ^ h ^ (uint64_t{length} << 32) ^ index);
  return mix.next();
}

}  // namespace kvsift::eval
