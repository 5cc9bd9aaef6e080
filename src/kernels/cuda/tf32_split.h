// fp32 values as two TF32 parts for the 3xTF32 tensor-core products of the KDA kernels (hi * hi +
// hi * lo + lo * hi keeps fp32-level accuracy at three mma per product). The split costs
// instructions on every operand load, so it is written for few: hi by truncation (one LOP3), lo =
// x - hi (exact) rounded to TF32 (two integer operations). cvt.rna.tf32.f32 compiles to four
// integer-pipe instructions with checks on sm_90, and a split by rounding hi (Veltkamp, three on
// the FP32 pipes) took six in all. Host and device, so that a CPU test checks the arithmetic.
#pragma once

#include <cstdint>
#include <cstring>
#include <type_traits>

#include "kernels/cuda/host_device.h"

namespace spindle::cuda {

// A float's bits as uint32_t, or the float of given bits (To: the other one of the two).
template <class To, class From>
SPINDLE_HOST_DEVICE inline To bits_as(From x) {
  static_assert(sizeof(To) == 4 && sizeof(From) == 4, "a float and its bits");
#if defined(__CUDA_ARCH__)
  if constexpr (std::is_same_v<To, float>) {
    return __uint_as_float(x);
  } else {
    return __float_as_uint(x);
  }
#else
  To y;
  std::memcpy(&y, &x, sizeof y);
  return y;
#endif
}

// The bits of a finite x rounded to TF32 (10 mantissa bits), to nearest with ties away from zero
// (as cvt.rna), by two integer operations: for the split's small second part, which is finite
// wherever x is. (On a NaN this may give an infinity or zero: the first part carries the NaN.)
SPINDLE_HOST_DEVICE inline uint32_t tf32_bits_finite(float x) {
  return (bits_as<uint32_t>(x) + 0x1000u) & 0xffffe000u;
}

// The bits of x truncated to TF32 (the low 13 mantissa bits cleared; NaN and infinities stay what
// they are): one LOP3.
SPINDLE_HOST_DEVICE inline uint32_t tf32_truncated_bits(float x) {
  return bits_as<uint32_t>(x) & 0xffffe000u;
}

// x = hi + lo as TF32 bit patterns: hi is x truncated to TF32 (NaN and infinities stay what they
// are), lo the rest, x - hi, exact in fp32 (|x - hi| < 2^-10 |x|) and rounded to TF32 (to 2^-21 of
// |x|). A 3xTF32 product then misses lo * lo and the rounding of each lo, at most about 2^-19 of
// |x y| (2^-21 with hi rounded to nearest, at two more instructions per value).
SPINDLE_HOST_DEVICE inline void tf32_split(float x, uint32_t& hi, uint32_t& lo) {
  hi = tf32_truncated_bits(x);
#if defined(__CUDA_ARCH__)
  lo = tf32_bits_finite(__fsub_rn(x, __uint_as_float(hi)));
#else
  lo = tf32_bits_finite(x - bits_as<float>(hi));
#endif
}

}  // namespace spindle::cuda
