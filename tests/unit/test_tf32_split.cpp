// The 3xTF32 split of the KDA kernels' tensor-core operands (kernels/cuda/tf32_split.h), checked in
// its host form: the same operations as on the device. A TF32 product of two parts is exact in
// double (11 x 11 significant bits), so the products below are what the tensor cores multiply.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <random>
#include <vector>

#include "kernels/cuda/tf32_split.h"

namespace {

float bits_float(uint32_t bits) { return spindle::cuda::bits_as<float>(bits); }
uint32_t float_bits(float x) { return spindle::cuda::bits_as<uint32_t>(x); }

// Finite floats of both signs and magnitudes from 2^-100 to 2^111, with every mantissa pattern.
std::vector<float> samples(unsigned seed) {
  std::mt19937 rng(seed);
  std::uniform_real_distribution<float> mantissa(1.0f, 2.0f);
  std::uniform_int_distribution<int> exponent(-100, 110);
  std::vector<float> out;
  for (int i = 0; i < 200000; ++i) {
    const float x = std::ldexp(mantissa(rng), exponent(rng));
    out.push_back(i % 2 ? x : -x);
  }
  for (const float x : {0.0f, -0.0f, 1.0f, 3.0f, 1e-30f, 65504.0f, std::numeric_limits<float>::max()})
    out.push_back(x);
  out.push_back(bits_float(0x3f801000u));  // 1 + 2^-11: a tie for lo's rounding
  out.push_back(bits_float(0x3f801fffu));  // the most hi's truncation leaves out
  return out;
}

TEST(Tf32Split, PartsAreTf32AndSumToTheValue) {
  for (const float x : samples(7)) {
    uint32_t hi = 0, lo = 0;
    spindle::cuda::tf32_split(x, hi, lo);
    ASSERT_EQ(hi & 0x1fffu, 0u) << x;
    ASSERT_EQ(lo & 0x1fffu, 0u) << x;
    const double ax = std::fabs(static_cast<double>(x));
    // hi truncates: same sign, |hi| <= |x| and within one TF32 ulp, 2^-10 of |x|.
    EXPECT_LE(std::fabs(static_cast<double>(bits_float(hi))), ax) << x;
    EXPECT_LT(ax - std::fabs(static_cast<double>(bits_float(hi))), std::ldexp(ax, -10) + 1e-300) << x;
    // hi + lo = x to 2^-21 of |x| (lo's rounding).
    const double sum = static_cast<double>(bits_float(hi)) + bits_float(lo);
    EXPECT_LE(std::fabs(sum - x), std::ldexp(ax, -21)) << x;
  }
}

TEST(Tf32Split, ThreeProductsKeepFp32LevelAccuracy) {
  const std::vector<float> xs = samples(11), ys = samples(13);
  double worst = 0.0;
  for (size_t i = 0; i < xs.size(); ++i) {
    const float x = std::ldexp(xs[i], -std::ilogb(xs[i])), y = std::ldexp(ys[i], -std::ilogb(ys[i]));
    if (x == 0.0f || y == 0.0f || !std::isfinite(x) || !std::isfinite(y)) continue;
    uint32_t xh = 0, xl = 0, yh = 0, yl = 0;
    spindle::cuda::tf32_split(x, xh, xl);
    spindle::cuda::tf32_split(y, yh, yl);
    const double three = static_cast<double>(bits_float(xh)) * bits_float(yh) +
                         static_cast<double>(bits_float(xh)) * bits_float(yl) +
                         static_cast<double>(bits_float(xl)) * bits_float(yh);
    const double exact = static_cast<double>(x) * y;
    worst = std::max(worst, std::fabs(three - exact) / std::fabs(exact));
  }
  // lo * lo (< 2^-20) and the two roundings of lo (< 2^-21 each): under 2^-19, where hi * hi alone
  // (plain TF32) misses up to 2^-9.
  EXPECT_LT(worst, std::ldexp(1.0, -19));
}

TEST(Tf32Split, NanAndInfinityStayInTheFirstPart) {
  uint32_t hi = 0, lo = 0;
  spindle::cuda::tf32_split(std::numeric_limits<float>::quiet_NaN(), hi, lo);
  EXPECT_TRUE(std::isnan(bits_float(hi)));
  spindle::cuda::tf32_split(bits_float(0x7fffffffu), hi, lo);  // the GPU's canonical NaN
  EXPECT_TRUE(std::isnan(bits_float(hi)));
  spindle::cuda::tf32_split(-std::numeric_limits<float>::infinity(), hi, lo);
  EXPECT_EQ(bits_float(hi), -std::numeric_limits<float>::infinity());
  EXPECT_EQ(spindle::cuda::tf32_bits_finite(1.0f + std::ldexp(1.0f, -11)), 0x3f802000u);  // away from zero
  EXPECT_EQ(float_bits(1.0f + std::ldexp(1.0f, -11)) & 0xffffe000u, float_bits(1.0f));    // hi truncates
}

}  // namespace
