// Device memory from one caching allocator: blocks are kept per exact size class after release
// and reused, so steady-state training makes no cudaMalloc calls. Statistics per category
// (weights, gradients, optimizer, activations, workspace): current, peak, cached. Release is not
// stream-ordered: a block goes to the next allocation at once, while work queued before its
// release may still use it; only work queued after on that same stream may use it safely.
#pragma once

#include <cstddef>
#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "core/allocator.h"

namespace spindle::cuda {

class DeviceAllocator {
 public:
  static DeviceAllocator& instance();

  void* allocate(size_t bytes, MemoryCategory category);
  void release(void* pointer);
  // Returns every cached block to the driver.
  void empty_cache();

  const MemoryStats& stats() const { return stats_; }
  // Peaks restart from the current use (to measure one phase).
  void reset_peak();
  int64_t cached_bytes() const { return cached_bytes_; }
  // Calls to the driver so far: blocks allocated (cudaMalloc), and cache flushes (every cached
  // block returned because an allocation did not fit beside them: a device synchronisation).
  int64_t driver_allocations() const { return driver_allocations_; }
  int64_t cache_flushes() const { return cache_flushes_; }
  // Device memory in use that this allocator does not hold (the CUDA context, the kernels' local
  // memory, libraries' own allocations): cudaMemGetInfo's used bytes less its live and cached ones.
  int64_t outside_bytes() const;
  std::string report() const;

 private:
  struct Block {
    size_t bytes;
    MemoryCategory category;
  };
  MemoryStats stats_;
  int64_t cached_bytes_ = 0, driver_allocations_ = 0, cache_flushes_ = 0;
  std::map<void*, Block> live_;
  std::multimap<size_t, void*> free_;  // by rounded size
};

// A host-to-device copy that has landed when it returns, after all queued device work (which may
// still read a recycled block). A plain cudaMemcpy from pageable memory may return before its last
// DMA completes, and kernels on a non-blocking stream do not wait for it; so this waits for the
// legacy stream too.
void copy_to_device(void* device, const void* host, size_t bytes);

// A typed device buffer owned by the caching allocator.
template <class T>
class DeviceBuffer {
 public:
  DeviceBuffer() = default;
  DeviceBuffer(size_t count, MemoryCategory category)
      : data_(static_cast<T*>(DeviceAllocator::instance().allocate(count * sizeof(T), category))),
        count_(count) {}
  ~DeviceBuffer() {
    if (data_) DeviceAllocator::instance().release(data_);
  }
  DeviceBuffer(DeviceBuffer&& other) noexcept : data_(other.data_), count_(other.count_) {
    other.data_ = nullptr;
  }
  DeviceBuffer& operator=(DeviceBuffer&& other) noexcept {
    std::swap(data_, other.data_);
    std::swap(count_, other.count_);
    return *this;
  }
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;

  T* data() { return data_; }
  const T* data() const { return data_; }
  size_t size() const { return count_; }
  // Both wait for all device work first: the model's streams are non-blocking.
  void upload(const std::vector<T>& host);
  std::vector<T> download() const;

 private:
  T* data_ = nullptr;
  size_t count_ = 0;
};

}  // namespace spindle::cuda
