// Tensor: dtype, shape, strides, device and shared storage. No autograd: modules own their
// forward and backward explicitly.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "core/allocator.h"
#include "core/dtype.h"
#include "core/error.h"

namespace spindle {

using Shape = std::vector<int64_t>;

enum class Device : uint8_t { CPU, CUDA };
const char* device_name(Device device);

std::string shape_string(const Shape& shape);
int64_t shape_numel(const Shape& shape);

// A block of memory a tensor views. Owned memory is returned to its allocator; borrowed memory
// (a memory-mapped file) is kept alive by `keep_alive`.
struct Storage {
  void* data = nullptr;
  size_t bytes = 0;
  Device device = Device::CPU;
  MemoryCategory category = MemoryCategory::Other;
  bool owned = false;
  std::shared_ptr<void> keep_alive;
  ~Storage();
};

class Tensor {
 public:
  Tensor() = default;

  static Tensor empty(const Shape& shape, DType dtype, MemoryCategory category = MemoryCategory::Other);
  static Tensor zeros(const Shape& shape, DType dtype, MemoryCategory category = MemoryCategory::Other);
  // Shape and dtype only, no memory: for counting parameters of models too large to allocate.
  static Tensor meta(const Shape& shape, DType dtype);
  bool is_meta() const {
    return storage_ && storage_->data == nullptr && storage_->bytes == 0 && numel() > 0;
  }
  // Views memory owned elsewhere (e.g. a mapped file), kept alive by `owner`.
  static Tensor borrow(std::shared_ptr<void> owner, const void* data, const Shape& shape, DType dtype,
                       Device device = Device::CPU);

  bool defined() const { return storage_ != nullptr; }
  DType dtype() const { return dtype_; }
  Device device() const { return storage_ ? storage_->device : Device::CPU; }
  const Shape& shape() const { return shape_; }
  const Shape& strides() const { return strides_; }
  int ndim() const { return static_cast<int>(shape_.size()); }
  int64_t dim(int index) const;
  int64_t numel() const { return shape_numel(shape_); }
  size_t nbytes() const { return static_cast<size_t>(numel()) * dtype_size(dtype_); }
  bool is_contiguous() const;
  std::string describe() const;  // e.g. "f32[4, 8]"

  void* raw() { return static_cast<char*>(storage_->data) + offset_ * dtype_size(dtype_); }
  const void* raw() const { return static_cast<const char*>(storage_->data) + offset_ * dtype_size(dtype_); }

  template <class T>
  T* data() {
    check_access(dtype_of<T>());
    return static_cast<T*>(raw());
  }
  template <class T>
  const T* data() const {
    check_access(dtype_of<T>());
    return static_cast<const T*>(raw());
  }

  // A contiguous block of this contiguous tensor, starting `offset` elements in.
  Tensor block(int64_t offset, const Shape& shape) const;
  // Index `i` along the first dimension.
  Tensor select(int64_t i) const;
  Tensor reshape(const Shape& shape) const;

  // A contiguous copy converted to `dtype`.
  Tensor to(DType dtype, MemoryCategory category = MemoryCategory::Other) const;
  // Copies `source` (same number of elements, any float/int dtype) into this tensor, converting.
  void copy_from(const Tensor& source);
  void fill_zero();

  // Element `i` of a contiguous tensor, converted to double (for tests and printing).
  double item_as_double(int64_t i) const;

 private:
  void check_access(DType requested) const;

  std::shared_ptr<Storage> storage_;
  DType dtype_ = DType::F32;
  Shape shape_;
  Shape strides_;
  int64_t offset_ = 0;
};

Shape contiguous_strides(const Shape& shape);

}  // namespace spindle
