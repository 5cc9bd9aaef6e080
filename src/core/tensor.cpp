#include "core/tensor.h"

#include <cstring>
#include <sstream>
#include <type_traits>

#include "core/parallel.h"

namespace spindle {

const char* device_name(Device device) { return device == Device::CPU ? "cpu" : "cuda"; }

std::string shape_string(const Shape& shape) {
  std::ostringstream out;
  out << '[';
  for (size_t i = 0; i < shape.size(); ++i) out << (i ? ", " : "") << shape[i];
  out << ']';
  return out.str();
}

int64_t shape_numel(const Shape& shape) {
  int64_t n = 1;
  for (int64_t d : shape) n *= d;
  return n;
}

Shape contiguous_strides(const Shape& shape) {
  Shape strides(shape.size());
  int64_t stride = 1;
  for (size_t i = shape.size(); i-- > 0;) {
    strides[i] = stride;
    stride *= shape[i];
  }
  return strides;
}

Storage::~Storage() {
  if (owned && data != nullptr) HostAllocator::instance().release(data, bytes, category);
}

Tensor Tensor::empty(const Shape& shape, DType dtype, MemoryCategory category) {
  for (int64_t d : shape) check(d >= 0, "tensor shape ", shape_string(shape), " has a negative dimension");
  Tensor t;
  t.storage_ = std::make_shared<Storage>();
  t.storage_->bytes = static_cast<size_t>(shape_numel(shape)) * dtype_size(dtype);
  t.storage_->data = HostAllocator::instance().allocate(t.storage_->bytes, category);
  t.storage_->category = category;
  t.storage_->owned = true;
  t.dtype_ = dtype;
  t.shape_ = shape;
  t.strides_ = contiguous_strides(shape);
  return t;
}

Tensor Tensor::zeros(const Shape& shape, DType dtype, MemoryCategory category) {
  Tensor t = empty(shape, dtype, category);
  t.fill_zero();
  return t;
}

Tensor Tensor::meta(const Shape& shape, DType dtype) {
  Tensor t;
  t.storage_ = std::make_shared<Storage>();
  t.dtype_ = dtype;
  t.shape_ = shape;
  t.strides_ = contiguous_strides(shape);
  return t;
}

Tensor Tensor::borrow(std::shared_ptr<void> owner, const void* data, const Shape& shape, DType dtype,
                      Device device) {
  Tensor t;
  t.storage_ = std::make_shared<Storage>();
  t.storage_->data = const_cast<void*>(data);
  t.storage_->device = device;
  t.storage_->bytes = static_cast<size_t>(shape_numel(shape)) * dtype_size(dtype);
  t.storage_->keep_alive = std::move(owner);
  t.dtype_ = dtype;
  t.shape_ = shape;
  t.strides_ = contiguous_strides(shape);
  return t;
}

int64_t Tensor::dim(int index) const {
  const int n = ndim();
  const int i = index < 0 ? index + n : index;
  check(i >= 0 && i < n, "dimension ", index, " out of range for tensor ", describe());
  return shape_[static_cast<size_t>(i)];
}

bool Tensor::is_contiguous() const { return strides_ == contiguous_strides(shape_); }

std::string Tensor::describe() const { return std::string(dtype_name(dtype_)) + shape_string(shape_); }

void Tensor::check_access(DType requested) const {
  check(defined(), "access to an undefined tensor");
  check(!is_meta(), "access to the data of a shape-only tensor ", describe());
  check(requested == dtype_, "tensor ", describe(), " accessed as ", dtype_name(requested));
}

Tensor Tensor::block(int64_t offset, const Shape& shape) const {
  check(is_contiguous(), "block() of a non-contiguous tensor ", describe());
  check(offset >= 0 && offset + shape_numel(shape) <= numel(), "block of ", shape_string(shape), " at ",
        offset, " lies outside tensor ", describe());
  Tensor t = *this;
  t.offset_ = offset_ + offset;
  t.shape_ = shape;
  t.strides_ = contiguous_strides(shape);
  return t;
}

Tensor Tensor::select(int64_t i) const {
  check(ndim() >= 1 && i >= 0 && i < shape_[0], "select(", i, ") out of range for ", describe());
  Shape rest(shape_.begin() + 1, shape_.end());
  return block(i * shape_numel(rest), rest);
}

Tensor Tensor::reshape(const Shape& shape) const {
  check(shape_numel(shape) == numel(), "cannot reshape ", describe(), " to ", shape_string(shape));
  return block(0, shape);
}

namespace {

// Each dtype's element read as double and written from one (bf16 and f16 rounded through float),
// typed at compile time so that whole-tensor loops need no switch per element.
template <DType D>
struct Element;
template <>
struct Element<DType::F32> {
  static double load(const void* b, int64_t i) { return static_cast<const float*>(b)[i]; }
  static void store(void* b, int64_t i, double v) { static_cast<float*>(b)[i] = static_cast<float>(v); }
};
template <>
struct Element<DType::F64> {
  static double load(const void* b, int64_t i) { return static_cast<const double*>(b)[i]; }
  static void store(void* b, int64_t i, double v) { static_cast<double*>(b)[i] = v; }
};
template <>
struct Element<DType::BF16> {
  static double load(const void* b, int64_t i) { return bf16_to_float(static_cast<const uint16_t*>(b)[i]); }
  static void store(void* b, int64_t i, double v) {
    static_cast<uint16_t*>(b)[i] = float_to_bf16(static_cast<float>(v));
  }
};
template <>
struct Element<DType::F16> {
  static double load(const void* b, int64_t i) { return f16_to_float(static_cast<const uint16_t*>(b)[i]); }
  static void store(void* b, int64_t i, double v) {
    static_cast<uint16_t*>(b)[i] = float_to_f16(static_cast<float>(v));
  }
};
template <>
struct Element<DType::I32> {
  static double load(const void* b, int64_t i) { return static_cast<const int32_t*>(b)[i]; }
  static void store(void* b, int64_t i, double v) { static_cast<int32_t*>(b)[i] = static_cast<int32_t>(v); }
};
template <>
struct Element<DType::I64> {
  static double load(const void* b, int64_t i) {
    return static_cast<double>(static_cast<const int64_t*>(b)[i]);
  }
  static void store(void* b, int64_t i, double v) { static_cast<int64_t*>(b)[i] = static_cast<int64_t>(v); }
};

// fn(std::integral_constant<DType, dtype>{}): the dtype as a compile-time value.
template <class Fn>
decltype(auto) with_dtype(DType dtype, Fn&& fn) {
  switch (dtype) {
    case DType::F32:
      return fn(std::integral_constant<DType, DType::F32>{});
    case DType::F64:
      return fn(std::integral_constant<DType, DType::F64>{});
    case DType::BF16:
      return fn(std::integral_constant<DType, DType::BF16>{});
    case DType::F16:
      return fn(std::integral_constant<DType, DType::F16>{});
    case DType::I32:
      return fn(std::integral_constant<DType, DType::I32>{});
    case DType::I64:
      break;
  }
  return fn(std::integral_constant<DType, DType::I64>{});
}

double load_as_double(const void* base, DType dtype, int64_t i) {
  return with_dtype(dtype, [&](auto d) { return Element<decltype(d)::value>::load(base, i); });
}

// Conversions of whole weight sets (billions of elements) run on every core.
void convert(DType from_dtype, DType to_dtype, const void* from, void* to, int64_t n) {
  with_dtype(from_dtype, [&](auto f) {
    with_dtype(to_dtype, [&](auto t) {
      parallel_for(n, int64_t{1} << 16, [&](int64_t begin, int64_t end) {
        for (int64_t i = begin; i < end; ++i)
          Element<decltype(t)::value>::store(to, i, Element<decltype(f)::value>::load(from, i));
      });
    });
  });
}

}  // namespace

void Tensor::copy_from(const Tensor& source) {
  check(source.numel() == numel(), "copy of ", source.describe(), " into ", describe(), ": sizes differ");
  check(is_contiguous() && source.is_contiguous(), "copy between non-contiguous tensors");
  if (source.dtype_ == dtype_) {
    std::memcpy(raw(), source.raw(), nbytes());
    return;
  }
  const bool integer_to_integer = !is_floating(dtype_) && !is_floating(source.dtype_);
  const int64_t n = numel();
  if (integer_to_integer) {
    for (int64_t i = 0; i < n; ++i) {
      const int64_t v = source.dtype_ == DType::I32 ? static_cast<const int32_t*>(source.raw())[i]
                                                    : static_cast<const int64_t*>(source.raw())[i];
      if (dtype_ == DType::I32)
        static_cast<int32_t*>(raw())[i] = static_cast<int32_t>(v);
      else
        static_cast<int64_t*>(raw())[i] = v;
    }
    return;
  }
  convert(source.dtype_, dtype_, source.raw(), raw(), n);
}

Tensor Tensor::to(DType dtype, MemoryCategory category) const {
  Tensor out = empty(shape_, dtype, category);
  out.copy_from(*this);
  return out;
}

void Tensor::fill_zero() {
  check(is_contiguous(), "fill_zero of a non-contiguous tensor");
  // On every core: a new tensor's pages are faulted in as they are written, and the AdamW state of
  // a billions-of-parameters model is tens of GB of them.
  char* bytes = static_cast<char*>(raw());
  parallel_for(static_cast<int64_t>(nbytes()), int64_t{1} << 22, [&](int64_t begin, int64_t end) {
    std::memset(bytes + begin, 0, static_cast<size_t>(end - begin));
  });
}

double Tensor::item_as_double(int64_t i) const {
  check(i >= 0 && i < numel(), "element ", i, " out of range for ", describe());
  return load_as_double(raw(), dtype_, i);
}

}  // namespace spindle
