#include <array>
#include <cstring>
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

// The dot products of a tile of MB token rows by NB weight rows. Every out[m][n] is summed the same
// way whatever the tile (kLanes partial sums over k = lane (mod kLanes), the lanes added pairwise, then
// the remainder), so a token's outputs do not depend on how many tokens share the call: a verify of
// B tokens gives bit for bit the logits of B decode steps. Built for AVX-512, AVX2 + FMA and plain
// x86-64 and picked once at load time (target_clones), where the compiler supports it.
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__) && __GNUC__ >= 11
#define OCRIA_RT_CPU_CLONES __attribute__((target_clones("arch=x86-64-v4", "arch=x86-64-v3", "default")))
#else
#define OCRIA_RT_CPU_CLONES
#endif

constexpr int64_t kLanes = 16;
typedef float Lanes __attribute__((vector_size(kLanes * sizeof(float))));

// result[m * stride + n] = x[m] . w[n] for MB x NB rows.
template <int MB, int NB>
__attribute__((always_inline)) inline void dot_tile(const float* const* x, const float* const* w, int64_t K, float* result,
                                                  int64_t stride) {
  Lanes acc[MB][NB] = {};
  const int64_t K_lanes = K - K % kLanes;
  for (int64_t k = 0; k < K_lanes; k += kLanes) {
    Lanes xv[MB], wv[NB];
    for (int m = 0; m < MB; ++m) std::memcpy(&xv[m], x[m] + k, sizeof(Lanes));
    for (int n = 0; n < NB; ++n) std::memcpy(&wv[n], w[n] + k, sizeof(Lanes));
    for (int m = 0; m < MB; ++m)
      for (int n = 0; n < NB; ++n) acc[m][n] += xv[m] * wv[n];
  }
  for (int m = 0; m < MB; ++m)
    for (int n = 0; n < NB; ++n) {
      float tail = 0;
      for (int64_t k = K_lanes; k < K; ++k) tail += x[m][k] * w[n][k];
      Lanes v = acc[m][n];
      for (int half = kLanes / 2; half >= 1; half /= 2)  // lanes added pairwise: log2(kLanes) dependent adds
        for (int l = 0; l < half; ++l) v[l] += v[l + half];
      result[m * stride + n] = v[0] + tail;
    }
}

// result[m * kTile + n] = x[m] . w[n] for m < mb, n < nb (both at most kTile), in tiles that keep
// several independent FMA chains going: 4 x 4 (16 accumulators) for 4 tokens and rows, 1 x 4 for fewer
// tokens, one dot product at a time for the last rows.
constexpr int64_t kTile = 4;
OCRIA_RT_CPU_CLONES
void dot_tile(const float* const* x, int64_t mb, const float* const* w, int64_t nb, int64_t K, float* result) {
  if (mb == kTile && nb == kTile) {
    dot_tile<4, 4>(x, w, K, result, kTile);
    return;
  }
  for (int64_t m = 0; m < mb; ++m) {
    if (nb == kTile) {
      dot_tile<1, 4>(x + m, w, K, result + m * kTile, kTile);
      continue;
    }
    for (int64_t n = 0; n < nb; ++n) dot_tile<1, 1>(x + m, w + n, K, result + m * kTile + n, kTile);
  }
}

}  // namespace

// out[m, n] = sum_k (x[m, k] * input_scale[k]) * W[n, k] (+ bias[n]). Threads split the output
// features in tiles of kTile; each tile's weight rows are streamed once (quantized ones dequantized to
// fp32 first) and reused for every token row while they are in cache.
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
  const int64_t n_tiles = (N + kTile - 1) / kTile;
#pragma omp parallel num_threads(threads_)
  {
    std::vector<float> dequantized(w.quantized() ? size_t(kTile * K) : 0);
#pragma omp for schedule(static)
    for (int64_t t = 0; t < n_tiles; ++t) {
      const int64_t n0 = t * kTile, nb = std::min(kTile, N - n0);
      const float* w_rows[kTile];
      for (int64_t j = 0; j < nb; ++j) {
        w_rows[j] = w.weight.ptr<const float>() + (n0 + j) * K;
        if (w.quantized()) {
          dequantize_row(w, n0 + j, K, dequantized.data() + j * K);
          w_rows[j] = dequantized.data() + j * K;
        }
      }
      for (int64_t m0 = 0; m0 < M; m0 += kTile) {  // the weight rows stay in cache for every token
        const int64_t mb = std::min(kTile, M - m0);
        const float* x_rows[kTile];
        for (int64_t i = 0; i < mb; ++i) x_rows[i] = x_row(m0 + i);
        float result[kTile * kTile];
        dot_tile(x_rows, mb, w_rows, nb, K, result);
        for (int64_t i = 0; i < mb; ++i)
          for (int64_t j = 0; j < nb; ++j)
            row_f32(out, m0 + i)[n0 + j] = result[i * kTile + j] + (bias ? bias[n0 + j] : 0.0f);
      }
    }
  }
}

}  // namespace ocria_rt
