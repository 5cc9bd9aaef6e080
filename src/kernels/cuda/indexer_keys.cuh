// The indexer's order-preserving keys of fp32 scores: the top-k's radix select ranks them, and the
// scorers' tile maxima (indexer.h) are kept as them, so that an unsigned max orders negative scores
// too and both agree bit for bit.
#pragma once

namespace spindle::cuda {

// Order-preserving map of fp32 bits to unsigned: a > b as floats iff key(a) > key(b).
__device__ __forceinline__ unsigned ordered_key(float value) {
  const unsigned u = __float_as_uint(value);
  return (u & 0x80000000u) ? ~u : (u | 0x80000000u);
}

}  // namespace spindle::cuda
