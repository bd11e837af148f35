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

// Round to nearest even; overflow -> inf, NaN stays NaN.
inline uint16_t float_to_f16(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  uint32_t sign = (u >> 16) & 0x8000u;
  uint32_t a = u & 0x7fffffffu;
  if (a > 0x7f800000u) return uint16_t(sign | 0x7e00u);
  if (a >= 0x477ff000u) return uint16_t(sign | 0x7c00u);  // overflow (incl. rounding up) -> inf
  if (a < 0x38800000u) {                                 // subnormal half or zero
    if (a < 0x33000000u) return uint16_t(sign);
    uint32_t e = a >> 23, man = (a & 0x7fffffu) | 0x800000u;
    uint32_t shift = 126 - e;  // 14 .. 24
    uint32_t r = man >> shift, rem = man & ((1u << shift) - 1), half = 1u << (shift - 1);
    if (rem > half || (rem == half && (r & 1u))) ++r;
    return uint16_t(sign | r);
  }
  uint32_t r = a - 0x38000000u;  // rebias exponent 127 -> 15
  uint32_t out = r >> 13, rem = r & 0x1fffu;
  if (rem > 0x1000u || (rem == 0x1000u && (out & 1u))) ++out;
  return uint16_t(sign | out);
}

// float8 e4m3fn: bit 7 sign, bits 3-6 exponent (bias 7), bits 0-2 mantissa; no infinities, and
// S.1111.111 is NaN.
inline float e4m3_to_float(uint8_t b) {
  const int exp = (b >> 3) & 0xF, mant = b & 0x7;
  float v;
  if (exp == 0) v = std::ldexp(float(mant), -9);  // zero / subnormal: mant / 8 * 2^-6
  else if (exp == 15 && mant == 7) v = NAN;
  else v = std::ldexp(float(8 + mant), exp - 10);  // (1 + mant / 8) * 2^(exp - 7)
  return (b & 0x80) ? -v : v;
}

// E2M1 (a 4-bit code, NVFP4's element): bit 3 sign, bits 0-2 index the magnitudes below.
inline float e2m1_to_float(uint8_t code) {
  static constexpr float kMagnitude[8] = {0.0f, 0.5f, 1.0f, 1.5f, 2.0f, 3.0f, 4.0f, 6.0f};
  const float v = kMagnitude[code & 0x7];
  return (code & 0x8) ? -v : v;
}

// dst[0:n] = src[0:n] converted to fp32 from F32 / BF16 / F16 / I32 / F8E4M3.
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
    case DType::F8E4M3:
      for (int64_t i = 0; i < n; ++i) dst[i] = e4m3_to_float(static_cast<const uint8_t*>(src)[i]);
      break;
    case DType::U8:
      for (int64_t i = 0; i < n; ++i) dst[i] = float(static_cast<const uint8_t*>(src)[i]);
      break;
  }
}

}  // namespace ocria_rt
