#include "core/allocator.h"

#include <cstdlib>
#include <fstream>
#include <new>
#include <sstream>

#include "core/error.h"

namespace spindle {

const char* memory_category_name(MemoryCategory category) {
  switch (category) {
    case MemoryCategory::Weights:
      return "weights";
    case MemoryCategory::Gradients:
      return "gradients";
    case MemoryCategory::Optimizer:
      return "optimizer";
    case MemoryCategory::Activations:
      return "activations";
    case MemoryCategory::Workspace:
      return "workspace";
    case MemoryCategory::Other:
      return "other";
  }
  return "?";
}

HostAllocator& HostAllocator::instance() {
  static HostAllocator allocator;
  return allocator;
}

void* HostAllocator::allocate(size_t bytes, MemoryCategory category) {
  constexpr size_t kAlignment = 64;
  const size_t rounded = (bytes + kAlignment - 1) / kAlignment * kAlignment;
  void* pointer = std::aligned_alloc(kAlignment, rounded == 0 ? kAlignment : rounded);
  if (pointer == nullptr) {
    fail("out of host memory: could not allocate ", bytes, " bytes for ", memory_category_name(category),
         " (", report(), ")");
  }
  const int c = static_cast<int>(category);
  stats_.current[c] += static_cast<int64_t>(bytes);
  stats_.current_total += static_cast<int64_t>(bytes);
  if (stats_.current[c] > stats_.peak[c]) stats_.peak[c] = stats_.current[c];
  if (stats_.current_total > stats_.peak_total) stats_.peak_total = stats_.current_total;
  return pointer;
}

void HostAllocator::release(void* pointer, size_t bytes, MemoryCategory category) {
  std::free(pointer);
  const int c = static_cast<int>(category);
  stats_.current[c] -= static_cast<int64_t>(bytes);
  stats_.current_total -= static_cast<int64_t>(bytes);
}

std::string HostAllocator::report() const {
  std::ostringstream out;
  out << "host tensors now " << stats_.current_total << " B, peak " << stats_.peak_total << " B";
  for (int c = 0; c < kMemoryCategories; ++c) {
    if (stats_.peak[c] == 0) continue;
    out << "; " << memory_category_name(static_cast<MemoryCategory>(c)) << " peak " << stats_.peak[c] << " B";
  }
  return out.str();
}

int64_t peak_rss_bytes() {
  std::ifstream status("/proc/self/status");
  std::string line;
  while (std::getline(status, line)) {
    if (line.rfind("VmHWM:", 0) == 0) {
      std::istringstream fields(line.substr(6));
      int64_t kilobytes = 0;
      fields >> kilobytes;
      return kilobytes * 1024;
    }
  }
  return -1;
}

}  // namespace spindle
