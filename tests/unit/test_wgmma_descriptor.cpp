// wgmma's descriptors (kernels/cuda/wgmma_descriptor.h) in their host form. The kernels make a
// descriptor once and move it by each k-step's byte offset (wgmma_descriptor_plus); that is only
// right while the start address field does not carry, which these check over the shared memory an
// SM has.
#include <gtest/gtest.h>

#include <cstdint>
#include <random>

#include "kernels/cuda/wgmma_descriptor.h"

namespace {

using spindle::cuda::wgmma_descriptor;
using spindle::cuda::wgmma_descriptor_128b;
using spindle::cuda::wgmma_descriptor_plus;

constexpr uint32_t kSharedBytes = 228 * 1024;  // sm_90's shared memory per SM

TEST(WgmmaDescriptor, MovedEqualsMadeAtTheMovedAddress) {
  std::mt19937 rng(7);
  std::uniform_int_distribution<uint32_t> units(0, kSharedBytes / 16 - 1);
  int checked = 0;
  for (uint32_t address = 0; address < kSharedBytes; address += 16) {
    for (int i = 0; i < 16; ++i) {
      const uint32_t offset = 16 * units(rng);
      if (address + offset >= kSharedBytes) continue;
      const uint32_t leading = 16 * (units(rng) % 1024), stride = 16 * (units(rng) % 1024);
      ASSERT_EQ(wgmma_descriptor_plus(wgmma_descriptor(address, leading, stride), offset),
                wgmma_descriptor(address + offset, leading, stride))
          << "address " << address << " + " << offset;
      ASSERT_EQ(wgmma_descriptor_plus(wgmma_descriptor_128b(address, leading, stride), offset),
                wgmma_descriptor_128b(address + offset, leading, stride))
          << "128B-swizzled, address " << address << " + " << offset;
      ++checked;
    }
  }
  EXPECT_GT(checked, 100000);
}

// The bound is real: past 2^18 bytes the made descriptor wraps its address and the moved one carries
// into the leading offset's field.
TEST(WgmmaDescriptor, MovingPastTheAddressFieldCarries) {
  const uint32_t address = (1u << 18) - 16;
  EXPECT_NE(wgmma_descriptor_plus(wgmma_descriptor(address, 128, 1024), 16),
            wgmma_descriptor(address + 16, 128, 1024));
}

}  // namespace
