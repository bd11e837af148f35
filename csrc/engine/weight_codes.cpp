#include "engine/weight_codes.h"

#include <algorithm>
#include <array>
#include <cmath>
#include <cstring>
#include <thread>

namespace ocria_rt::weight_codes {

namespace {

constexpr float kFp8Max = 448.0f;
constexpr uint8_t kE4m3One = 0x38;  // 1.0: the block scale of an all-zero block
// code -> value, the sign in bit 3 (a table: the sign is random, a branch on it would mispredict)
constexpr float kE2m1Values[16] = {0.0f,  0.5f,  1.0f,  1.5f,  2.0f,  3.0f,  4.0f,  6.0f,
                                   -0.0f, -0.5f, -1.0f, -1.5f, -2.0f, -3.0f, -4.0f, -6.0f};

int thread_count(int threads) { return threads > 0 ? threads : int(std::max(1u, std::thread::hardware_concurrency())); }

const std::array<float, 256>& e4m3_table() {
  static const std::array<float, 256> table = [] {
    std::array<float, 256> t{};
    for (int c = 0; c < 256; ++c) {
      const int exp = (c >> 3) & 0xF, man = c & 7;
      float mag = exp == 0 ? std::ldexp(float(man), -9) : std::ldexp(1.0f + float(man) / 8.0f, exp - 7);
      if (exp == 15 && man == 7) mag = NAN;
      t[size_t(c)] = (c & 0x80) ? -mag : mag;
    }
    return t;
  }();
  return table;
}

// The E4M3 code of one block's scale: block_amax * factor / (6 * gs), clamped to [2^-9, 448].
uint8_t block_scale_code(float amax, float factor, float six_gs) {
  if (!(amax > 0)) return kE4m3One;
  return e4m3_code(std::clamp((amax * factor) / six_gs, 0.001953125f, kFp8Max));
}

// One block's codes under a block scale code; returns d^T C d of its error d = w - dequant when C is given.
double quantize_block(const float* w, uint8_t scale_code, float gs, const float* C, uint8_t* codes) {
  const float bs = e4m3_value(scale_code), scale = bs * gs;
  float d[kBlock];
  for (int64_t k = 0; k < kBlock; ++k) {
    codes[k] = e2m1_code(w[k] / scale);
    d[k] = w[k] - (e2m1_value(codes[k]) * bs) * gs;
  }
  if (!C) return 0.0;
  double err = 0.0;
  for (int64_t i = 0; i < kBlock; ++i) {
    double row = 0.0;
    for (int64_t j = 0; j < kBlock; ++j) row += double(C[i * kBlock + j]) * double(d[j]);
    err += double(d[i]) * row;
  }
  return err;
}

}  // namespace

uint8_t e4m3_code(float x) {
  const uint8_t sign = std::signbit(x) ? 0x80 : 0;
  const float mag = std::min(std::fabs(x), kFp8Max);
  uint8_t code;
  if (!(mag > 0)) {
    code = 0;
  } else if (mag < 0.015625f) {  // subnormal: steps of 2^-9, so the code is the rounded multiple
    code = uint8_t(std::nearbyint(mag * 512.0f));
  } else {  // round the fp32 mantissa to 3 bits, to nearest even (a carry moves into the exponent)
    uint32_t bits;
    std::memcpy(&bits, &mag, 4);
    bits += 0x7FFFFu + ((bits >> 20) & 1u);
    code = uint8_t((((bits >> 23) - 120u) << 3) | ((bits >> 20) & 7u));
  }
  return code | sign;
}

float e4m3_value(uint8_t code) { return e4m3_table()[code]; }

uint8_t e2m1_code(float q) {
  const float m = std::fabs(q);
  // the index of the nearest magnitude: a tie (0.25, 0.75, ..., 5) goes to the even index
  const int index = (m > 0.25f) + (m >= 0.75f) + (m > 1.25f) + (m >= 1.75f) + (m > 2.5f) + (m >= 3.5f) + (m > 5.0f);
  return uint8_t(index | (std::signbit(q) ? 8 : 0));
}

float e2m1_value(uint8_t code) { return kE2m1Values[code & 15]; }

void fp8_quantize(const float* w, int64_t rows, int64_t K, const float* col_scale, float scale, uint8_t* codes,
                  int threads) {
#pragma omp parallel for num_threads(thread_count(threads)) schedule(static) if (rows * K > (1 << 16))
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t k = 0; k < K; ++k) {
      const float v = col_scale ? w[r * K + k] * col_scale[k] : w[r * K + k];
      codes[r * K + k] = e4m3_code(v / scale);
    }
}

namespace {

// out[k] = minuend[k] - v[k] / divisor[k] for one row (either step left out where its pointer is null).
inline void finish_row(float* out, const float* col_divisor, const float* minuend, int64_t K) {
  if (col_divisor)
    for (int64_t k = 0; k < K; ++k) out[k] /= col_divisor[k];
  if (minuend)
    for (int64_t k = 0; k < K; ++k) out[k] = minuend[k] - out[k];
}

}  // namespace

void fp8_dequantize(const uint8_t* codes, int64_t rows, int64_t K, float scale, const float* col_divisor,
                    const float* minuend, float* out, int threads) {
  const std::array<float, 256>& table = e4m3_table();
#pragma omp parallel for num_threads(thread_count(threads)) schedule(static) if (rows * K > (1 << 16))
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t k = 0; k < K; ++k) out[r * K + k] = table[codes[r * K + k]] * scale;
    finish_row(out + r * K, col_divisor, minuend ? minuend + r * K : nullptr, K);
  }
}

int64_t nvfp4_quantize(const float* w, int64_t rows, int64_t K, const float* col_scale, float gs,
                       const ClipSearch* search, uint8_t* block_scales, uint8_t* packed, int threads) {
  const int64_t nb = K / kBlock;
  const float six_gs = 6.0f * gs;
  int64_t changed = 0;
#pragma omp parallel for num_threads(thread_count(threads)) schedule(static) reduction(+ : changed) if (rows * K > (1 << 16))
  for (int64_t r = 0; r < rows; ++r) {
    uint8_t codes[kBlock], trial[kBlock];
    float wb[kBlock];
    for (int64_t b = 0; b < nb; ++b) {
      const float* src = w + r * K + b * kBlock;
      float amax = 0.0f;
      for (int64_t k = 0; k < kBlock; ++k) {
        wb[k] = col_scale ? src[k] * col_scale[b * kBlock + k] : src[k];
        amax = std::max(amax, std::fabs(wb[k]));
      }
      const uint8_t plain = block_scale_code(amax, 1.0f, six_gs);
      uint8_t best = plain;
      if (search && search->count > 0) {
        const float* C = search->block_moments + b * kBlock * kBlock;
        uint8_t candidate[kMaxClipFactors];
        double best_err = 0.0;
        for (int f = 0; f < search->count; ++f) {
          const uint8_t code = candidate[f] = block_scale_code(amax, search->factors[f], six_gs);
          // an earlier factor of the same code had the same error, and the first of equal ones stays
          if (std::find(candidate, candidate + f, code) != candidate + f) continue;
          const double err = quantize_block(wb, code, gs, C, trial);
          if (f == 0 || err < best_err) {
            best_err = err;
            best = code;
            std::memcpy(codes, trial, kBlock);
          }
        }
        changed += best != plain;
      } else {
        quantize_block(wb, best, gs, nullptr, codes);
      }
      block_scales[r * nb + b] = best;
      uint8_t* out = packed + r * (K / 2) + b * (kBlock / 2);
      for (int64_t j = 0; j < kBlock / 2; ++j) out[j] = uint8_t(codes[2 * j] | (codes[2 * j + 1] << 4));
    }
  }
  return changed;
}

void nvfp4_dequantize(const uint8_t* packed, const uint8_t* block_scales, int64_t rows, int64_t K, float gs,
                      const float* col_divisor, const float* minuend, float* out, int threads) {
  const int64_t nb = K / kBlock;
#pragma omp parallel for num_threads(thread_count(threads)) schedule(static) if (rows * K > (1 << 16))
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t b = 0; b < nb; ++b) {
      const float bs = e4m3_value(block_scales[r * nb + b]);
      const uint8_t* p = packed + r * (K / 2) + b * (kBlock / 2);
      float* o = out + r * K + b * kBlock;
      for (int64_t j = 0; j < kBlock / 2; ++j) {
        o[2 * j] = (e2m1_value(p[j] & 0xF) * bs) * gs;
        o[2 * j + 1] = (e2m1_value(p[j] >> 4) * bs) * gs;
      }
    }
    finish_row(out + r * K, col_divisor, minuend ? minuend + r * K : nullptr, K);
  }
}

}  // namespace ocria_rt::weight_codes
