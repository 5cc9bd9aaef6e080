// Host memory for tensors: aligned allocations with statistics per category.
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <string>

namespace spindle {

enum class MemoryCategory : uint8_t { Weights, Gradients, Optimizer, Activations, Workspace, Other };
constexpr int kMemoryCategories = 6;
const char* memory_category_name(MemoryCategory category);

// The device memory a cudaMalloc of `bytes` takes (measured on the H200 with CUDA 13): past 1 MiB,
// whole 2 MiB pages; up to 1 MiB, packed into shared pages (counted here in 512-byte granules).
// Never powers of two: a 1.1 GB activation must not take 2 GB.
constexpr int64_t device_allocation_bytes(int64_t bytes) {
  constexpr int64_t kSmall = int64_t{1} << 20, kPage = int64_t{2} << 20, kGranule = 512;
  const int64_t n = bytes < 1 ? 1 : bytes;
  return n <= kSmall ? (n + kGranule - 1) / kGranule * kGranule : (n + kPage - 1) / kPage * kPage;
}

// A count of rows rounded up to one of 8 sizes per doubling (at least 1024): buffers sized by a
// count that changes with every call (a chunk's union of selected keys) then fall into a few size
// classes, which the device allocator's cache serves again, where exact sizes would each be a new
// cudaMalloc (a millisecond the GPU waits for, behind a synchronisation). At most 1/8 more rows.
constexpr int64_t geometric_capacity(int64_t rows) {
  constexpr int64_t kLeast = 1024;
  if (rows <= kLeast) return kLeast;
  int64_t step = 1;
  while (step * 16 <= rows) step *= 2;  // rows in [8 step, 16 step): 1/8 of its doubling
  return (rows + step - 1) / step * step;
}

struct MemoryStats {
  std::array<int64_t, kMemoryCategories> current{};
  std::array<int64_t, kMemoryCategories> peak{};
  int64_t current_total = 0;
  int64_t peak_total = 0;
};

// Every host tensor allocation goes through here, so peaks are known per category.
class HostAllocator {
 public:
  static HostAllocator& instance();
  void* allocate(size_t bytes, MemoryCategory category);
  void release(void* pointer, size_t bytes, MemoryCategory category);
  const MemoryStats& stats() const { return stats_; }
  std::string report() const;

 private:
  MemoryStats stats_;
};

// Peak resident set size of this process in bytes (from the kernel), for memory checks.
int64_t peak_rss_bytes();

}  // namespace spindle
