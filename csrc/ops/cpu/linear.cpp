#include <array>
#include <vector>

#include "core/float_convert.h"
#include "ops/cpu/backend.h"

namespace ocria_rt {

namespace {

using Format = LinearWeight::Format;

void expect(bool ok, const LinearWeight& w, const std::string& what) {
  if (!ok) throw Error(ErrorCode::kInternal, "linear: weight " + w.weight.shape_str() + ": " + what);
}

// Throws Error(kInternal) unless w is a well-formed LinearWeight (ops.h) of N outputs over K inputs.
void check_weight(const LinearWeight& w, int64_t K, int64_t N) {
  const Tensor& W = w.weight;
  expect(W.ndim == 2 && W.contiguous() && w.out_features() == N && w.in_features() == K, w,
         "does not match x's " + std::to_string(K) + " inputs and out's " + std::to_string(N) + " outputs");
  if (w.bias.defined()) expect(w.bias.dtype == DType::F32 && w.bias.numel() == N, w, "bias must be F32 [N]");
  if (!w.quantized()) {
    expect(W.dtype == DType::F32, w, "dense weight must be F32 on the CPU");
    expect(!w.input_scale.defined(), w, "a dense weight takes no input_scale");
    return;
  }
  expect(w.row_scale.dtype == DType::F32 && w.row_scale.ndim == 1 && w.row_scale.dim(0) == N, w,
         "row_scale must be F32 [N]");
  if (w.input_scale.defined())
    expect(w.input_scale.dtype == DType::F32 && w.input_scale.ndim == 1 && w.input_scale.dim(0) == K, w,
           "input_scale must be F32 [K]");
  if (w.format == Format::kFp8) {
    expect(W.dtype == DType::F8E4M3, w, "FP8 weight must be F8E4M3");
  } else {
    expect(W.dtype == DType::U8, w, "NVFP4 weight must be U8 (packed E2M1 pairs)");
    expect(K % LinearWeight::kNvfp4Block == 0, w, "NVFP4 needs K a multiple of 16");
    const Tensor& S = w.block_scale;
    expect(S.dtype == DType::F8E4M3 && S.ndim == 2 && S.contiguous() && S.dim(0) == N &&
               S.dim(1) == K / LinearWeight::kNvfp4Block,
           w, "block_scale must be F8E4M3 [N, K / 16]");
  }
}

// e4m3 code -> its fp32 value, for every code (a table: the decode is per weight element).
const std::array<float, 256>& e4m3_table() {
  static const std::array<float, 256> table = [] {
    std::array<float, 256> t{};
    for (int c = 0; c < 256; ++c) t[size_t(c)] = e4m3_to_float(uint8_t(c));
    return t;
  }();
  return table;
}

// out[0:K] = row n of W, dequantized to fp32 (the formulas of ops.h, rounded in their order:
// (e2m1 * block scale), exact, then times the row scale).
void dequantize_row(const LinearWeight& w, int64_t n, int64_t K, float* out) {
  const float row_scale = w.row_scale.ptr<const float>()[n];
  const std::array<float, 256>& e4m3 = e4m3_table();
  if (w.format == Format::kFp8) {
    const uint8_t* q = w.weight.ptr<const uint8_t>() + n * K;
    for (int64_t k = 0; k < K; ++k) out[k] = e4m3[q[k]] * row_scale;
    return;
  }
  constexpr int64_t kBlock = LinearWeight::kNvfp4Block;
  const uint8_t* packed = w.weight.ptr<const uint8_t>() + n * (K / 2);
  const uint8_t* block_scale = w.block_scale.ptr<const uint8_t>() + n * (K / kBlock);
  for (int64_t b = 0; b < K / kBlock; ++b) {
    float scaled[16];  // e2m1 code -> its value times this block's scale
    for (uint8_t c = 0; c < 16; ++c) scaled[c] = e2m1_to_float(c) * e4m3[block_scale[b]];
    for (int64_t j = 0; j < kBlock / 2; ++j) {
      const uint8_t byte = packed[b * kBlock / 2 + j];  // element 2j in the low nibble, 2j + 1 in the high one
      out[b * kBlock + 2 * j] = scaled[byte & 0xF] * row_scale;
      out[b * kBlock + 2 * j + 1] = scaled[byte >> 4] * row_scale;
    }
  }
}

}  // namespace

// out[m, n] = sum_k (x[m, k] * input_scale[k]) * W[n, k] (+ bias[n]). Threads split the output
// features; each weight row is streamed once (a quantized one dequantized to fp32 first) and reused
// for every token row while it is in cache.
void CpuBackend::linear(const Tensor& x, const LinearWeight& w, const Tensor& out) {
  expect_cpu_f32(x, "linear input");
  expect_cpu_f32(out, "linear output");
  const int64_t M = x.dim(0), K = x.dim(1), N = w.out_features();
  if (out.dim(0) != M || out.dim(1) != N)
    throw Error(ErrorCode::kInternal, "linear: x " + x.shape_str() + ", W " + w.weight.shape_str() + ", out " + out.shape_str());
  check_weight(w, K, N);

  // The rows of x, times input_scale where there is one.
  std::vector<float> scaled_x;
  if (w.input_scale.defined()) {
    scaled_x.resize(size_t(M * K));
    const float* s = w.input_scale.ptr<const float>();
    for (int64_t m = 0; m < M; ++m)
      for (int64_t k = 0; k < K; ++k) scaled_x[m * K + k] = row_f32(x, m)[k] * s[k];
  }
  auto x_row = [&](int64_t m) -> const float* { return scaled_x.empty() ? row_f32(x, m) : scaled_x.data() + m * K; };

  const float* bias = w.bias.defined() ? w.bias.ptr<const float>() : nullptr;
  constexpr int64_t kRowBlock = 8;  // token rows sharing one pass over a weight row
#pragma omp parallel num_threads(threads_)
  {
    std::vector<float> dequantized(w.quantized() ? size_t(K) : 0);
#pragma omp for schedule(static)
    for (int64_t n = 0; n < N; ++n) {
      const float* wr = w.weight.ptr<const float>() + n * K;
      if (w.quantized()) {
        dequantize_row(w, n, K, dequantized.data());
        wr = dequantized.data();
      }
      for (int64_t m0 = 0; m0 < M; m0 += kRowBlock) {
        const int64_t mb = std::min(kRowBlock, M - m0);
        float acc[kRowBlock] = {};
        for (int64_t j = 0; j < mb; ++j) {
          const float* xr = x_row(m0 + j);
          float s = 0;
#pragma omp simd reduction(+ : s)
          for (int64_t k = 0; k < K; ++k) s += xr[k] * wr[k];
          acc[j] = s;
        }
        for (int64_t j = 0; j < mb; ++j) row_f32(out, m0 + j)[n] = acc[j] + (bias ? bias[n] : 0.0f);
      }
    }
  }
}

}  // namespace ocria_rt
