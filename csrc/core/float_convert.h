// Scalar conversions between the storage dtypes and fp32, on the host.
#pragma once
#include <cmath>
#include <cstdint>
#include <cstring>

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

}  // namespace ocria_rt
