#include "ops/cpu/backend.h"

namespace ocria_rt {

// out[m, n] = sum_k x[m, k] * W[n, k] (+ bias[n]). Threads split the output features; each weight
// row is streamed once and reused for every token row while it is in cache.
void CpuBackend::linear(const Tensor& x, const LinearWeight& w, const Tensor& out) {
  expect_cpu_f32(x, "linear input");
  expect_cpu_f32(out, "linear output");
  const Tensor& W = w.weight;
  const int64_t M = x.dim(0), K = x.dim(1), N = W.dim(0);
  if (W.dim(1) != K || out.dim(0) != M || out.dim(1) != N)
    throw Error(ErrorCode::kInternal, "linear: x " + x.shape_str() + ", W " + W.shape_str() + ", out " + out.shape_str());
  const float* bias = w.bias.defined() ? w.bias.ptr<const float>() : nullptr;
  constexpr int64_t kRowBlock = 8;  // token rows sharing one pass over a weight row
#pragma omp parallel for num_threads(threads_) schedule(static)
  for (int64_t n = 0; n < N; ++n) {
    const float* wr = W.ptr<const float>() + n * K;
    for (int64_t m0 = 0; m0 < M; m0 += kRowBlock) {
      const int64_t mb = std::min(kRowBlock, M - m0);
      float acc[kRowBlock] = {};
      for (int64_t j = 0; j < mb; ++j) {
        const float* xr = row_f32(x, m0 + j);
        float s = 0;
#pragma omp simd reduction(+ : s)
        for (int64_t k = 0; k < K; ++k) s += xr[k] * wr[k];
        acc[j] = s;
      }
      for (int64_t j = 0; j < mb; ++j) row_f32(out, m0 + j)[n] = acc[j] + (bias ? bias[n] : 0.0f);
    }
  }
}

}  // namespace ocria_rt
