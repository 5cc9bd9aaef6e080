// Runs a body templated on the element type of a floating tensor (f32 or f64, the CPU path's
// dtypes), so the training utilities read and write weights and gradients in any of them.
#pragma once

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

}  // namespace spindle
