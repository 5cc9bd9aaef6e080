// Element types, their sizes and names, and scalar conversions for the 16-bit floats.
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <string>
#include <string_view>

namespace spindle {

enum class DType : uint8_t { F32, F64, BF16, F16, I32, I64 };

size_t dtype_size(DType dtype);
// Spindle's short name: "f32", "f64", "bf16", "f16", "i32", "i64".
const char* dtype_name(DType dtype);
// Parses a short name; throws naming `what` (e.g. "--dtype") on anything else.
DType parse_dtype(std::string_view name, std::string_view what);
bool is_floating(DType dtype);

template <class T>
constexpr DType dtype_of();
template <>
constexpr DType dtype_of<float>() {
  return DType::F32;
}
template <>
constexpr DType dtype_of<double>() {
  return DType::F64;
}
template <>
constexpr DType dtype_of<int32_t>() {
  return DType::I32;
}
template <>
constexpr DType dtype_of<int64_t>() {
  return DType::I64;
}

// bfloat16 with round-to-nearest-even; NaN stays NaN.
inline uint16_t float_to_bf16(float value) {
  uint32_t bits;
  std::memcpy(&bits, &value, 4);
  if ((bits & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((bits >> 16) | 0x40u);
  bits += 0x7fffu + ((bits >> 16) & 1u);
  return static_cast<uint16_t>(bits >> 16);
}

inline float bf16_to_float(uint16_t value) {
  uint32_t bits = static_cast<uint32_t>(value) << 16;
  float out;
  std::memcpy(&out, &bits, 4);
  return out;
}

uint16_t float_to_f16(float value);
float f16_to_float(uint16_t value);

}  // namespace spindle
