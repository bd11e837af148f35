// FP8 (E4M3) and NVFP4 weight codes as NVIDIA ModelOpt writes them (shared QUANT.md), on the host,
// multi-threaded: the hot loops of ocria_rt.quantize (python/ocria_rt/quantization/formats.py wraps
// them; tests/quant_numpy.py holds a numpy reference they match bit for bit).
//
// FP8: code = e4m3(w / scale), the fp32 quotient rounded to the nearest E4M3 value (ties to the even
// code), |q| above 448 saturating, -0 keeping its sign bit.
// NVFP4 (blocks of 16 along K): block scale code = e4m3(clamp(block_amax * factor / (6 * gs), 2^-9, 448))
// (0x38 = 1.0 for an all-zero block), code = e2m1(w / (e4m3 value * gs)), nearest with ties to the
// even code, the sign bit set for negative w; two codes per byte, element 2j in the low nibble.
#pragma once
#include <cstdint>

namespace ocria_rt::weight_codes {

constexpr int64_t kBlock = 16;
constexpr int kMaxClipFactors = 64;

uint8_t e4m3_code(float x);
float e4m3_value(uint8_t code);
uint8_t e2m1_code(float q);
float e2m1_value(uint8_t code);

// Weights w [rows, K] are quantized times an optional per-column scale s [K] (the AWQ scales: w[r, k] * s[k]
// in fp32, as if the scaled weights were given); dequantized weights are optionally divided by a column
// divisor [K] and subtracted from a minuend [rows, K] (out = minuend - dequant / divisor, each step in fp32:
// the error of a quantization in the weights' own domain). Null pointers leave the step out.

// codes = e4m3((w * s) / scale).
void fp8_quantize(const float* w, int64_t rows, int64_t K, const float* col_scale, float scale, uint8_t* codes,
                  int threads);
// out = e4m3 value * scale (then the divisor and minuend).
void fp8_dequantize(const uint8_t* codes, int64_t rows, int64_t K, float scale, const float* col_divisor,
                    const float* minuend, float* out, int threads);

// The clip search of the NVFP4 block scales: each block's factor is the one of `factors` (in order;
// the first of equal errors) whose dequantized block d = w - dequant minimises d^T C_b d, C_b the
// block's 16 x 16 diagonal block of the input's second moment (`block_moments`, [K / 16, 16, 16]).
// At most kMaxClipFactors factors.
struct ClipSearch {
  const float* factors = nullptr;
  int count = 0;
  const float* block_moments = nullptr;
};

// NVFP4 of w [rows, K] (times s; K a multiple of 16) under the global scale gs: block scale codes
// [rows, K / 16] and packed codes [rows, K / 2]. Factor 1 (ModelOpt's scales) without a search.
// Returns how many blocks the search gave a scale code other than factor 1's.
int64_t nvfp4_quantize(const float* w, int64_t rows, int64_t K, const float* col_scale, float gs,
                       const ClipSearch* search, uint8_t* block_scales, uint8_t* packed, int threads);
// out [rows, K] = e2m1 value * e4m3 block scale value * gs (in that order, in fp32; then the divisor and
// minuend).
void nvfp4_dequantize(const uint8_t* packed, const uint8_t* block_scales, int64_t rows, int64_t K, float gs,
                      const float* col_divisor, const float* minuend, float* out, int threads);

}  // namespace ocria_rt::weight_codes
