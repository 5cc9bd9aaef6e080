// Exponentials in the log2 domain: exp(x) = 2^(x log2(e)), one SFU instruction (MUFU.EX2) where
// expf is several. Kernels keep their exponents pre-scaled by kLog2e.
#pragma once

namespace spindle::cuda {

constexpr float kLog2e = 1.4426950408889634f;

#if defined(__CUDACC__)
// 2^x as MUFU.EX2 alone (ex2.approx.ftz, about 2 ulp, as exp2f): exp2f adds four instructions on
// sm_90 (a range check, a select and two multiplies) to keep results below 2^-126 as subnormals,
// which this flushes to zero. The kernels only raise 2 to decays and softmax exponents, where such
// a term is nothing beside the others of its sum; their exponentials were a fifth of the KDA
// backward's instructions in that form (ncu, kda_bwd_grad_kernel).
__device__ __forceinline__ float exp2_ftz(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}
#endif

}  // namespace spindle::cuda
