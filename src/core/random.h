// A small, portable random generator (xoshiro256** seeded by splitmix64) with uniform and
// normal draws, so that `--seed N` gives the same weights on every platform and library.
#pragma once

#include <array>
#include <cmath>
#include <cstdint>

namespace spindle {

class Random {
 public:
  explicit Random(uint64_t seed) {
    for (auto& word : state_) word = splitmix(seed);
  }

  uint64_t next() {
    const uint64_t result = rotl(state_[1] * 5, 7) * 9;
    const uint64_t t = state_[1] << 17;
    state_[2] ^= state_[0];
    state_[3] ^= state_[1];
    state_[1] ^= state_[2];
    state_[0] ^= state_[3];
    state_[2] ^= t;
    state_[3] = rotl(state_[3], 45);
    return result;
  }

  // Uniform in [0, 1) with 53 random bits.
  double uniform() { return static_cast<double>(next() >> 11) * 0x1.0p-53; }
  double uniform(double low, double high) { return low + (high - low) * uniform(); }

  // The four state words, so that a training checkpoint resumes the exact sequence.
  std::array<uint64_t, 4> state() const { return {state_[0], state_[1], state_[2], state_[3]}; }
  void set_state(const std::array<uint64_t, 4>& words) {
    for (size_t i = 0; i < 4; ++i) state_[i] = words[i];
  }

  // Standard normal by Box-Muller (one draw per call; simple and exact enough for init).
  double normal() {
    double u1 = uniform();
    while (u1 <= 0.0) u1 = uniform();
    const double u2 = uniform();
    return std::sqrt(-2.0 * std::log(u1)) * std::cos(6.283185307179586 * u2);
  }

 private:
  static uint64_t rotl(uint64_t x, int k) { return (x << k) | (x >> (64 - k)); }
  static uint64_t splitmix(uint64_t& x) {
    uint64_t z = (x += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
  }
  uint64_t state_[4];
};

}  // namespace spindle
