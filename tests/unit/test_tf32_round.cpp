// The TF32 rounding of the KDA kernels' tensor-core operands (kernels/cuda/tf32_round.h), checked
// in its host form: the same operations as on the device.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <random>
#include <vector>

#include "kernels/cuda/tf32_round.h"

namespace {

uint32_t bits_of(float x) {
  uint32_t b;
  std::memcpy(&b, &x, sizeof b);
  return b;
}

float float_of(uint32_t b) {
  float x;
  std::memcpy(&x, &b, sizeof x);
  return x;
}

// Finite floats of both signs and magnitudes from 2^-100 to 2^111 (where the split's second part is
// still a normal float), with every mantissa pattern.
std::vector<float> samples() {
  std::mt19937 rng(7);
  std::uniform_real_distribution<float> mantissa(1.0f, 2.0f);
  std::uniform_int_distribution<int> exponent(-100, 110);
  std::vector<float> out;
  for (int i = 0; i < 200000; ++i) {
    const float x = std::ldexp(mantissa(rng), exponent(rng));
    out.push_back(i % 2 ? x : -x);
  }
  for (const float x : {0.0f, -0.0f, 1.0f, 3.0f, 1e-30f, 65504.0f}) out.push_back(x);
  out.push_back(float_of(0x3f801000u));  // 1 + 2^-11: a tie between two TF32 values
  out.push_back(float_of(0x3f803000u));  // 1 + 3 * 2^-11: another
  return out;
}

TEST(Tf32Round, KeepsElevenBitsToNearestAndTheSplitIsExact) {
  for (const float x : samples()) {
    const float hi = spindle::cuda::tf32_round(x);
    ASSERT_EQ(bits_of(hi) & 0x1fffu, 0u) << x << " rounds to a value with more than 10 mantissa bits";
    // To nearest: within half a TF32 ulp, 2^-11 of |x|; ties may go either way.
    EXPECT_LE(std::fabs(static_cast<double>(x) - hi), std::ldexp(std::fabs(static_cast<double>(x)), -11))
        << x;
    const uint32_t rna = (bits_of(x) + 0x1000u) & 0xffffe000u;  // cvt.rna.tf32.f32 for finite x
    const bool tie = (bits_of(x) & 0x1fffu) == 0x1000u;
    if (!tie) {
      EXPECT_EQ(bits_of(hi), rna) << x;
    }
    // The second part: x - hi is exact, and its TF32 rounding leaves at most 2^-22 of |x|.
    const float rest = x - hi;
    EXPECT_EQ(static_cast<double>(hi) + rest, static_cast<double>(x)) << x;
    const uint32_t lo = spindle::cuda::tf32_bits_finite(rest);
    EXPECT_EQ(lo & 0x1fffu, 0u) << x;
    EXPECT_LE(std::fabs(static_cast<double>(x) - hi - float_of(lo)),
              std::ldexp(std::fabs(static_cast<double>(x)), -22))
        << x;
  }
}

TEST(Tf32Round, TiesAndTf32ValuesAndNan) {
  EXPECT_EQ(spindle::cuda::tf32_round(1.5f), 1.5f);  // already a TF32 value
  const float tie = float_of(0x3f801000u);           // halfway between 1 and 1 + 2^-10
  const float rounded = spindle::cuda::tf32_round(tie);
  EXPECT_TRUE(rounded == 1.0f || rounded == float_of(0x3f802000u)) << rounded;
  EXPECT_TRUE(std::isnan(spindle::cuda::tf32_round(std::numeric_limits<float>::quiet_NaN())));
  EXPECT_EQ(spindle::cuda::tf32_bits_finite(1.0f + std::ldexp(1.0f, -11)), 0x3f802000u);  // away from zero
}

}  // namespace
