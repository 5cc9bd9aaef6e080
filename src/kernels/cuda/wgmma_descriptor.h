// wgmma's shared-memory matrix descriptors (sm_90a), plain integer arithmetic on the host and the
// device, so that a CPU test checks what the kernels rely on (tests/unit/test_wgmma_descriptor.cpp).
#pragma once

#include <cstdint>

#include "kernels/cuda/host_device.h"

namespace spindle::cuda {

// A shared-memory matrix descriptor, no swizzle: start address, leading (K) and stride (M or N)
// byte offsets, each in 16-byte units.
SPINDLE_HOST_DEVICE inline uint64_t wgmma_descriptor(uint32_t shared_address, uint32_t k_offset,
                                                     uint32_t mn_offset) {
  return static_cast<uint64_t>((shared_address & 0x3FFFF) >> 4) |
         static_cast<uint64_t>((k_offset >> 4) & 0x3FFF) << 16 |
         static_cast<uint64_t>((mn_offset >> 4) & 0x3FFF) << 32;
}

// The same for an operand in the 128-byte swizzled layout (rows of 128 bytes, 8-row groups of 1024
// bytes, 1024-byte aligned; the TMA's SWIZZLE_128B): K-major, the stride byte offset is between
// 8-row groups (1024) and a k-step inside the 64-value row moves the start address 32 bytes;
// MN-major, the leading byte offset is between 64-value blocks along M, the stride byte offset
// between 8-row groups along K (probed on the H200, docs/PERF.md).
SPINDLE_HOST_DEVICE inline uint64_t wgmma_descriptor_128b(uint32_t shared_address, uint32_t leading_offset,
                                                          uint32_t stride_offset) {
  return wgmma_descriptor(shared_address, leading_offset, stride_offset) | uint64_t{1} << 62;
}

// descriptor's operand moved by byte_offset (a multiple of 16): the start address is the low field,
// in 16-byte units, and shared addresses stay below 2^18 bytes, so the sum carries out of nothing
// and equals the descriptor made at the moved address. One add where making the descriptor again
// takes about five uniform-datapath instructions (a fifth of a wgmma loop's instructions, measured:
// docs/PERF.md).
SPINDLE_HOST_DEVICE inline uint64_t wgmma_descriptor_plus(uint64_t descriptor, uint32_t byte_offset) {
  return descriptor + (byte_offset >> 4);
}

}  // namespace spindle::cuda
