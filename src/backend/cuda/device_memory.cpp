#include "backend/cuda/device_memory.h"

#include <cuda_bf16.h>

#include <sstream>

#include "backend/cuda/check.h"

namespace spindle::cuda {

namespace {

// Sizes round up to what the driver takes (so that the counters are the memory in use and a cached
// block serves any request of its size class).
size_t rounded(size_t bytes) {
  return static_cast<size_t>(device_allocation_bytes(static_cast<int64_t>(bytes)));
}

}  // namespace

DeviceAllocator& DeviceAllocator::instance() {
  static DeviceAllocator allocator;
  return allocator;
}

void* DeviceAllocator::allocate(size_t bytes, MemoryCategory category) {
  const size_t size = rounded(bytes);
  void* pointer = nullptr;
  if (auto it = free_.find(size); it != free_.end()) {
    pointer = it->second;
    free_.erase(it);
    cached_bytes_ -= static_cast<int64_t>(size);
  } else {
    ++driver_allocations_;
    cudaError_t status = cudaMalloc(&pointer, size);
    if (status == cudaErrorMemoryAllocation && cached_bytes_ > 0) {
      (void)cudaGetLastError();
      ++cache_flushes_;
      empty_cache();
      status = cudaMalloc(&pointer, size);
    }
    if (status != cudaSuccess) {
      (void)cudaGetLastError();
      // Another status is an earlier kernel's error surfacing here, not a lack of memory.
      check(status == cudaErrorMemoryAllocation, "CUDA error ", cudaGetErrorName(status), " (",
            cudaGetErrorString(status), ") while allocating ", size, " bytes for ",
            memory_category_name(category), " (", report(), ")");
      fail("out of device memory: could not allocate ", size, " bytes for ", memory_category_name(category),
           " (", report(), ")");
    }
  }
  live_[pointer] = {size, category};
  const int c = static_cast<int>(category);
  stats_.current[c] += static_cast<int64_t>(size);
  stats_.current_total += static_cast<int64_t>(size);
  stats_.peak[c] = std::max(stats_.peak[c], stats_.current[c]);
  stats_.peak_total = std::max(stats_.peak_total, stats_.current_total);
  return pointer;
}

void DeviceAllocator::release(void* pointer) {
  auto it = live_.find(pointer);
  check(it != live_.end(), "device release of a pointer this allocator did not give out");
  const Block block = it->second;
  live_.erase(it);
  const int c = static_cast<int>(block.category);
  stats_.current[c] -= static_cast<int64_t>(block.bytes);
  stats_.current_total -= static_cast<int64_t>(block.bytes);
  free_.emplace(block.bytes, pointer);
  cached_bytes_ += static_cast<int64_t>(block.bytes);
}

void DeviceAllocator::reset_peak() {
  stats_.peak = stats_.current;
  stats_.peak_total = stats_.current_total;
}

void DeviceAllocator::empty_cache() {
  SPINDLE_CUDA(cudaDeviceSynchronize());
  for (auto& [size, pointer] : free_) SPINDLE_CUDA(cudaFree(pointer));
  free_.clear();
  cached_bytes_ = 0;
}

int64_t DeviceAllocator::outside_bytes() const {
  size_t free = 0, total = 0;
  if (cudaMemGetInfo(&free, &total) != cudaSuccess) {
    (void)cudaGetLastError();
    return -1;
  }
  return static_cast<int64_t>(total - free) - stats_.current_total - cached_bytes_;
}

std::string DeviceAllocator::report() const {
  std::ostringstream out;
  out << "device memory now " << stats_.current_total << " B, peak " << stats_.peak_total << " B, cached "
      << cached_bytes_ << " B, in use outside this allocator " << outside_bytes() << " B";
  for (int c = 0; c < kMemoryCategories; ++c) {
    if (stats_.peak[c] == 0) continue;
    out << "; " << memory_category_name(static_cast<MemoryCategory>(c)) << " peak " << stats_.peak[c] << " B";
  }
  return out.str();
}

void copy_to_device(void* device, const void* host, size_t bytes) {
  // The model's streams do not wait for the legacy stream, and this block may be a recycled one
  // that queued kernels still read: finish everything first.
  SPINDLE_CUDA(cudaDeviceSynchronize());
  SPINDLE_CUDA(cudaMemcpy(device, host, bytes, cudaMemcpyHostToDevice));
  SPINDLE_CUDA(cudaStreamSynchronize(cudaStreamLegacy));
}

template <class T>
void DeviceBuffer<T>::upload(const std::vector<T>& host) {
  check(host.size() == count_, "upload of ", host.size(), " elements into a device buffer of ", count_);
  copy_to_device(data_, host.data(), count_ * sizeof(T));
}

template <class T>
std::vector<T> DeviceBuffer<T>::download() const {
  std::vector<T> host(count_);
  // The legacy stream's copy does not wait for the non-blocking streams that wrote the buffer.
  SPINDLE_CUDA(cudaDeviceSynchronize());
  SPINDLE_CUDA(cudaMemcpy(host.data(), data_, count_ * sizeof(T), cudaMemcpyDeviceToHost));
  return host;
}

template class DeviceBuffer<float>;
template class DeviceBuffer<__nv_bfloat16>;
template class DeviceBuffer<int32_t>;
template class DeviceBuffer<double>;
template class DeviceBuffer<uint32_t>;
template class DeviceBuffer<uint16_t>;

}  // namespace spindle::cuda
