// Scalar conversions between the storage dtypes and fp32, on the host.
#pragma once
#include <cmath>
#include <cstdint>
#include <cstring>

#include "core/tensor.h"

namespace ocria_rt {

inline float bf16_to_float(uint16_t h) {
  uint32_t bits = uint32_t(h) << 16;
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

// Round to nearest even; NaN stays NaN.
inline uint16_t float_to_bf16(float f) {
  uint32_t bits;
  std::memcpy(&bits, &f, 4);
  if (std::isnan(f)) return 0x7FC0;
  bits += 0x7FFF + ((bits >> 16) & 1);
  return uint16_t(bits >> 16);
}

inline float f16_to_float(uint16_t h) {
  const uint32_t sign = (h >> 15) & 1, exp = (h >> 10) & 0x1F, mant = h & 0x3FF;
  float v;
  if (exp == 0) v = std::ldexp(float(mant), -24);                  // zero / subnormal
  else if (exp == 31) v = mant ? NAN : INFINITY;
  else v = std::ldexp(float(mant | 0x400), int(exp) - 25);
  return sign ? -v : v;
}

// dst[0:n] = src[0:n] converted to fp32 from F32 / BF16 / F16 / I32.
inline void convert_to_f32(const void* src, DType src_dtype, float* dst, int64_t n) {
  switch (src_dtype) {
    case DType::F32: std::memcpy(dst, src, size_t(n) * 4); break;
    case DType::BF16:
      for (int64_t i = 0; i < n; ++i) dst[i] = bf16_to_float(static_cast<const uint16_t*>(src)[i]);
      break;
    case DType::F16:
      for (int64_t i = 0; i < n; ++i) dst[i] = f16_to_float(static_cast<const uint16_t*>(src)[i]);
      break;
    case DType::I32:
      for (int64_t i = 0; i < n; ++i) dst[i] = float(static_cast<const int32_t*>(src)[i]);
      break;
  }
}

}  // namespace ocria_rt
