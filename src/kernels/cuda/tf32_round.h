// fp32 values rounded to TF32 (10 mantissa bits) for the TF32 tensor-core products, on the FP32
// pipes: on sm_90, cvt.rna.tf32.f32 compiles to four integer-pipe instructions with checks for
// infinity and NaN, and in the KDA kernels those were about 30% of all instructions executed (ncu,
// kda_bwd_grad_kernel: FSETP 11%, IADD3 7%, LOP3 6%, SEL 6%). Host and device, so that a CPU test
// checks the arithmetic.
#pragma once

#include <cstdint>
#include <cstring>

#if defined(__CUDACC__)
#define SPINDLE_HOST_DEVICE __host__ __device__
#else
#define SPINDLE_HOST_DEVICE
#endif

namespace spindle::cuda {

// x rounded to its 11 leading significant bits (a TF32 value: the low 13 bits zero), to nearest:
// Veltkamp's split with 2^13 + 1, three operations that must not be fused (the _rn intrinsics on
// the device; ISO C++ does not contract across statements). NaN stays NaN; infinities and |x|
// above about 2^115 (where 8193 x overflows) become NaN, values the KDA kernels never hold.
SPINDLE_HOST_DEVICE inline float tf32_round(float x) {
#if defined(__CUDA_ARCH__)
  const float scaled = __fmul_rn(8193.0f, x);
  return __fsub_rn(scaled, __fsub_rn(scaled, x));
#else
  const float scaled = 8193.0f * x;
  const float rest = scaled - x;
  return scaled - rest;
#endif
}

// The bits of a finite x rounded to TF32, to nearest with ties away from zero (as cvt.rna): for the
// small second part of a 3xTF32 split, two integer operations. A NaN may become an infinity or
// zero here: the split's first part (tf32_round) carries the NaN.
SPINDLE_HOST_DEVICE inline uint32_t tf32_bits_finite(float x) {
  uint32_t bits;
#if defined(__CUDA_ARCH__)
  bits = __float_as_uint(x);
#else
  std::memcpy(&bits, &x, sizeof bits);
#endif
  return (bits + 0x1000u) & 0xffffe000u;
}

}  // namespace spindle::cuda
