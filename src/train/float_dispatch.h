// Runs a body templated on the element type of a floating tensor (f32 or f64, the CPU path's
// dtypes), so the training utilities read and write weights and gradients in any of them.
#pragma once

#include <cstdint>
#include <string>

#include "core/dtype.h"
#include "core/error.h"

namespace spindle {

// Calls fn(T{}) with T = float or double for `dtype`; other dtypes are an error naming `what`.
template <class Fn>
void dispatch_float(DType dtype, const std::string& what, Fn&& fn) {
  switch (dtype) {
    case DType::F32:
      fn(float{});
      return;
    case DType::F64:
      fn(double{});
      return;
    default:
      fail(what, ": dtype ", dtype_name(dtype), " is not supported on the CPU path (expected f32 or f64)");
  }
}

// As dispatch_float, and bf16 too (T = uint16_t, its bits): the types weights are stored in.
template <class Fn>
void dispatch_weight(DType dtype, const std::string& what, Fn&& fn) {
  if (dtype == DType::BF16)
    fn(uint16_t{});
  else
    dispatch_float(dtype, what, fn);
}

}  // namespace spindle
