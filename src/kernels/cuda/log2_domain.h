// Exponentials in the log2 domain: exp(x) = exp2f(x log2(e)), and exp2f is one SFU instruction
// (MUFU.EX2) where expf is several. Kernels keep their exponents pre-scaled by kLog2e.
#pragma once

namespace spindle::cuda {

constexpr float kLog2e = 1.4426950408889634f;

}  // namespace spindle::cuda
