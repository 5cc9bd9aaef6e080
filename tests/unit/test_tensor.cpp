// Tensor conversions between the floating dtypes (f32, f64, bf16, f16): every pair, on more
// elements than one parallel block, against the one-element formulas (the value read as double,
// rounded once to the destination: bf16 and f16 through float, as core/dtype.h rounds).
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <random>
#include <vector>

#include "core/dtype.h"
#include "core/tensor.h"

namespace spindle {
namespace {

// The bytes of `v` stored as `dtype`.
std::vector<unsigned char> stored(DType dtype, double v) {
  std::vector<unsigned char> out(dtype_size(dtype));
  if (dtype == DType::F32) {
    const float x = static_cast<float>(v);
    std::memcpy(out.data(), &x, 4);
  } else if (dtype == DType::F64) {
    std::memcpy(out.data(), &v, 8);
  } else {
    const uint16_t x =
        dtype == DType::BF16 ? float_to_bf16(static_cast<float>(v)) : float_to_f16(static_cast<float>(v));
    std::memcpy(out.data(), &x, 2);
  }
  return out;
}

TEST(Tensor, ConversionsBetweenFloatingTypesRoundOnce) {
  const DType floating[] = {DType::F32, DType::F64, DType::BF16, DType::F16};
  const int64_t n = 300007;  // several parallel blocks and a ragged last one
  std::mt19937 rng(3);
  std::uniform_real_distribution<double> exponent(-30.0, 20.0), sign(-1.0, 1.0);
  for (const DType from : floating) {
    Tensor source = Tensor::empty({n}, DType::F64);
    for (int64_t i = 0; i < n; ++i)
      source.data<double>()[i] = std::copysign(std::exp2(exponent(rng)), sign(rng));  // past f16's range too
    Tensor input = Tensor::empty({n}, from);
    input.copy_from(source);
    for (const DType to : floating) {
      Tensor output = Tensor::empty({n}, to);
      output.copy_from(input);
      const auto* got = static_cast<const unsigned char*>(output.raw());
      int64_t wrong = 0;
      for (int64_t i = 0; i < n; ++i) {
        const std::vector<unsigned char> want = stored(to, input.item_as_double(i));
        wrong += std::memcmp(got + i * dtype_size(to), want.data(), want.size()) != 0;
      }
      EXPECT_EQ(wrong, 0) << dtype_name(from) << " -> " << dtype_name(to);
    }
  }
}

}  // namespace
}  // namespace spindle
