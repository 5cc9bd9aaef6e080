// A replay of the device caching allocator's counters (backend/cuda/device_memory.cpp) without a
// GPU: each allocation is rounded up to 512 bytes like the real one, and current and peak bytes
// are kept per category and in total. The memory model allocates and frees Blocks in the order
// the CUDA executor does; a Block releases its bytes when it goes out of scope, as DeviceBuffer.
#pragma once

#include <cstdint>

#include "core/allocator.h"

namespace spindle::plan {

class Ledger {
 public:
  class Block {
   public:
    Block() = default;
    Block(Block&& other) noexcept;
    Block& operator=(Block&& other) noexcept;
    Block(const Block&) = delete;
    Block& operator=(const Block&) = delete;
    ~Block();
    int64_t bytes() const { return bytes_; }

   private:
    friend class Ledger;
    Block(Ledger* ledger, int64_t bytes, MemoryCategory category)
        : ledger_(ledger), bytes_(bytes), category_(category) {}
    void release();
    Ledger* ledger_ = nullptr;
    int64_t bytes_ = 0;
    MemoryCategory category_ = MemoryCategory::Other;
  };

  // `bytes` as the caller asks for them; the ledger rounds as the allocator does.
  Block take(int64_t bytes, MemoryCategory category);
  // Shorthands for the categories the executor uses most.
  Block activations(int64_t bytes) { return take(bytes, MemoryCategory::Activations); }
  Block workspace(int64_t bytes) { return take(bytes, MemoryCategory::Workspace); }

  const MemoryStats& stats() const { return stats_; }

 private:
  MemoryStats stats_;
};

// The allocator's size class (device_allocation_bytes, core/allocator.h).
int64_t allocator_rounded(int64_t bytes);

}  // namespace spindle::plan
